"""User-facing tools over the pipeline: the CLI, `kvgen verify` and `kvgen bench`."""
