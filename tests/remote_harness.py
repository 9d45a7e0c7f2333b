"""What the remote-transfer tests share: coordinate-coded ranks, a plan run by plain memmove
(no transport), and the reference's expected destination.

Every source rank is coded with its own salt, so a byte read from the wrong rank, the wrong
head, layer, K/V plane or slot shows in a bitwise comparison with the reference.
"""

from __future__ import annotations

import ctypes
import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
from harness import builtin_library

from kvgen import generated, remote, tp
from kvgen.oracle.reference import transfers
from kvgen.oracle.scenarios import clone_tree, same_bits
from kvgen.oracle.scenarios.layouts import NAMED_FACTOR
from kvgen.oracle.scenarios.transfers import DST_SALT, make_cache
from kvgen.spec.elements import split_extents, split_of

LIBRARY = builtin_library()
#: The layouts of built-in transfer pairs whose dims split an axis: SGLang's page_unified pool in
#: head groups (`H/g` with `H%g`), whose caches the tests make in groups of NAMED_FACTOR heads.
SPLIT_LAYOUTS = frozenset(n for pair in generated.TRANSFERS for n in pair
                          if any(split_of(a) is not None for a in LIBRARY[n].axes))
#: Every built-in transfer pair: remote plans each.
REMOTE_PAIRS = sorted(generated.TRANSFERS)
#: A source rank's salt: codes of different ranks (and the destination's) never meet.
RANK_SALT = 100000


@dataclass
class Case:
    """One destination rank being filled from every source rank of a TP split."""

    src: str
    dst: str
    src_ext: dict[str, int]
    dst_ext: dict[str, int]
    src_tp: int
    dst_tp: int
    dst_rank: int
    num_kv_heads: int

    def local(self, ext: dict[str, int], size: int, layout: str) -> dict[str, int]:
        """A rank's extents: its share of the heads, in groups of NAMED_FACTOR where its layout
        groups them (the rank's heads must be whole groups)."""
        spec = LIBRARY[layout]
        if not LIBRARY[self.src].has("H"):
            return dict(ext)
        out = {**ext, "H": tp.local_heads(self.num_kv_heads, size)}
        if spec.head_groups:
            out[spec.head_groups[1]] = NAMED_FACTOR
            out.update(split_extents(spec.axes, out))
        return out

    def extents(self) -> tuple[dict[str, int], dict[str, int]]:
        return self.local(self.src_ext, self.src_tp, self.src), self.local(self.dst_ext, self.dst_tp, self.dst)

    def caches(self, dtype: torch.dtype = torch.float32) -> tuple[list[Any], Any]:
        s_ext, d_ext = self.extents()
        srcs = [make_cache(LIBRARY[self.src], s_ext, dtype, "cpu", RANK_SALT * (r + 1)) for r in range(self.src_tp)]
        return srcs, make_cache(LIBRARY[self.dst], d_ext, dtype, "cpu", DST_SALT)

    def describe(self, srcs: list[Any], dst: Any) -> tuple[list[remote.Description], remote.Description]:
        heads = self.num_kv_heads
        sd = [remote.describe(c, self.src, tp_rank=r, tp_size=self.src_tp, num_kv_heads=heads)
              for r, c in enumerate(srcs)]
        return sd, remote.describe(dst, self.dst, tp_rank=self.dst_rank, tp_size=self.dst_tp, num_kv_heads=heads)

    def expected(self, srcs: list[Any], dst: Any, src_slots: list[int], dst_slots: list[int]) -> Any:
        """The destination as the reference leaves it: every route of this rank, one by one."""
        want = clone_tree(dst)
        mla = not LIBRARY[self.src].has("H")
        s_ext, d_ext = self.extents()
        for r in tp.plan(self.num_kv_heads, self.src_tp, self.dst_tp, mla=mla):
            if r.dst_rank == self.dst_rank:
                transfers.transfer(
                    transfers.TransferSide(LIBRARY[self.src], s_ext, srcs[r.src_rank], src_slots,
                                                    None if mla else r.src_heads),
                    transfers.TransferSide(LIBRARY[self.dst], d_ext, want, dst_slots,
                                                    None if mla else r.dst_heads))
        return want


#: Layouts of several parts the remote tests move, with each part's C (values per row): K and V
#: of different head sizes (folded slots), and MLA latent and rope (blocks).
PART_WIDTHS = {"sglang_mha_v_head": {"k": 8, "v": 4}, "vllm_ascend_mla": {"latent": 16, "rope": 4}}
#: The destination's salt in a PartsCase (no source rank's).
PARTS_DST_SALT = 9 * RANK_SALT


def paged_layout(spec: str) -> Any:
    """The generated PagedLayout of `spec`."""
    name = generated.resolve(spec)
    return generated.get(name, next(o for s, o in generated.CONNECTORS if s == name)).layout


@dataclass
class PartsCase:
    """One destination rank of a layout of several parts filled from every source rank. Every
    element's value codes (part, layer, global head, slot, channel) plus its rank's salt. The
    parts' dims are tokens, heads (if any), then C, singletons aside."""

    spec: str
    src_tp: int
    dst_tp: int
    dst_rank: int
    blocks: tuple[int, int] = (4, 4)  # the block size of each side (where the layout has blocks)
    slots: int = 16
    layers: int = 2
    num_kv_heads: int = 4

    def code(self, part: int, layer: int, head: int, slot: int, c: int) -> int:
        return (((part * self.layers + layer) * self.num_kv_heads + head) * self.slots + slot) * 16 + c

    def _heads(self, part: int, size: int, rank: int) -> tuple[int, int]:
        """The global heads part `part` holds on rank `rank` of `size` ((0, 1) for a part without heads)."""
        return tp.rank_heads(self.num_kv_heads, size, rank) if self._headed(part) else (0, 1)

    def _headed(self, part: int) -> bool:
        return any("H" in d for d in paged_layout(self.spec).parts[part][1])

    def _width(self, part: int) -> int:
        return PART_WIDTHS[self.spec][paged_layout(self.spec).parts[part][0]]

    def cache(self, size: int, rank: int, block: int, salt: int) -> Any:
        """Rank `rank` of `size`'s cache: its lists of leaves, each element its code plus `salt`."""
        paged = paged_layout(self.spec)

        def leaf(part: int, layer: int) -> torch.Tensor:
            lo, hi = self._heads(part, size, rank)
            s, h, c = torch.meshgrid(torch.arange(self.slots), torch.arange(lo, hi), torch.arange(self._width(part)),
                                     indexing="ij")
            codes = self.code(part, layer, 0, 0, 0) + (h * self.slots + s) * 16 + c + salt
            ext = {"B": self.slots // block, "N": block, "H": hi - lo, "C": self._width(part)}
            dims = paged.parts[part][1]
            return codes.to(torch.float32).reshape(
                [self.slots if d == ("B", "N") else math.prod(ext[a] for a in d) for d in dims]).clone()

        return _nest(paged.lists, leaf, self.layers, len(paged.parts))

    def caches(self) -> tuple[list[Any], Any]:
        srcs = [self.cache(self.src_tp, r, self.blocks[0], RANK_SALT * (r + 1)) for r in range(self.src_tp)]
        return srcs, self.cache(self.dst_tp, self.dst_rank, self.blocks[1], PARTS_DST_SALT)

    def describe(self, srcs: list[Any], dst: Any) -> tuple[list[remote.CacheDescription], remote.CacheDescription]:
        sd = [remote.describe(c, self.spec, tp_rank=r, tp_size=self.src_tp, num_kv_heads=self.num_kv_heads)
              for r, c in enumerate(srcs)]
        return sd, remote.describe(dst, self.spec, tp_rank=self.dst_rank, tp_size=self.dst_tp,
                                   num_kv_heads=self.num_kv_heads)

    def owner(self, part: int, head: int) -> int:
        """The source rank a destination head is read from: the one holding it (a part without
        heads: rank dst_rank % src_tp, its one route's)."""
        if not self._headed(part):
            return self.dst_rank % self.src_tp
        return head // (self.num_kv_heads // self.src_tp)

    def expected(self, src_slots: list[int], dst_slots: list[int]) -> Any:
        """The destination after the move, worked out element by element from the codes."""
        paged = paged_layout(self.spec)
        before = self.cache(self.dst_tp, self.dst_rank, self.blocks[1], PARTS_DST_SALT)

        def leaf(part: int, layer: int) -> torch.Tensor:
            lo, _ = self._heads(part, self.dst_tp, self.dst_rank)
            old = _leaf(before, paged.lists, part, layer)
            view = old.reshape(self.slots, -1, self._width(part)).clone()
            for s, d in zip(src_slots, dst_slots, strict=True):
                for h, c in itertools.product(range(view.shape[1]), range(view.shape[2])):
                    if s >= 0 and d >= 0:
                        salt = RANK_SALT * (self.owner(part, lo + h) + 1)
                        view[d, h, c] = self.code(part, layer, lo + h, s, c) + salt
            return view.reshape(old.shape)

        return _nest(paged.lists, leaf, self.layers, len(paged.parts))


def _nest(lists: tuple[str, ...], leaf: Any, layers: int, parts: int) -> Any:
    """The list levels (L and P) over leaf(part, layer)."""
    def level(k: int, part: int, layer: int) -> Any:
        if k == len(lists):
            return leaf(part, layer)
        if lists[k] == "P":
            return [level(k + 1, i, layer) for i in range(parts)]
        return [level(k + 1, part, i) for i in range(layers)]

    return level(0, 0, 0)


def _leaf(tree: Any, lists: tuple[str, ...], part: int, layer: int) -> torch.Tensor:
    for axis in lists:
        tree = tree[part if axis == "P" else layer]
    return tree


def run_by_memmove(p: remote.Plan, dst_caches: Any) -> None:
    """Carry out a plan as a transport would, one descriptor at a time, then its staging."""
    for read in p.reads:
        for (sa, n, _), (da, m, _) in zip(read.src_descs.tolist(), read.dst_descs.tolist(), strict=True):
            assert n == m, "a descriptor pair of unequal lengths"
            ctypes.memmove(da, sa, n)
    p.finish(dst_caches)


def moved_right(case: Case, src_slots: list[int], dst_slots: list[int], strategy: str | None) -> tuple[bool, str]:
    srcs, dst = case.caches()
    before = [clone_tree(c) for c in srcs]
    sd, dd = case.describe(srcs, dst)
    want = case.expected(srcs, dst, src_slots, dst_slots)
    p = remote.plan(sd, dd, torch.tensor(src_slots), torch.tensor(dst_slots), strategy=strategy)
    run_by_memmove(p, dst)
    untouched = all(same_bits(a, b) for a, b in zip(srcs, before, strict=True))
    return same_bits(dst, want) and untouched, p.strategy


__all__ = ["LIBRARY", "PART_WIDTHS", "REMOTE_PAIRS", "SPLIT_LAYOUTS", "Case", "PartsCase", "moved_right",
           "run_by_memmove"]
