"""The error connectors raise for bad input, before anything is written (see kvgen.errors)."""

from kvgen.errors import KVGenError, KVLayoutError

__all__ = ["KVGenError", "KVLayoutError"]
