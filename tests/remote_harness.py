"""What the remote-transfer tests share: coordinate-coded ranks, a plan run by plain memmove
(no transport), and the reference's expected destination.

Every source rank is coded with its own salt, so a byte read from the wrong rank, the wrong
head, layer, K/V plane or slot shows in a bitwise comparison with the reference.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch
from harness import builtin_library

from kvgen import remote, tp
from kvgen.oracle.reference import transfers
from kvgen.oracle.scenarios import clone_tree, same_bits
from kvgen.oracle.scenarios.transfers import DST_SALT, make_cache

LIBRARY = builtin_library()
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

    def local(self, ext: dict[str, int], size: int) -> dict[str, int]:
        return {**ext, "H": tp.local_heads(self.num_kv_heads, size)} if LIBRARY[self.src].has("H") else dict(ext)

    def caches(self, dtype: torch.dtype = torch.float32) -> tuple[list[Any], Any]:
        s_ext, d_ext = self.local(self.src_ext, self.src_tp), self.local(self.dst_ext, self.dst_tp)
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
        s_ext, d_ext = self.local(self.src_ext, self.src_tp), self.local(self.dst_ext, self.dst_tp)
        for r in tp.plan(self.num_kv_heads, self.src_tp, self.dst_tp, mla=mla):
            if r.dst_rank == self.dst_rank:
                transfers.transfer(
                    transfers.TransferSide(LIBRARY[self.src], s_ext, srcs[r.src_rank], src_slots,
                                                    None if mla else r.src_heads),
                    transfers.TransferSide(LIBRARY[self.dst], d_ext, want, dst_slots,
                                                    None if mla else r.dst_heads))
        return want


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


__all__ = ["LIBRARY", "Case", "moved_right", "run_by_memmove"]
