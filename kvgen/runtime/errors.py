"""The one error type connectors raise for bad input, before anything is written."""


class KVLayoutError(ValueError):
    """A cache, memory object or slot mapping that does not match the declared layout."""
