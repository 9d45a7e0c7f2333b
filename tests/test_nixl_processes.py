"""A request's KV moved through NIXL between two processes (`kvgen pd`'s prefill and decode
processes, loopback): every decode rank's cache is checked here against the independent
transfer reference, from the prefill ranks' caches regenerated from the seed."""

from __future__ import annotations

import pytest
import torch

from kvgen import tp
from kvgen.integrations import nixl
from kvgen.oracle.reference import transfers
from kvgen.oracle.scenarios import same_bits
from kvgen.tools.pd import command as pd
from kvgen.tools.pd import run as pd_run
from kvgen.tools.pd.request import Request
from tests.remote_harness import LIBRARY

pytestmark = pytest.mark.skipif(nixl.unavailable() is not None, reason=str(nixl.unavailable()))


def test_two_processes_move_a_request_between_layouts_tp_and_block_sizes() -> None:
    req = Request(pd.side("vllm_flash_attn_nhd:tp=2:N=4"), pd.side("vllm_flash_attn_hnd:tp=4:N=8"), tokens=37,
                     layers=2, heads=4, head_size=8, dtype="float32", repeats=1, keep=True)
    rows = pd_run.run(req)
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


def test_the_pd_command_prints_elements_right_strategy_and_throughput(capsys: pytest.CaptureFixture[str]) -> None:
    from kvgen.tools.cli import main

    status = main(["pd", "--src", "NHD:tp=2:N=4", "--dst", "HND:tp=4:N=8", "--tokens", "21", "-L", "2", "--heads",
                   "4", "--head-size", "8", "--dtype", "float32", "--repeats", "1"])
    out = capsys.readouterr().out
    assert status == 0, out
    lines = out.splitlines()
    assert lines[0].startswith("vllm_flash_attn_nhd tp=2 N=4 -> vllm_flash_attn_hnd tp=4 N=8, 21 tokens")
    assert sum(1 for line in lines if line.startswith("  decode rank ")) == 4
    total = 21 * 2 * 2 * 4 * 8
    assert f"{total}/{total} elements right" in lines
    assert lines[-1].startswith("throughput ") and "4 MiB-descriptor copy" in lines[-1]
