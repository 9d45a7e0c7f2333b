"""`kvgen verify`: `run` (the command: the built-in specs against the engines' facts, then every
connector against the reference), one module per kind of connector (`connectors`, `transfers`,
`models`), the checks against the engines' live code (`engines`) and the worker pool (`pool`)."""
