"""`kvgen explain MODEL` shows every group (layout, layers, geometry, parts, fields, planes) and
every state group with its tensors; `kvgen list` and `list --json` show the models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgen.tools.cli import main
from kvgen.tools.models_view import layer_text

HYBRID = """\
kvgen: 2
name: toy_hybrid
kind: model
summary: A made-up hybrid model, two attention groups and one state group.
layers: 8
groups:
  wide:
    layout: vllm_flash_attn_nhd
    layers: [0, 4]
    sizes: {H: 4, C: 32}
  mla:
    layout: vllm_mla_fp8
    layers: [2, 6]
state:
  linear:
    layers: others
    tensors:
      - {name: conv, shape: [3, 96], dtypes: [bfloat16], split: 1}
      - {name: ssm, shape: [4, 8, 8], dtypes: [float32], split: 0}
"""


@pytest.fixture
def hybrid(tmp_path: Path) -> Path:
    (tmp_path / "toy_hybrid.yaml").write_text(HYBRID)
    return tmp_path


def test_explain_model_shows_groups_with_their_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "gpt_oss_120b"]) == 0
    out = capsys.readouterr().out
    for line in ("group sliding: vllm_flash_attn_nhd, 18 layers, sliding window 128 tokens",
                 "layers:   0, 2, ..., 34 (every 2nd from 0)", "layers:   1, 3, ..., 35 (every 2nd from 1)",
                 "layout:   L=18 -> [KV=2 B N H=8 C=64]", "config:   openai/gpt-oss-120b",
                 "cache list: 36 entries in the engine's order (18 in sliding, 18 in full)",
                 "gpt_oss_120b__kv_groups: KVGEN_GROUPS: sliding as kv_2ltd, full as kv_2ltd"):
        assert line in out, out


def test_explain_model_shows_fields_planes_and_state(hybrid: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "toy_hybrid", "--specs", str(hybrid)]) == 0
    out = capsys.readouterr().out
    for line in ("group mla: vllm_mla_fp8, 2 layers", "layers:   2, 6",
                 "scale      float32 x 4 (16 bytes), byte 512",  # a field of the group's layout
                 "state linear: 4 layers, each a tuple of 2 tensors indexed by request slot S",
                 "layers:   1, 3, 5, 7", "conv       [S 3 96] bfloat16, TP splits dim 2 (96); 576 bytes per request",
                 "ssm        [S 4 8 8] float32, TP splits dim 1 (4); 1024 bytes per request",
                 "per request: 1600 bytes per layer, 6400 bytes in all (at TP 1)",
                 "toy_hybrid__kv_groups: KVGEN_GROUPS: wide as kv_2ltd, mla as kv_planes; state linear",
                 "toy_hybrid__kv_groups_attention: KVGEN_GROUPS_ATTENTION: wide as kv_2ltd, mla as kv_planes"):
        assert line in out, out


def test_list_shows_models(hybrid: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "--specs", str(hybrid)]) == 0
    out = capsys.readouterr().out
    [row] = [line.split() for line in out.splitlines() if line.startswith("toy_hybrid ")]
    assert " ".join(row) == "toy_hybrid wide vllm_flash_attn_nhd x2, mla vllm_mla_fp8 x2 linear (conv+ssm) x4"
    assert main(["list", "--json", "--specs", str(hybrid)]) == 0
    models = json.loads(capsys.readouterr().out)["models"]
    assert models["toy_hybrid"]["state"][0]["layers"] == [1, 3, 5, 7]
    assert models["toy_hybrid"]["groups"][1] == {"name": "mla", "layout": "vllm_mla_fp8", "layers": [2, 6],
                                                 "sizes": {}, "dtypes": [], "window": None, "tokens_per_slot": 1}


@pytest.mark.parametrize(("layers", "text"), [
    ((0, 1, 2, 3, 4), "0-4"), ((0, 1, 2, 3), "0-3"), ((5, 11, 17, 23, 29), "5, 11, ..., 29 (every 6th from 5)"),
    ((0, 1, 2, 4, 6, 7), "0-2, 4, 6, 7"), ((3,), "3"), ((1, 3), "1, 3"),
])
def test_layer_text(layers: tuple[int, ...], text: str) -> None:
    assert layer_text(layers) == text
