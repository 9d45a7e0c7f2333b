"""Stage 1: YAML spec files -> schema check -> typed model -> semantic passes -> Library."""
