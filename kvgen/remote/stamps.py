"""Layout fingerprints on memory objects: an offload layer stamps what it stores with the
storing cache's fingerprint and checks it before loading into another cache, so KV stored
from another layout, TP split or spec version is refused instead of read as this one.

    remote.stamp(obj, remote.describe(caches, layout, tp_rank=r, tp_size=t))   # after a store
    remote.check_stamp(obj, remote.describe(other, layout, tp_rank=r, tp_size=t))  # before a load

Any object with a `.metadata` whose attributes can be set carries one (kvgen's MemoryObj has
the field; LMCache's metadata objects take the attribute). An object without a stamp passes:
what stored it did not say.
"""

from __future__ import annotations

from typing import Any

from kvgen.remote.describe import CacheDescription
from kvgen.runtime.errors import KVLayoutError


def stamp(obj: Any, d: CacheDescription) -> None:
    """Record on `obj` that it holds KV of the cache `d` describes."""
    try:
        obj.metadata.fingerprint = d.fingerprint
    except AttributeError as why:
        raise KVLayoutError(f"cannot stamp a {type(obj).__name__}: its .metadata takes no fingerprint ({why})") \
            from None


def check_stamp(obj: Any, d: CacheDescription) -> None:
    """KVLayoutError when `obj` was stamped from a cache of another fingerprint than `d`'s."""
    found = getattr(getattr(obj, "metadata", None), "fingerprint", None)
    if found is not None and found != d.fingerprint:
        raise KVLayoutError(f"the object was stored from a cache of layout fingerprint {found}, this cache's is "
                            f"{d.fingerprint} ({d}): another layout, dtype, TP split or spec version; it cannot "
                            "be loaded here as it is")


__all__ = ["check_stamp", "stamp"]
