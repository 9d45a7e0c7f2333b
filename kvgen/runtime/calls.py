"""Call signatures of the connector methods: the keywords each accepts, and the TypeErrors
for calls that do not fit (a misspelt keyword, a layerwise generator called like a whole
transfer). These are raised when the method is called, before anything is checked or moved.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any

#: The default of a required keyword, so a call without it reaches refuse_unknown first (a
#: misspelt `slot_maping=` is named with its did-you-mean, not reported as a missing one).
MISSING: Any = object()

#: Keywords per method; the positional arguments are fixed by each method's signature.
WHOLE_STORE = ("kvcaches", "slot_mapping", "offset")
WHOLE_LOAD = ("kvcaches", "slot_mapping", "offset", "skip_prefix_n_tokens")
LAYERWISE_STORE = (*WHOLE_STORE, "sync")
LAYERWISE_LOAD = (*WHOLE_LOAD, "sync")

STORE_PROTOCOL = (
    "batched_from_gpu is a generator: gen = connector.batched_from_gpu(memory_objs, starts, ends, kvcaches=..., "
    "slot_mapping=...) with memory_objs[layer][chunk] (one list per layer, one object per chunk); prime it with "
    "next(gen), step it with next(gen) once per layer; the last next(gen) synchronizes (L + 1 steps in all)")
LOAD_PROTOCOL = (
    "batched_to_gpu is a generator: gen = connector.batched_to_gpu(starts, ends, kvcaches=..., slot_mapping=...); "
    "prime it with next(gen), then gen.send(objs) once per layer with that layer's list of one memory object per "
    "chunk, then a final next(gen) (L + 2 steps in all)")


def refuse_unknown(method: str, given: Mapping[str, Any], accepted: Sequence[str], protocol: str = "") -> None:
    """TypeError naming the first keyword `method` does not take, and the ones it does."""
    if not given:
        return
    name = next(iter(given))
    close = difflib.get_close_matches(name, accepted, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    tail = f". {protocol}" if protocol else ""
    raise TypeError(f"{method}() got an unexpected keyword argument {name!r}{hint}; it accepts: "
                    f"{', '.join(accepted)}{tail}")


def refuse_whole_call(method: str, positional: int, protocol: str) -> None:
    """TypeError for a layerwise generator called with a whole transfer's arguments."""
    raise TypeError(f"{method}() of a layerwise connector takes {positional} positional arguments, but it was "
                    f"called like a whole-chunk transfer. {protocol}")


def refuse_missing(method: str, missing: Sequence[str], protocol: str = "") -> None:
    if missing:
        tail = f". {protocol}" if protocol else ""
        raise TypeError(f"{method}() is missing keyword argument{'s' if len(missing) > 1 else ''} "
                        f"{', '.join(map(repr, missing))}{tail}")


def check_keywords(method: str, unknown: Mapping[str, Any], accepted: Sequence[str], protocol: str = "",
                   **required: Any) -> None:
    """refuse_unknown, then refuse_missing for the `required` keywords left MISSING."""
    refuse_unknown(method, unknown, accepted, protocol)
    refuse_missing(method, [name for name, value in required.items() if value is MISSING], protocol)
