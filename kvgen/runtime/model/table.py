"""The tables a generated model connector holds, and where each section of its object lies.

A groups object (KVGEN_GROUPS, ...) is bytes: each carried group's section is that group's
member object for the chunk (its bytes), then, for each carried state group, each layer
ascending and each tensor in order, one request's state (the tensor's row at the request's
slot). Every section starts at a multiple of REGION_ALIGN bytes and the total is rounded up
to one, so an object carrying fewer state groups is a prefix of one carrying more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvgen.runtime.errors import KVLayoutError
from kvgen.runtime.planes import REGION_ALIGN

#: (name, shape at TP 1, dtypes, split dim or None) of one state tensor.
TensorTable = tuple[str, tuple[int, ...], tuple[str, ...], "int | None"]


@dataclass(frozen=True)
class GroupTable:
    """One carried attention group: its cache-list entries and the member object its section is."""

    name: str
    layers: tuple[int, ...]
    layout: str
    member: str
    #: The member connector's module, relative to the generated package.
    module: str
    #: Declared extents at TP 1: H, C, N, or C.PART.
    sizes: tuple[tuple[str, int], ...]
    dtypes: tuple[str, ...]
    window: int | None = None
    #: Tokens one stored slot covers: the group's slot mapping and member object hold one entry
    #: per k tokens of a chunk (DeepSeek-V4's compressed caches).
    tokens_per_slot: int = 1

    def size(self, axis: str) -> int | None:
        return dict(self.sizes).get(axis)

    def slots_of(self, tokens: int, what: str) -> int:
        """The stored slots of `tokens` tokens (a start, an end, a count); refused unless whole slots."""
        k = self.tokens_per_slot
        if tokens % k:
            raise KVLayoutError(f"group {self.name!r} stores one slot per {k} tokens: {what} {tokens} is not a "
                                f"multiple of {k}")
        return tokens // k


@dataclass(frozen=True)
class StateTable:
    """One carried state group: its cache-list entries, each a tuple of these tensors [S, *shape]."""

    name: str
    layers: tuple[int, ...]
    tensors: tuple[TensorTable, ...]

    @staticmethod
    def rank_shape(tensor: TensorTable, tp: int) -> tuple[int, ...]:
        _, shape, _, split = tensor
        return tuple(n // tp if i == split else n for i, n in enumerate(shape))


class Section(NamedTuple):
    """One section of a groups object: a group's member object or one state tensor's row."""

    name: str
    kind: str  # "group" or "state"
    offset: int
    nbytes: int
    detail: str


def align(n: int) -> int:
    return -(-n // REGION_ALIGN) * REGION_ALIGN


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def state_section_name(state: str, layer: int, tensor: str) -> str:
    """`linear[0].conv`: state group, cache-list entry, tensor."""
    return f"{state}[{layer}].{tensor}"


def lay_out(pieces: list[tuple[str, str, int, str]]) -> tuple[tuple[Section, ...], int]:
    """Sections of (name, kind, nbytes, detail) placed one after another, each aligned; and the total."""
    out, at = [], 0
    for name, kind, nbytes, detail in pieces:
        out.append(Section(name, kind, at, nbytes, detail))
        at = align(at + nbytes)
    return tuple(out), at
