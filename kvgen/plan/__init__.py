"""Stage 2: a checked Library -> one typed plan for the whole build (copy plans, converters)."""
