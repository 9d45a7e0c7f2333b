"""What the command line says when a user gets something wrong: a message for their case,
before any output (issue 20, item 19)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvgen.tools.cli import main

ROOT = Path(__file__).resolve().parent.parent
USER_SPEC = """kvgen: 1
name: my_engine_hkv
kind: paged
summary: Example engine cache, heads outermost, per-layer K/V packed in content.
lists: [L]
dims: [H, B, N, [KV, C]]
sizes: {KV: 2}
"""


def test_check_of_a_user_package_tells_how_to_rebuild_it(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "myspecs").mkdir()
    (tmp_path / "myspecs" / "my_engine.yaml").write_text(USER_SPEC)
    assert main(["build", "--specs", "myspecs", "--out", "pkg"]) == 0
    (tmp_path / "myspecs" / "my_engine.yaml").write_text(USER_SPEC.replace("Example engine", "An engine"))
    capsys.readouterr()
    assert main(["check", "--specs", "myspecs", "--out", "pkg"]) == 1
    err = capsys.readouterr().err
    assert "kvgen repository" not in err and "commit generated/" not in err
    assert "pkg differs from what `kvgen build` writes; rebuild it with `kvgen build --out pkg --specs myspecs`" in err


def test_check_of_the_checkout_s_generated_says_to_commit_it(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from kvgen.tools import paths

    out = tmp_path / "generated"
    shutil.copytree(ROOT / "generated", out)
    (out / "formats.py").write_text((out / "formats.py").read_text() + "\n# edited\n")
    monkeypatch.setattr(paths, "source_checkout", lambda package_dir=None: tmp_path)
    assert main(["check", "--out", str(out)]) == 1
    assert "run `kvgen build` and commit generated/ with the change" in capsys.readouterr().err


def test_a_missing_kvgen_cc_is_named(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from kvgen.tools.backends import backend_line

    monkeypatch.setenv("KVGEN_CC", "no-such-cc-7")
    line = backend_line()
    assert "cpu torch (KVGEN_CC=no-such-cc-7: no such compiler on PATH)" in line


def test_detect_refuses_an_unknown_dtype_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["detect", "--dtype", "bf16", "32x[2,1000,16,8,128]"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvgen: unknown dtype 'bf16' (did you mean 'bfloat16'?); dtypes: float32, float16, bfloat16, "
                   "float8_e4m3fn, float8_e5m2, int8, uint8"]


def test_explain_with_an_impossible_tp_prints_nothing_first(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--tp", "3:8", "vllm_flash_attn_nhd"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert "source tp 3 does not divide num_kv_heads 8" in err


def test_an_unknown_name_lists_the_closest_first(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "vllm_flash_atn_nhd"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvgen: no layout or object named 'vllm_flash_atn_nhd' (names and aliases match in any "
                          "case, as do LMCache format names); closest: vllm_flash_attn_nhd (NHD")
    closest = err.split("closest: ", 1)[1].split("; ")[0]
    assert closest.count(",") < 12  # a few names, not the whole library
    assert "`kvgen list` shows all" in err


def test_the_runtime_names_a_missing_kvgen_cc(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvgen.runtime import native

    monkeypatch.setenv("KVGEN_CC", "no-such-cc-7")
    native.reset()
    try:
        assert native.unavailable() == "KVGEN_CC=no-such-cc-7: no such compiler on PATH"
    finally:
        monkeypatch.delenv("KVGEN_CC")
        native.reset()
