"""`kvgen explain` with transfers: the pairs a layout takes part in, and `--tp SRC:DST` prints
kvgen.tp's resharding plan for the layout (MLA layouts: one source per destination)."""

from __future__ import annotations

import pytest

from kvgen.tools.cli import main
from kvgen.tp import plan


def test_explain_lists_the_transfers_of_a_layout(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "hicache_page_first"]) == 0
    out = capsys.readouterr().out
    assert "  transfers:" in out
    assert "vllm_flash_attn_nhd -> hicache_page_first (xfer__vllm_flash_attn_nhd__hicache_page_first, " \
           "declared at specs/transfers.yaml:" in out


def test_explain_tp_prints_every_route(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--tp", "2:8", "HND"]) == 0
    out = capsys.readouterr().out.split("\nTP ", 1)[1].splitlines()
    assert out[0] == "2 -> 8, 8 KV heads: a source rank holds 4, a destination rank 1"
    routes = [line for line in out if line.startswith("  src rank")]
    assert len(routes) == len(plan(8, 2, 8)) == 8
    assert routes[5] == "  src rank 1 -> dst rank 5: src_heads=(1, 2), dst_heads=(0, 1)   global head 5"


def test_explain_tp_with_replicated_heads_and_mla(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--tp", "8:2", "--kv-heads", "2", "NHD"]) == 0
    out = capsys.readouterr().out
    assert "(heads replicated over ranks: each is read from one)" in out
    assert "  src rank 4 -> dst rank 1: src_heads=(0, 1), dst_heads=(0, 1)   global head 1" in out
    assert main(["explain", "--tp", "2:4", "MLA"]) == 0
    out = capsys.readouterr().out
    assert "MLA: every rank holds the whole latent" in out
    assert "  src rank 1 -> dst rank 3: src_heads=(0, 1), dst_heads=(0, 1)" in out


@pytest.mark.parametrize("argv,word", [
    (["explain", "--tp", "3:8", "NHD"], "source tp 3 does not divide num_kv_heads 8"),
    (["explain", "--tp", "2:4", "kv_2ltd"], "kv_2ltd is a memory object"),
])
def test_explain_tp_refusals(argv: list[str], word: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 1
    assert word in capsys.readouterr().err
