"""Layout fingerprints on memory objects: an offload layer stamps what it stores with the
storing cache's fingerprint, and a connector told its cache's description refuses to load an
object stamped from another, so KV stored from another layout, TP split or spec version is
refused instead of read as this one.

    remote.stamp(obj, remote.describe(caches, layout, tp_rank=r, tp_size=t))   # after a store
    remote.check_loads(connector, remote.describe(other, layout, tp_rank=r, tp_size=t))
    connector.to_gpu(obj, ...)       # refused, before any write, when the stamps differ

Any object with a `.metadata` whose attributes can be set carries one (kvgen's MemoryObj has
the field; LMCache's metadata objects take the attribute). An object without a stamp passes:
what stored it did not say.
"""

from __future__ import annotations

from typing import Any

from kvgen.remote.describe import CacheDescription
from kvgen.runtime.errors import KVLayoutError
from kvgen.runtime.memory import check_fingerprint


def stamp(obj: Any, d: CacheDescription) -> None:
    """Record on `obj` that it holds KV of the cache `d` describes."""
    try:
        obj.metadata.fingerprint = d.fingerprint
    except AttributeError as why:
        raise KVLayoutError(f"cannot stamp a {type(obj).__name__}: its .metadata takes no fingerprint ({why})") \
            from None


def check_stamp(obj: Any, d: CacheDescription) -> None:
    """KVLayoutError when `obj` was stamped from a cache of another fingerprint than `d`'s."""
    check_fingerprint(getattr(obj, "metadata", None), d.fingerprint)


def check_loads(connector: Any, d: CacheDescription) -> None:
    """Make `connector` (a generated connector of d's layout) refuse, in each load before any
    write, objects stamped from a cache of another fingerprint than `d`'s (the cache it loads into)."""
    layout = getattr(getattr(connector, "layout", None), "name", None)
    if layout != d.spec or not hasattr(connector, "layout_fingerprint"):
        raise KVLayoutError(f"the description describes a {d.spec} cache; this connector moves {layout} "
                            f"({type(connector).__name__}): check loads with a description of its own cache")
    connector.layout_fingerprint = d.fingerprint


__all__ = ["check_loads", "check_stamp", "stamp"]
