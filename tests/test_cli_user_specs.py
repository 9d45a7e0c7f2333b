"""The command line with a user's own spec folder: verify, validate, explain and list."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from kvgen.tools.cli import main

# Heads outermost, K/V packed inside each head's content: a layout not in the library.
pytestmark = pytest.mark.slow

GOOD = """\
kvgen: 1
name: my_engine_hkv
kind: paged
summary: Example engine cache, heads outermost, per-layer K/V packed in content.
lists: [L]
dims: [H, B, N, [KV, C]]
sizes: {KV: 2}
aliases: [MY_HKV]
engines: [my-engine/ATTN]
"""

# A name that collides with a built-in: build refuses it, so validate must too.
CLASH_NAME = GOOD.replace("my_engine_hkv", "vllm_flash_attn_nhd").replace("MY_HKV", "MY_OTHER")
# An alias that collides with a built-in alias.
CLASH_ALIAS = GOOD.replace("my_engine_hkv", "my_clash").replace("MY_HKV", "NHD")
# Schema problems (unknown field, bad axis, bad name): a file that does not load at all.
BROKEN = "kvgen: 1\nname: Bad-Name\nkind: paged\nsummary: x\ndims: [KV, Q, N]\nfoo: 1\n"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A user spec folder and the package `kvgen build --specs` wrote from it."""
    root = tmp_path_factory.mktemp("user")
    specs = root / "myspecs"
    specs.mkdir()
    (specs / "my_engine_hkv.yaml").write_text(GOOD)
    out = root / "my_connectors"
    assert main(["build", "--specs", str(specs), "--out", str(out)]) == 0
    return specs, out


def _rows(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if re.match(r"\w+ +\w+ +(whole|layerwise) ", ln)]


# -- 1. verify checks the user's connectors -------------------------------------------


def test_verify_runs_the_user_connectors(built: tuple[Path, Path], capsys) -> None:
    specs, out = built
    assert main(["verify", "--out", str(out), "--specs", str(specs), "--only", "my_engine"]) == 0
    text = capsys.readouterr().out
    rows = _rows(text)
    # kv_2ltd whole, kv_2td and kv_t2d layerwise: every connector of the user's layout, each checked.
    assert sorted(r.split()[1] for r in rows) == ["kv_2ltd", "kv_2td", "kv_t2d"], text
    assert all(r.split()[0] == "my_engine_hkv" and r.split()[-2:] == ["yes", "yes"] for r in rows)
    assert "6 checks passed, 0 failed" in text


def test_verify_without_the_specs_refuses_to_skip_them(built: tuple[Path, Path], capsys) -> None:
    _, out = built
    assert main(["verify", "--out", str(out), "--only", "my_"]) != 0
    err = capsys.readouterr().err
    assert "my_engine_hkv" in err and "--specs" in err


def test_verify_selection_matching_nothing_fails(built: tuple[Path, Path], capsys) -> None:
    specs, out = built
    assert main(["verify", "--out", str(out), "--specs", str(specs), "--only", "no_such_"]) != 0
    err = capsys.readouterr().err
    assert "no_such_" in err and "matches no connector" in err


def test_verify_with_specs_the_package_lacks_fails(built: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    """--specs naming a layout the package at --out was not built with: say so, do not pass."""
    from kvgen.spec.library import REPO_ROOT

    specs, _ = built
    assert main(["verify", "--out", str(REPO_ROOT / "generated"), "--specs", str(specs), "--only", "my_"]) != 0
    err = capsys.readouterr().err
    assert "my_engine_hkv" in err and "kvgen build" in err


def test_verify_sees_a_spec_changed_since_the_build(built: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    """The package was built from one spec, verify is given another with the same name."""
    specs, out = built
    changed = tmp_path / "changed"
    changed.mkdir()
    (changed / "my_engine_hkv.yaml").write_text(GOOD.replace("[H, B, N, [KV, C]]", "[B, H, N, [KV, C]]"))
    assert main(["verify", "--out", str(out), "--specs", str(changed), "--only", "my_engine"]) != 0
    assert "my_engine_hkv" in capsys.readouterr().err


TAMPER = """

def _tamper(cls):  # one element off after every store and every load
    store, load = cls.batched_from_gpu, cls.batched_to_gpu

    def bad_store(self, objs, *args, **kwargs):
        store(self, objs, *args, **kwargs)
        t = objs[0].tensor
        t[(0,) * t.dim()] += 1

    def bad_load(self, objs, *args, **kwargs):
        load(self, objs, *args, **kwargs)
        t = kwargs["kvcaches"][0]
        t[(0,) * t.dim()] += 1

    cls.batched_from_gpu, cls.batched_to_gpu = bad_store, bad_load


_tamper(Connector)
"""


def test_verify_finds_a_wrong_connector(built: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    """A connector that gets one element wrong, in a package with a name of its own, fails verify."""
    specs, out = built
    copy = tmp_path / "tampered-pkg"  # not an identifier: verify loads it by path
    shutil.copytree(out, copy)
    module = copy / "my_engine_hkv__kv_2ltd.py"
    module.write_text(module.read_text() + TAMPER)
    assert main(["verify", "--out", str(copy), "--specs", str(specs), "--only", "my_engine_hkv__kv_2ltd"]) == 1
    text = capsys.readouterr().out
    assert "0 checks passed, 2 failed" in text, text


def test_verify_in_worker_processes_prints_the_rows_of_one_process(built: tuple[Path, Path], tmp_path: Path,
                                                                   capsys) -> None:
    """--jobs 2 checks rows in worker processes, which load the package themselves: the same rows
    in the same order as --jobs 1, and a wrong connector still fails."""
    specs, out = built
    copy = tmp_path / "tampered-jobs"
    shutil.copytree(out, copy)
    module = copy / "my_engine_hkv__kv_2ltd.py"
    module.write_text(module.read_text() + TAMPER)
    argv = ["verify", "--out", str(copy), "--specs", str(specs), "--only", "my_engine_hkv", "--device", "cpu"]
    assert main([*argv, "--jobs", "1"]) == 1
    alone = _rows(capsys.readouterr().out)
    assert main([*argv, "--jobs", "2"]) == 1
    pooled = _rows(capsys.readouterr().out)
    assert len(alone) == 3 and pooled == alone, (alone, pooled)
    assert [r.split()[:2] + r.split()[-2:] for r in pooled if "kv_2ltd" in r] == \
        [["my_engine_hkv", "kv_2ltd", "NO", "NO"]]


def test_verify_counts_a_raising_connector_as_failed(built: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    specs, out = built
    copy = tmp_path / "raising"
    shutil.copytree(out, copy)
    module = copy / "my_engine_hkv__kv_2ltd.py"
    module.write_text(module.read_text() + "\n\ndef _boom(self, *a, **k):\n    raise RuntimeError('boom')\n\n\n"
                      "Connector.batched_from_gpu = _boom\n")
    assert main(["verify", "--out", str(copy), "--specs", str(specs), "--only", "my_engine_hkv__kv_2ltd"]) == 1
    captured = capsys.readouterr()
    assert "0 checks passed, 2 failed" in captured.out, captured.out
    assert "boom" in captured.err


def test_verify_missing_or_non_package_out_is_a_message(tmp_path: Path, capsys) -> None:
    assert main(["verify", "--out", str(tmp_path / "nonexist")]) == 1
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "plain").mkdir()
    assert main(["verify", "--out", str(tmp_path / "plain")]) == 1
    assert "not a Python package" in capsys.readouterr().err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "__init__.py").write_text("X = 1\n")
    assert main(["verify", "--out", str(tmp_path / "other")]) == 1
    assert "not a package written by kvgen build" in capsys.readouterr().err


# -- 3. validate = build's checks, on files and folders --------------------------------


def test_validate_accepts_a_folder(built: tuple[Path, Path], capsys) -> None:
    specs, _ = built
    assert main(["validate", str(specs)]) == 0
    assert "ok  " in capsys.readouterr().out


def test_validate_refuses_what_build_refuses(tmp_path: Path, capsys) -> None:
    for name, text in (("clash_name.yaml", CLASH_NAME), ("clash_alias.yaml", CLASH_ALIAS)):
        folder = tmp_path / name.removesuffix(".yaml")
        folder.mkdir()
        (folder / name).write_text(text)
        assert main(["build", "--specs", str(folder), "--out", str(tmp_path / "never")]) == 1
        build_err = capsys.readouterr().err
        assert main(["validate", str(folder / name)]) == 1
        err = capsys.readouterr().err
        assert "already used by" in err and name in err
        assert [ln for ln in err.splitlines() if "already used" in ln] == \
            [ln for ln in build_err.splitlines() if "already used" in ln]
    assert not (tmp_path / "never").exists()


def test_validate_reports_every_problem_of_every_file_at_once(tmp_path: Path, capsys) -> None:
    (tmp_path / "a_broken.yaml").write_text(BROKEN)
    (tmp_path / "b_clash.yaml").write_text(CLASH_ALIAS)
    (tmp_path / "c_good.yaml").write_text(GOOD)
    assert main(["validate", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    err = captured.err
    assert "a_broken.yaml" in err and "b_clash.yaml" in err
    assert len([ln for ln in err.splitlines() if "a_broken.yaml:" in ln]) >= 3
    assert "alias 'NHD' is already used by" in err
    assert not any("c_good.yaml" in line for line in err.splitlines() if not line.startswith("warning:"))
    assert "my_engine_hkv" in captured.out


def test_validate_the_builtin_folder_itself(capsys) -> None:
    from kvgen.spec.library import BUILTIN_SPECS, load_library

    assert main(["validate", str(BUILTIN_SPECS)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("ok  ")]
    library = load_library()
    assert len(lines) == len(library.specs) + len(library.models) >= 39


def test_validate_an_empty_folder_fails(tmp_path: Path, capsys) -> None:
    assert main(["validate", str(tmp_path)]) == 1
    assert "no spec files" in capsys.readouterr().err


def test_explain_a_good_spec_beside_a_bad_one(tmp_path: Path, capsys) -> None:
    (tmp_path / "bad.yaml").write_text(BROKEN)
    (tmp_path / "clash.yaml").write_text(CLASH_ALIAS)
    (tmp_path / "good.yaml").write_text(GOOD)
    assert main(["explain", "--specs", str(tmp_path), "my_hkv"]) == 0
    captured = capsys.readouterr()
    assert "my_engine_hkv (paged)" in captured.out
    assert "H -> " not in captured.out and "L -> [H B N (KV C)]" in captured.out
    assert "warning" in captured.err and "bad.yaml" in captured.err and "clash.yaml" in captured.err
    # The bad one itself: not found, and the message points at the files that were left out.
    assert main(["explain", "--specs", str(tmp_path), "my_clash"]) == 1
    err = capsys.readouterr().err
    assert "no layout or object named 'my_clash'" in err and "clash.yaml" in err


def test_list_with_a_bad_spec_lists_the_good_ones(tmp_path: Path, capsys) -> None:
    (tmp_path / "bad.yaml").write_text(BROKEN)
    (tmp_path / "good.yaml").write_text(GOOD)
    # Listed, with a warning; the status says the list is not all that was asked for.
    assert main(["list", "--json", "--specs", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "my_engine_hkv" in json.loads(captured.out)["layouts"]
    assert "bad.yaml" in captured.err


def test_build_still_refuses_a_folder_with_a_bad_spec(tmp_path: Path, capsys) -> None:
    (tmp_path / "bad.yaml").write_text(BROKEN)
    (tmp_path / "good.yaml").write_text(GOOD)
    assert main(["build", "--specs", str(tmp_path), "--out", str(tmp_path / "out")]) == 1
    assert "bad.yaml" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
