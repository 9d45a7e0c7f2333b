"""What the references of every kind share: the tokens a chunk moves (`Span`), a leaf of a
container tree, a scatter that keeps the later of two writes, and torch on one thread."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from kvgen.runtime.threads import intra_op_threads


def leaf(tree: Any, path: Sequence[int]) -> torch.Tensor:
    for i in path:
        tree = tree[i]
    return tree


def flat_index(index: Sequence[Any], extents: Sequence[int], what: str = "an address") -> Any:
    """The row-major flat index of `index` (index grids that broadcast, or ints, which stay ints:
    one torch op each would cost more than the arithmetic) over `extents`, each component
    checked to lie within its extent (else IndexError, naming `what`)."""
    flat: Any = 0
    for i, n in zip(index, extents, strict=True):
        if not 0 <= i < n if isinstance(i, int) else bool(((i < 0) | (i >= n)).any()):
            raise IndexError(f"{what} falls outside an extent of {n}")
        flat = flat * n + i
    return flat


def put_last(dst: torch.Tensor, where: torch.Tensor, values: torch.Tensor) -> None:
    """dst[where] = values, where a position written twice keeps the later value (as a loop would)."""
    where, values = where.reshape(-1), values.reshape(-1)
    written = torch.zeros(dst.numel(), dtype=torch.bool)
    written[where] = True
    if int(torch.count_nonzero(written)) == where.numel():  # no position twice: one plain scatter
        dst[where] = values.to(dst.dtype)
        return
    order = torch.arange(where.numel())
    last = torch.full((dst.numel(),), -1, dtype=torch.long).scatter_reduce_(0, where, order, reduce="amax")
    keep = last[where] == order
    dst[where[keep]] = values[keep].to(dst.dtype)


F = TypeVar("F", bound=Callable[..., Any])


def one_thread(fn: F) -> F:
    """`fn` with torch on one intra-op thread: the reference's ops are small, and on a host
    whose cores are taken each parallel region's barrier waits a scheduling slice (as
    kvgen.runtime.threads.cpu_threads says for connectors), which made them ~30x slower."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with intra_op_threads(1):
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]


def tokens(slot_mapping: Sequence[int], start: int, end: int, offset: int = 0,
           skip: int = 0) -> Iterator[tuple[int, int]]:
    """(position in chunk, slot) of every token a transfer moves."""
    for i in range(start + skip, end):
        slot = int(slot_mapping[i - offset])
        if slot >= 0:
            yield i - start, slot


@dataclass(frozen=True)
class Span:
    """The tokens one chunk moves: [start, end) of the sequence, token i's slot at
    `slot_mapping[i - offset]` (< 0: not moved), the first `skip` tokens of the chunk left alone
    (a load's skip_prefix_n_tokens)."""

    slot_mapping: Sequence[int]
    start: int
    end: int
    offset: int = 0
    skip: int = 0
