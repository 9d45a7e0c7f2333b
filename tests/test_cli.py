"""The command line as a user meets it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvgen.tools.cli import main


def test_list_json_shows_the_whole_library(capsys) -> None:
    assert main(["list", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    names = set(data["layouts"])
    for name in ("vllm_flash_attn_nhd", "vllm_flashinfer_hnd", "vllm_kv_tuple", "vllm_mla", "vllm_cross_layer",
                 "vllm_packed_nhd", "vllm_blocks_first_hnd", "vllm_rbln", "sglang_mha", "sglang_mla",
                 "trtllm_pool", "vllm_heads_first", "vllm_blocks_heads_first",
                 "kv_2ltd", "kv_t2d", "kv_2td", "kv_mla", "kv_mla_layer"):
        assert name in names
    assert data["layouts"]["kv_2ltd"]["format"] == "KV_2LTD"
    assert {"paged": "sglang_mha", "object": "kv_t2d"}.items() <= next(
        c for c in data["connectors"] if c["module"] == "sglang_mha__kv_t2d").items()


def test_explain(capsys) -> None:
    assert main(["explain", "SGLANG_MHA"]) == 0
    out = capsys.readouterr().out
    assert "KV -> L -> [(B N) H C]" in out
    assert "kvcaches[kv][l][slot, h, c]" in out
    assert "sglang_mha__kv_t2d (layerwise)" in out


def test_explain_unknown_lists_names(capsys) -> None:
    assert main(["explain", "nope"]) == 1
    assert "`kvgen list` shows all" in capsys.readouterr().err


def test_validate_reports_every_problem_without_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("kvgen: 1\nname: Bad-Name\nkind: paged\nsummary: x\ndims: [KV, Q, N]\nfoo: 1\n")
    proc = subprocess.run([sys.executable, "-m", "kvgen", "validate", str(bad)], capture_output=True, text=True)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith(str(bad.name)) or "bad.yaml:" in ln]
    assert len(lines) >= 3, proc.stderr


def test_validate_ok(capsys) -> None:
    spec = Path(__file__).parent.parent / "specs" / "vllm" / "flash_attn_nhd.yaml"
    assert main(["validate", str(spec)]) == 0
    assert "vllm_flash_attn_nhd" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["check"], ["list"]])
def test_commands_succeed_on_the_repository(argv: list[str]) -> None:
    assert main(argv) == 0


@pytest.mark.parametrize("argv,code", [(["verify", "--device", "cuda"], 1), (["bench", "--device", "cuda"], 2)])
def test_absent_device_is_refused_plainly(argv: list[str], code: int, capsys) -> None:
    from kvgen.runtime import available_devices

    if "cuda" in available_devices():
        pytest.skip("CUDA is present here")
    assert main(argv) == code
    assert "device cuda is not available here (present: cpu" in capsys.readouterr().err


def test_list_has_headers_and_names_the_connectors(capsys) -> None:
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "KIND", "ALIASES", "LAYOUT", "LMCACHE/FORMAT", "CONNECTORS"]
    row = next(ln for ln in lines if ln.startswith("vllm_flash_attn_nhd "))
    assert "NHD" in row and "NL_X_TWO_NB_BS_NH_HS" in row
    assert row.endswith("kv_2ltd, kv_2td (layerwise), kv_t2d (layerwise)"), row
    row = next(ln for ln in lines if ln.startswith("vllm_mla "))
    assert row.endswith("kv_mla, kv_mla_layer (layerwise)"), row
    row = next(ln for ln in lines if ln.startswith("kv_mla_layer "))
    assert "KV_MLA_FMT (6)" in row and row.endswith("8 layouts"), row  # vLLM <0.33, 0.33, SGLang; 5 host stores


def test_every_option_has_help() -> None:
    """Every option and argument of every command (bench's own options aside) says what it does."""
    from kvgen.tools.cli import parser

    ap = parser()
    sub = next(a for a in ap._actions if a.dest == "command")
    missing = []
    for name, p in sub.choices.items():
        if name == "bench":
            continue
        for action in p._actions:
            if not action.help:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, missing
    assert all(c.help for c in sub._choices_actions)


def test_verify_checks_the_built_in_specs_facts_only_when_it_verifies_everything(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """--only is a quick look at some connectors, and --backend a look at one way of moving
    data: the fact and engine checks of the built-in specs (tens of seconds, vLLM's import
    among them), which depend on neither, are a whole verify's."""
    from kvgen.tools.verify import connectors as verify_connectors
    from kvgen.tools.verify import engines as verify_engines
    from kvgen.tools.verify import models as verify_models
    from kvgen.tools.verify import run as verify
    from kvgen.tools.verify import transfers as verify_transfers

    calls: list[str] = []
    monkeypatch.setattr(verify, "_check_facts", lambda library: calls.append("facts") or 0)
    monkeypatch.setattr(verify_engines, "run", lambda: calls.append("engines") or 0)
    monkeypatch.setattr(verify_connectors, "run", lambda rows, chosen, *rest: calls.append(f"{len(chosen)} rows") or 0)
    monkeypatch.setattr(verify_transfers, "run", lambda *args: (0, 0))
    monkeypatch.setattr(verify_models, "run", lambda *args: (0, 0))
    assert main(["verify", "--only", "vllm_flash_attn_nhd__kv_2ltd", "--device", "cpu", "--jobs", "1"]) == 0
    assert calls == ["1 rows"]
    assert "--only: the built-in specs' fact and engine checks are left to a whole `kvgen verify`" \
        in capsys.readouterr().out
    calls.clear()
    assert main(["verify", "--backend", "torch", "--device", "cpu", "--jobs", "1"]) == 0
    assert calls[0].endswith(" rows") and calls[0] != "1 rows" and len(calls) == 1
    assert "--backend: the built-in specs' fact and engine checks are left to a whole `kvgen verify`" \
        in capsys.readouterr().out
    calls.clear()
    assert main(["verify", "--device", "cpu", "--jobs", "1"]) == 0
    assert calls[:2] == ["facts", "engines"] and calls[2].endswith(" rows") and calls[2] != "1 rows"


def test_verify_in_tritons_interpreter_runs_every_scenario_on_two_layers() -> None:
    """The interpreter's cost is per program instance, one per layer among others: that pass
    takes 2 layers instead of 3, every scenario otherwise the same."""
    from dataclasses import replace

    from kvgen.oracle.scenarios import EXT, SCENARIOS
    from kvgen.tools.verify.connectors import scenarios

    interpreted = scenarios("triton", "cpu")
    assert [s.name for s in interpreted] == list(SCENARIOS)
    assert all(s == replace(SCENARIOS[s.name], ext={**EXT, "L": 2}) for s in interpreted)
    everything = list(SCENARIOS.values())
    assert scenarios(None, "cpu") == scenarios("torch", "cpu") == scenarios("triton", "cuda") == everything
