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
        if not 0 <= i < n if isinstance(i, int) else _outside(i, n):
            raise IndexError(f"{what} falls outside an extent of {n}")
        # i + n * flat in one op where both are grids: the full-size grid is made once a step
        flat = torch.add(i, flat, alpha=n) if isinstance(flat, torch.Tensor) and isinstance(i, torch.Tensor) \
            else flat * n + i
    return flat


def _outside(grid: torch.Tensor, n: int) -> bool:
    """Whether any entry of an index grid lies outside [0, n)."""
    if grid.numel() == 0:
        return False
    low, high = torch.aminmax(grid)
    return int(low) < 0 or int(high) >= n


def gather(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """values[where] of a flat tensor, flat, in `where`'s order (index_select: a third of
    advanced indexing's time on the CPU)."""
    return torch.index_select(values, 0, where.reshape(-1))


def put_last(dst: torch.Tensor, where: torch.Tensor, values: torch.Tensor) -> None:
    """dst[where] = values of a flat `dst`, where a position written twice keeps the later value
    (as a loop would). index_fill_ and index_copy_, not advanced indexing: half its time."""
    where, values = where.reshape(-1), values.reshape(-1).to(dst.dtype)
    written = torch.zeros(dst.numel(), dtype=torch.bool).index_fill_(0, where, True)
    if int(torch.count_nonzero(written)) == where.numel():  # no position twice: one plain scatter
        dst.index_copy_(0, where, values)
        return
    order = torch.arange(where.numel())
    last = torch.full((dst.numel(),), -1, dtype=torch.long).scatter_reduce_(0, where, order, reduce="amax")
    keep = gather(last, where) == order
    dst.index_copy_(0, where[keep], values[keep])


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
