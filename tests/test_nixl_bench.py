"""`kvgen bench --remote` and `--costs`: rows through NIXL between two agents, every element
checked; skipped, saying why, where nixl is not installed."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from kvgen.integrations import nixl
from kvgen.tools.bench import remote as bench_remote
from kvgen.tools.cli import main

pytestmark = pytest.mark.skipif(nixl.unavailable() is not None, reason=str(nixl.unavailable()))


def test_remote_rows_name_the_strategy_and_count_every_element(capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """With `--costs` first: the cost model's constants as one JSON line (measured here on a 4 MiB
    read and a 64-token transfer, not the command's 64 MiB and 2048 tokens)."""
    monkeypatch.setattr(bench_remote, "COST_READ_BYTES", 4 << 20)
    monkeypatch.setattr(bench_remote, "COST_TOKENS", 64)
    status = main(["bench", "--remote", "vllm_flash_attn_nhd:vllm_flash_attn_hnd", "--remote-shapes", "2:4:4:8",
                   "--tokens", "20", "-L", "2", "--heads", "4", "--head-size", "8", "--repeats", "1", "--costs"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert out.startswith("KVGEN_REMOTE_COSTS={")
    measured = json.loads(out.splitlines()[0].split("=", 1)[1])
    assert set(measured) == {"per_descriptor", "wire", "local", "per_permute"}
    assert all(math.isfinite(v) and v >= 0 for v in measured.values()) and measured["wire"] > 0, measured
    header, line = out.splitlines()[1:3]
    assert header.split()[:3] == ["source", "destination", "tp"]
    cells = line.split()
    # 20 tokens x 2 layers x K and V x 4 heads x 8 values, over the 4 destination ranks.
    assert cells[:4] == ["vllm_flash_attn_nhd", "vllm_flash_attn_hnd", "2->4", "4->8"]
    assert cells[-1] == f"{20 * 2 * 2 * 4 * 8}/{20 * 2 * 2 * 4 * 8}"


def test_a_cache_in_head_groups_is_benched_in_groups(capsys: pytest.CaptureFixture[str]) -> None:
    """SGLang's page_unified pool in head groups: groups of 2 heads by default where every rank of
    both sides has whole groups of 2, as many as a row's fifth field says otherwise."""
    status = main(["bench", "--remote", "sglang_mha:hicache_page_unified_grouped",
                   "--remote-shapes", "1:1:4:4,1:2:4:4:1", "--tokens", "8", "-L", "2", "--heads", "4",
                   "--head-size", "8", "--repeats", "1"])
    out = capsys.readouterr().out
    assert status == 0, out
    rows = [line for line in out.splitlines() if line.startswith("sglang_mha ")]
    assert [line.split()[1:3] for line in rows] == [["hicache_page_unified_grouped", "g=2"],
                                                    ["hicache_page_unified_grouped", "g=1"]]
    assert all(line.split()[-1] == f"{8 * 2 * 2 * 4 * 8}/{8 * 2 * 2 * 4 * 8}" for line in rows)


def test_the_default_group_size_splits_no_rank_and_no_route() -> None:
    assert bench_remote.group_size(8, (1, 1)) == 2
    assert bench_remote.group_size(8, (2, 4)) == 2
    assert bench_remote.group_size(8, (1, 8)) == 1  # one head a destination rank
    assert bench_remote.group_size(6, (1, 1)) == 2
    assert bench_remote.group_size(6, (1, 2)) == 1  # three heads a rank


def test_bad_shapes_are_refused() -> None:
    for text in ("2:4", "2:4:16:16:2:2", "2:4:16:16:0"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"SRC_TP:DST_TP:SRC_N:DST_N\[:G\]"):
            bench_remote.shapes(text)
    assert bench_remote.shapes("1:1:16:16,2:4:16:32:4") == [(1, 1, 16, 16, None), (2, 4, 16, 32, 4)]
