"""Every command takes a user's --specs the same way, and none asks to write a user's
connectors into the kvgen checkout (issue 20, item 21)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgen.tools.cli import main

SPEC = """kvgen: 1
name: my_engine_hkv
kind: paged
summary: Example engine cache, heads outermost, per-layer K/V packed in content.
lists: [L]
dims: [H, B, N, [KV, C]]
sizes: {KV: 2}
"""
SPEC_MLA = """kvgen: 1
name: my_latent_cache
kind: paged
summary: Example MLA cache, blocks outermost with the layers inside, one latent per slot.
dims: [B, L, N, C]
"""


@pytest.fixture()
def myspecs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "myspecs"
    folder.mkdir()
    (folder / "my_engine.yaml").write_text(SPEC)
    (folder / "my_latent.yaml").write_text(SPEC_MLA)
    return folder


def test_verify_with_specs_needs_no_prior_build(myspecs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--specs", "myspecs", "--only", "my_engine_hkv", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("my_engine_hkv ")]
    assert {r[1] for r in rows} == {"kv_2ltd", "kv_2td", "kv_t2d"} and all(r[4:6] == ["yes", "yes"] for r in rows)
    assert not (myspecs.parent / "generated").exists()  # built in a temporary folder, not here


def test_verify_never_suggests_writing_into_the_checkout(myspecs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvgen.tools.paths import default_out

    assert main(["verify", "--specs", "myspecs", "--out", str(default_out())]) == 1
    err = capsys.readouterr().err
    assert "lacks" in err and f"--out {default_out()}" not in err.split("lacks", 1)[1]
    assert "`kvgen build --out my_connectors --specs myspecs`" in err


def test_detect_takes_specs(myspecs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["detect", "--specs", "myspecs", "[64,4,16,8]"]) == 0
    assert capsys.readouterr().out.startswith("my_latent_cache ")
    assert main(["detect", "[64,4,16,8]"]) == 1
    assert "no layout fits the cache [64, 4, 16, 8]" in capsys.readouterr().err
