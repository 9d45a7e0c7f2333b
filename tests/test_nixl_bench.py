"""`kvgen bench --remote` and `--costs`: rows through NIXL between two agents, every element
checked; skipped, saying why, where nixl is not installed."""

from __future__ import annotations

import argparse

import pytest

from kvgen.integrations import nixl
from kvgen.tools.bench import remote as bench_remote
from kvgen.tools.cli import main

pytestmark = pytest.mark.skipif(nixl.unavailable() is not None, reason=str(nixl.unavailable()))


def test_remote_rows_name_the_strategy_and_count_every_element(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["bench", "--remote", "vllm_flash_attn_nhd:vllm_flash_attn_hnd", "--remote-shapes", "2:4:4:8",
                   "--tokens", "20", "-L", "2", "--heads", "4", "--head-size", "8", "--repeats", "1", "--costs"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert out.startswith("KVGEN_REMOTE_COSTS={")
    header, line = out.splitlines()[1:3]
    assert header.split()[:3] == ["source", "destination", "tp"]
    cells = line.split()
    # 20 tokens x 2 layers x K and V x 4 heads x 8 values, over the 4 destination ranks.
    assert cells[:4] == ["vllm_flash_attn_nhd", "vllm_flash_attn_hnd", "2->4", "4->8"]
    assert cells[-1] == f"{20 * 2 * 2 * 4 * 8}/{20 * 2 * 2 * 4 * 8}"


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="SRC_TP:DST_TP:SRC_N:DST_N"):
        bench_remote.shapes("2:4")
