"""Memory objects and format labels, compatible with LMCache's duck types.

A memory object is anything with `.tensor` and `.metadata.fmt`. A format label is
None (fresh object), a kvgen `Format`, or any enum member: kvgen compares labels by
`.name`, so LMCache's own `MemoryFormat` enum works unchanged.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvgen.interface import UNDEFINED
from kvgen.runtime.errors import KVLayoutError


@dataclass(frozen=True)
class Format:
    """A memory format label: the name LMCache uses and its integer code."""

    name: str
    value: int

    def __eq__(self, other: object) -> bool:
        return format_name(other) == self.name if other is not None else False

    def __hash__(self) -> int:
        return hash(self.name)


def format_name(fmt: Any) -> str:
    """The label's name; None (a fresh object) reads as UNDEFINED."""
    if fmt is None:
        return UNDEFINED
    name = getattr(fmt, "name", None)
    if not isinstance(name, str):
        raise TypeError(f"memory format must be None or have a .name, got {fmt!r}")
    return name


def relabel(current: Any, target: Format) -> Any:
    """The label to store after a write: a member of the caller's own enum when it has one."""
    if isinstance(current, enum.Enum):
        try:
            return type(current)[target.name]
        except KeyError:
            pass
    return target


def check_relabel(metadata: Any, what: str | Callable[[], str]) -> None:
    """Refuse, before a store writes anything, an object whose label cannot be set after it
    (a frozen or read-only metadata): setting it to the label it has is the one test that
    every kind of read-only attribute fails, and changes nothing. `what` names the object
    (a callable is called only for the message: spelling out a layout costs more than the check)."""
    try:
        metadata.fmt = metadata.fmt
    except (AttributeError, TypeError) as exc:
        what = what() if callable(what) else what
        raise KVLayoutError(f"{what}: its format label (.metadata.fmt) cannot be set, which a store does after "
                            f"writing it ({type(exc).__name__}: {exc}); pass an object whose label can be "
                            "set") from None


def check_fingerprint(metadata: Any, expected: str | None) -> None:
    """Refuse, before a load writes anything, an object stamped (`.metadata.fingerprint`) from a
    cache of another layout fingerprint than `expected` (kvgen.remote's CacheDescription
    fingerprint of the loading cache). One comparison: None on either side checks nothing."""
    found = getattr(metadata, "fingerprint", None)
    if expected is not None and found is not None and found != expected:
        raise KVLayoutError(f"the object was stored from a cache of layout fingerprint {found}, this cache's is "
                            f"{expected}: another layout, dtype, TP split or spec version; it cannot be loaded "
                            "here as it is")


@dataclass
class Metadata:
    fmt: Any = None
    #: The layout fingerprint of the cache the object was stored from (kvgen.remote's
    #: Description.fingerprint), when the storing side sets it; None: not recorded.
    fingerprint: str | None = None


@dataclass
class MemoryObj:
    """The plain memory object: a tensor and its format label."""

    tensor: torch.Tensor
    metadata: Metadata = field(default_factory=Metadata)

    def __init__(self, tensor: torch.Tensor, fmt: Any = None):
        self.tensor = tensor
        self.metadata = Metadata(fmt)
