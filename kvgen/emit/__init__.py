"""Stage 3: render a plan through the templates and write the package in one atomic step."""
