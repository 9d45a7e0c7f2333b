"""Call signatures of the connector methods: the keywords each accepts, and the TypeErrors
for calls that do not fit (a misspelt keyword, a layerwise generator called like a whole
transfer). These are raised when the method is called, before anything is checked or moved.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

Method = TypeVar("Method", bound=Callable[..., Any])

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


def keywords_named(protocol: str = "") -> Callable[[Method], Method]:
    """A decorator: the method takes the keywords its signature names, and a call with another
    one fails as refuse_unknown fails it (the keyword, a close match, the ones it takes), where
    Python's own TypeError names no match. For methods whose parameters are all spent (at most
    six) and so cannot take a `**unknown` of their own."""
    def wrap(method: Method) -> Method:
        params = inspect.signature(method).parameters
        accepted = tuple(n for n, p in params.items() if p.kind is p.KEYWORD_ONLY)

        @functools.wraps(method)
        def checked(*args: Any, **kwargs: Any) -> Any:
            refuse_unknown(method.__name__, {k: v for k, v in kwargs.items() if k not in params}, accepted, protocol)
            return method(*args, **kwargs)
        return checked  # type: ignore[return-value]  # the same signature, by functools.wraps
    return wrap


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
