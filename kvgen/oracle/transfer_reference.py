"""The reference for layout-to-layout transfers: a slow, obviously correct copy, element by element.

For every token whose source and destination slots are both >= 0, and every (layer, kv, head,
c) of the ranges moved, it reads the element where `kvgen.oracle.address` puts it in the source
spec and writes it where the same function puts it in the destination spec. It never sees the
planner or generated code, works on plain Python lists of the caches' bits, and so says what
any generated transfer must leave in the destination.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvgen.oracle.address import element_address
from kvgen.oracle.reference import leaf, leaf_paths
from kvgen.runtime.ops import bits
from kvgen.spec.model import Spec

Extents = Mapping[str, int]
Heads = tuple[int, int]


def _lists(spec: Spec, ext: Extents, tree: Any) -> dict[tuple[int, ...], Any]:
    return {path: bits(leaf(tree, path)).tolist() for path in leaf_paths(spec, ext)}


def _at(nested: Any, index: tuple[int, ...]) -> tuple[Any, int]:
    for i in index[:-1]:
        nested = nested[i]
    return nested, index[-1]


def heads_of(spec: Spec, ext: Extents, heads: Heads | None) -> Heads:
    """A head range, by default every head (one, for layouts without heads)."""
    return heads if heads is not None else (0, ext["H"] if spec.has("H") else 1)


def transfer(src: Spec, src_ext: Extents, src_caches: Any, src_slots: Sequence[int],
             dst: Spec, dst_ext: Extents, dst_caches: Any, dst_slots: Sequence[int],
             src_heads: Heads | None = None, dst_heads: Heads | None = None) -> None:
    """Copy the KV of each token from its source slot to its destination slot, in place."""
    sh, dh = heads_of(src, src_ext, src_heads), heads_of(dst, dst_ext, dst_heads)
    if sh[1] - sh[0] != dh[1] - dh[0]:
        raise ValueError(f"head ranges {sh} and {dh} differ in length")
    source, target = _lists(src, src_ext, src_caches), _lists(dst, dst_ext, dst_caches)
    planes = src_ext["KV"] if src.has("KV") else 1
    for s, d in zip(src_slots, dst_slots, strict=True):
        s, d = int(s), int(d)
        if s < 0 or d < 0:
            continue
        for layer, kv, j, c in itertools.product(range(src_ext["L"]), range(planes), range(sh[1] - sh[0]),
                                                 range(src_ext["C"])):
            spath, sindex = element_address(src, {"l": layer, "kv": kv, "h": sh[0] + j, "c": c, "slot": s}, src_ext)
            dpath, dindex = element_address(dst, {"l": layer, "kv": kv, "h": dh[0] + j, "c": c, "slot": d}, dst_ext)
            from_list, i = _at(source[spath], sindex)
            to_list, k = _at(target[dpath], dindex)
            to_list[k] = from_list[i]
    for path, nested in target.items():
        raw = bits(leaf(dst_caches, path))
        raw.copy_(torch.tensor(nested, dtype=raw.dtype, device=raw.device))
