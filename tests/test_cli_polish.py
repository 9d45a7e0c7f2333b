"""Small things a new user notices (issue 20, item 22): a spec that only renames a built-in
layout, where explain says a spec file is, verify tables with long names, plurals."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgen.tools.cli import main

ROOT = Path(__file__).resolve().parent.parent


def _copy_of_nhd(name: str) -> str:
    text = (ROOT / "specs" / "vllm" / "flash_attn_nhd.yaml").read_text()
    naming = ("aliases:", "lmcache:", "engines:", "versions:")
    keep = [line for line in text.splitlines() if not line.startswith(naming)]
    return "\n".join(keep).replace("name: vllm_flash_attn_nhd", f"name: {name}") + "\n"


def test_a_spec_identical_to_a_built_in_warns(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    specs = Path("myspecs")
    specs.mkdir()
    (specs / "twin.yaml").write_text(_copy_of_nhd("my_nhd_twin"))
    (specs / "other.yaml").write_text(_copy_of_nhd("my_other").replace("dims: [KV, B, N, H, C]",
                                                                      "dims: [N, KV, B, H, C]"))
    assert main(["validate", str(specs)]) == 0
    err = capsys.readouterr().err
    assert ("warning: myspecs/twin.yaml: my_nhd_twin describes the same layout as the built-in vllm_flash_attn_nhd "
            "(NHD); use that name (or alias) instead") in err
    assert "my_other" not in err  # a layout of its own: no warning
    assert main(["build", "--specs", str(specs), "--out", "pkg"]) == 0
    assert "my_nhd_twin describes the same layout as the built-in vllm_flash_attn_nhd" in capsys.readouterr().err


def test_explain_prints_the_spec_file_s_real_place(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # as a user of an installed kvgen runs it, from a folder of their own
    assert main(["explain", "vllm_mla"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  source:"))
    path = Path(line.split(":", 1)[1].strip())
    assert path.is_absolute() and path.is_file() and path.name == "mla.yaml"


def test_one_layer_is_a_layer(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--specs", str(ROOT / "tests" / "specs_models"), "toy_hybrid"]) == 0
    out = capsys.readouterr().out
    assert "group global: vllm_flash_attn_hnd, 1 layer\n" in out and "1 layers" not in out
    assert "group local: vllm_flash_attn_nhd, 3 layers," in out


def test_verify_tables_stay_aligned_for_long_names(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "myspecs").mkdir()
    long = "my_engine_with_a_rather_long_layout_name_hnd"
    (tmp_path / "myspecs" / "long.yaml").write_text(_copy_of_nhd(long).replace("dims: [KV, B, N, H, C]",
                                                                              "dims: [B, H, KV, N, C]"))
    assert main(["verify", "--specs", "myspecs", "--only", long, "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(ln for ln in lines if ln.startswith("layout "))
    rows = [ln for ln in lines if ln.startswith(long)]
    assert rows
    for column in ("object", "mode", "device", "store ok", "load ok"):
        at = header.index(column)
        assert all(row[at - 1] == " " and row[at] != " " for row in rows), (column, header, rows)
