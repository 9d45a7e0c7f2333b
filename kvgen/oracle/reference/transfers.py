"""The reference for layout-to-layout transfers: an obviously correct copy, element by element.

For every token whose source and destination slots are both >= 0, and every (layer, kv, head,
c) of the ranges moved, it reads the element where `kvgen.oracle.address` puts it in the source
spec and writes it where the same function puts it in the destination spec. It never sees the
planner or generated code and so says what any generated transfer must leave in the
destination. As in kvgen.oracle.reference.layouts, the addresses are worked out on index grids
of every element at once and the elements move as one gather and scatter of the caches' bits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvgen.oracle.reference.common import gather, one_thread, put_last
from kvgen.oracle.reference.layouts import element_positions, flat_bits, leaf_paths, write_back
from kvgen.spec.model import Spec

Extents = Mapping[str, int]
Heads = tuple[int, int]


def heads_of(spec: Spec, ext: Extents, heads: Heads | None) -> Heads:
    """A head range, by default every head (one, for layouts without heads)."""
    return heads if heads is not None else (0, ext["H"] if spec.has("H") else 1)


@dataclass(frozen=True)
class TransferSide:
    """One side of a reference transfer: its spec at extents `ext`, its caches, each token's slot
    (< 0: the token is not moved) and its head range (None: every head)."""

    spec: Spec
    ext: Extents
    caches: Any
    slots: Sequence[int]
    heads: Heads | None = None


@one_thread
def transfer(source_side: TransferSide, target_side: TransferSide) -> None:
    """Copy the KV of each token from its source slot to its destination slot, in place."""
    src, src_ext, src_caches, src_slots = source_side.spec, source_side.ext, source_side.caches, source_side.slots
    dst, dst_ext, dst_caches, dst_slots = target_side.spec, target_side.ext, target_side.caches, target_side.slots
    sh, dh = heads_of(src, src_ext, source_side.heads), heads_of(dst, dst_ext, target_side.heads)
    if sh[1] - sh[0] != dh[1] - dh[0]:
        raise ValueError(f"head ranges {sh} and {dh} differ in length")
    moved = [(int(s), int(d)) for s, d in zip(src_slots, dst_slots, strict=True) if int(s) >= 0 and int(d) >= 0]
    if not moved:
        return
    src_paths, dst_paths = leaf_paths(src, src_ext), leaf_paths(dst, dst_ext)
    source, src_shape = flat_bits(src_caches, src_paths)
    target, dst_shape = flat_bits(dst_caches, dst_paths)
    s, d = (torch.tensor(v).view(-1, 1, 1, 1, 1) for v in zip(*moved, strict=True))
    grid = [src_ext["L"], src_ext["KV"] if src.has("KV") else 1, sh[1] - sh[0], src_ext["C"]]
    layer, kv, j, c = (torch.arange(n).view([1] + [n if i == k else 1 for i in range(4)]) for k, n in enumerate(grid))
    here = element_positions(src, {"l": layer, "kv": kv, "h": sh[0] + j, "c": c, "slot": s}, src_ext, src_shape)
    there = element_positions(dst, {"l": layer, "kv": kv, "h": dh[0] + j, "c": c, "slot": d}, dst_ext, dst_shape)
    here, there = torch.broadcast_tensors(here, there)
    put_last(target, there, gather(source, here))
    write_back(dst_caches, dst_paths, target)
