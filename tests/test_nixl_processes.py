"""A request's KV moved through NIXL between two processes (`kvgen pd`'s prefill and decode
processes, loopback): every decode rank's cache is checked here against the independent
transfer reference, from the prefill ranks' caches regenerated from the seed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvgen import tp
from kvgen.errors import KVGenError
from kvgen.integrations import nixl
from kvgen.oracle.reference import transfers
from kvgen.oracle.scenarios import same_bits
from kvgen.tools.pd import command as pd
from kvgen.tools.pd import run as pd_run
from kvgen.tools.pd.request import Request, WorkerSide
from tests.remote_harness import LIBRARY

pytestmark = [pytest.mark.skipif(nixl.unavailable() is not None, reason=str(nixl.unavailable())), pytest.mark.slow]


def test_the_pd_command_moves_a_request_between_two_processes_layouts_tp_and_block_sizes(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`kvgen pd` from vLLM's NHD at TP 2, blocks of 4, into HND at TP 4, blocks of 8: what it
    prints, and every decode rank's cache (sent back) against the independent transfer reference.
    One pair of processes serves both checks: starting one costs seconds of torch and NIXL."""
    from kvgen.tools.cli import main

    real_run, runs = pd_run.run, []

    def run_keeping_caches(req: Request) -> list[dict]:
        kept = dataclasses.replace(req, keep=True)
        runs.append((kept, real_run(kept)))
        return runs[-1][1]

    monkeypatch.setattr(pd_run, "run", run_keeping_caches)
    status = main(["pd", "--src", "vllm_flash_attn_nhd:tp=2:N=4", "--dst", "vllm_flash_attn_hnd:tp=4:N=8",
                   "--tokens", "37", "-L", "2", "--heads", "4", "--head-size", "8", "--dtype", "float32",
                   "--repeats", "1"])
    out = capsys.readouterr().out
    assert status == 0, out
    lines = out.splitlines()
    assert lines[0].startswith("vllm_flash_attn_nhd tp=2 N=4 -> vllm_flash_attn_hnd tp=4 N=8, 37 tokens")
    assert sum(1 for line in lines if line.startswith("  decode rank ")) == 4
    total = 37 * 2 * 2 * 4 * 8
    assert f"{total}/{total} elements right" in lines
    assert lines[-1].startswith("throughput ") and "4 MiB-descriptor copy" in lines[-1]

    ((req, rows),) = runs
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    sources = [pd_run.caches(req, req.src, r, True) for r in range(req.src.tp)]
    s_ext, d_ext = pd_run.extents(req, req.src), pd_run.extents(req, req.dst)
    src_slots, dst_slots = pd_run.slots(req, req.src, 1).tolist(), pd_run.slots(req, req.dst, 2).tolist()
    for row in rows:
        want = pd_run.caches(req, req.dst, row["rank"], False)
        for r in tp.plan(req.heads, req.src.tp, req.dst.tp):
            if r.dst_rank == row["rank"]:
                transfers.transfer(
                    transfers.TransferSide(LIBRARY[req.src.layout], s_ext, sources[r.src_rank], src_slots,
                                                    r.src_heads),
                    transfers.TransferSide(LIBRARY[req.dst.layout], d_ext, want, dst_slots, r.dst_heads))
        got = pd_run.loaded(row["caches"])
        assert same_bits(got, want), row["rank"]
        assert row["wrong"] == 0 and row["elements"] == 37 * 2 * 2 * 1 * 8
        assert not torch.equal(got[0], torch.zeros_like(got[0]))


def test_a_side_in_head_groups_names_its_group_size_checked_before_any_process_starts() -> None:
    assert pd.side("hicache_page_unified_grouped:tp=2:N=16:g=2") == \
        WorkerSide("hicache_page_unified_grouped", 2, 16, 2)

    def request(src: str, dst: str) -> Request:
        return Request(pd.side(src), pd.side(dst), tokens=8, layers=1, heads=4, head_size=8, dtype="float32")

    with pytest.raises(KVGenError, match="sglang_mha does not hold its heads in groups"):
        pd_run.check(request("sglang_mha:g=2", "hicache_page_unified_grouped"))
    with pytest.raises(KVGenError, match=r"2 heads a rank \(--heads 4, tp=2\) are not whole groups of g=4"):
        pd_run.check(request("sglang_mha", "hicache_page_unified_grouped:tp=2:g=4"))
    with pytest.raises(KVGenError, match="destination rank 0's head 0 of route 0 -> 0 cut its groups of 2 heads"):
        pd_run.check(request("sglang_mha:tp=4", "hicache_page_unified_grouped:g=2"))
    ok = pd_run.check(request("sglang_mha", "hicache_page_unified_grouped:tp=2:g=2"))
    assert pd_run.extents(ok, ok.dst)["H%"] == 2


def test_the_pd_command_names_a_side_s_head_groups(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The header's g=N (the move itself is the test above's; here its rows are stood in for)."""
    from kvgen.tools.cli import main

    row = {"rank": 0, "strategy": "direct", "why": "stand-in", "count": 1, "plan_ms": 0.1, "bytes": 1 << 20,
           "seconds": 1e-3, "plain": 1e-3, "elements": 10, "wrong": 0}
    monkeypatch.setattr(pd_run, "run", lambda req: [dict(row, rank=r) for r in range(req.dst.tp)])
    assert main(["pd", "--src", "sglang_mha:tp=2:N=4", "--dst", "hicache_page_unified_grouped:tp=2:N=8:g=2",
                 "--tokens", "21", "-L", "2", "--heads", "4", "--head-size", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("sglang_mha tp=2 N=4 -> hicache_page_unified_grouped tp=2 N=8 g=2, 21 tokens")
    assert "20/20 elements right" in lines
