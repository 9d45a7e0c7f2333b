"""`kvgen validate` reports everything wrong with a spec in one pass, and says what a path
that is no spec file is (issue 20, item 20)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvgen.tools.cli import main

ROOT = Path(__file__).resolve().parent.parent
BAD = "kvgen: 1\nname: my_bad\nkind: paged\nsummary: x.\nlists: [L]\ndims: [KV, B, N, H, H, C]\nsizes: {KV: 3}\n"


def test_an_unknown_field_does_not_hide_the_semantic_problems(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text(BAD + "foo: 1\n")
    assert main(["validate", str(spec)]) == 1
    err = capsys.readouterr().err
    assert "foo: unknown field 'foo'" in err
    assert "dims[4]: axis H appears twice (first at dims[3])" in err
    assert "sizes.KV: KV holds K and V, so its size is 2, not 3" in err
    assert "3 problems" in err


def test_a_wrong_type_still_stops_at_the_schema(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text(BAD.replace("dims: [KV, B, N, H, H, C]", "dims: 5"))
    assert main(["validate", str(spec)]) == 1
    err = capsys.readouterr().err
    assert "dims: expected a list" in err and "1 problem" in err


@pytest.mark.parametrize(("old", "new", "message"), [
    ("    layers: [0, 2, 4]", "    layers: {every: 0}", "groups.local.layers.every: 0 is out of range (at least 1)"),
    ("    layers: [5]", "    layers: [-1]", "groups.global.layers[0]: -1 is out of range (at least 0)"),
])
def test_model_layer_sets_get_a_specific_message(tmp_path: Path, capsys: pytest.CaptureFixture[str], old: str,
                                                 new: str, message: str) -> None:
    text = (ROOT / "tests" / "specs_models" / "toy_hybrid.yaml").read_text()
    assert old in text
    spec = tmp_path / "model.yaml"
    spec.write_text(text.replace(old, new))
    assert main(["validate", str(spec)]) == 1
    err = capsys.readouterr().err
    assert message in err, err
    assert "not valid under any of the given schemas" not in err


def _special(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / f"{kind}.yaml"
    if kind == "loop":
        path.symlink_to(path.name)
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/null")
    return path


WHAT = {"loop": "a symlink loop", "fifo": "a FIFO", "device": "a character device"}


@pytest.mark.parametrize("kind", ["loop", "fifo", "device"])
def test_a_path_that_is_no_regular_file_is_said_so(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   kind: str) -> None:
    path = _special(tmp_path, kind)
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"{kind}.yaml:1:1: <root>: {WHAT[kind]}, not a spec file (a spec is a regular YAML file)" in err, err
    folder = tmp_path / "specs"
    folder.mkdir()
    (folder / "good.yaml").write_text((ROOT / "specs" / "vllm" / "flash_attn_nhd.yaml").read_text()
                                      .replace("vllm_flash_attn_nhd", "my_nhd_copy").replace("aliases: [NHD]", ""))
    os.replace(path, folder / path.name) if kind != "fifo" else os.mkfifo(folder / path.name)
    if kind == "loop":
        (folder / path.name).unlink()
        (folder / path.name).symlink_to(path.name)
    assert main(["validate", str(folder)]) == 1
    err = capsys.readouterr().err
    assert f"{WHAT[kind]}, not a spec file" in err, err
    assert stat.S_ISDIR(folder.stat().st_mode)
