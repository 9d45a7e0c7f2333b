"""The transfers file: a user adds a pair with one line in a --specs folder (built, imported,
checked against the reference); every problem of a transfers file is reported at once, located
FILE:LINE:COL; layouts that cannot exchange KV, or that are not single-part, are refused."""

from __future__ import annotations

import dataclasses
import importlib
import sys
from pathlib import Path

import pytest
import torch
from harness import builtin_library

from kvgen.errors import SpecError
from kvgen.oracle.reference import transfers
from kvgen.oracle.scenarios import clone_tree, same_bits
from kvgen.oracle.scenarios.transfers import DST_EXT, SRC_EXT, make_cache
from kvgen.spec.library import BUILTIN_SPECS, load_library, spec_files
from kvgen.spec.transfers import check_transfers, content_problem, load_transfers
from kvgen.tools.cli import main

LIBRARY = builtin_library()

MY_LAYOUT = """\
kvgen: 1
name: my_engine_hkv
kind: paged
summary: Example engine cache, heads outermost, per-layer K/V packed in content.
lists: [L]
dims: [H, B, N, [KV, C]]
sizes: {KV: 2}
"""


def _errors(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "transfers.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        check_transfers(LIBRARY, [path])
    return [str(p) for p in info.value.problems]


def test_a_user_adds_a_pair_with_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    specs = tmp_path / "myspecs"
    specs.mkdir()
    (specs / "my_engine_hkv.yaml").write_text(MY_LAYOUT)
    (specs / "transfers.yaml").write_text("kvgen: 1\ntransfers:\n  - my_engine_hkv -> HND\n")
    out = tmp_path / "my_package"
    assert main(["build", "--specs", str(specs), "--out", str(out)]) == 0
    assert (out / "xfer__my_engine_hkv__vllm_flash_attn_hnd.py").exists()
    assert (out / "xfer__vllm_flash_attn_hnd__vllm_flash_attn_nhd.py").exists()  # the built-ins stay
    monkeypatch.syspath_prepend(str(tmp_path))
    package = importlib.import_module("my_package")
    try:
        library = load_library([specs])
        mine, hnd = library["my_engine_hkv"], library["vllm_flash_attn_hnd"]
        src, dst = make_cache(mine, SRC_EXT, torch.float32, "cpu"), make_cache(hnd, DST_EXT, torch.float32, "cpu", 1)
        want = clone_tree(dst)
        s, d = [4, 5, 6, 7, -1, 30, 2], [8, 9, 10, 11, 12, -1, 39]
        package.transfer("my_engine_hkv", "HND")().copy(src, torch.tensor(s), dst, torch.tensor(d))
        transfers.transfer(transfers.TransferSide(mine, SRC_EXT, src, s),
            transfers.TransferSide(hnd, DST_EXT, want, d))
        assert same_bits(dst, want)
        # verify runs the user's transfer too (and only what --only selects)
        assert main(["verify", "--out", str(out), "--specs", str(specs), "--only", "my_engine_hkv__vllm"]) == 0
    finally:
        for name in [m for m in sys.modules if m.startswith("my_package")]:
            del sys.modules[name]


def test_the_builtin_file_loads_and_is_no_layout() -> None:
    assert len(load_transfers(LIBRARY)) >= 70
    assert all(p.name != "transfers.yaml" for p, _ in spec_files([BUILTIN_SPECS]))
    assert spec_files([BUILTIN_SPECS / "transfers.yaml"]) == []


def test_every_problem_located(tmp_path: Path) -> None:
    problems = _errors(tmp_path, (
        "kvgen: 1\n"
        "transfers:\n"
        "  - HND => NHD\n"                              # line 3: not a transfer
        "  - nope -> NHD\n"                             # line 4: unknown layout
        "  - vllm_mla <-> vllm_flash_attn_nhd\n"        # line 5: different content
        "  - kv_2ltd -> NHD\n"                          # line 6: an object
        "  - HND -> NHD\n"                              # line 7: fine
        "  - vllm_flash_attn_hnd -> vllm_flash_attn_nhd\n"  # line 8: the same pair again
        "  - 7\n"                                       # line 9: not a string
    ))
    where = [p.split(": ", 1)[0] for p in problems]
    assert [w.rsplit(":", 2)[1] for w in where] == ["9", "3", "4", "5", "6", "8"]
    text = "\n".join(problems)
    assert "'HND => NHD' is not a transfer: write 'SOURCE -> DESTINATION'" in text
    assert "no layout or object named 'nope'" in text
    assert "vllm_mla holds one latent plane (no K/V) without heads but vllm_flash_attn_nhd holds K and V per head" \
        in text
    assert "kv_2ltd is a memory object" in text
    assert "already declared at " in text and "transfers.yaml:7" in text
    assert "expected a string, got 7" in text


@pytest.mark.parametrize("text,word", [
    ("- a -> b\n", "a transfers file is a mapping"),
    ("kvgen: 1\n", "missing required field 'transfers'"),
    ("kvgen: 1\ntransfers: HND -> NHD\n", "expected a list"),
    ("kvgen: 1\ntransfers: []\nextra: 1\n", "unknown field 'extra'"),
    ("kvgen: 2\ntransfers: []\n", "transfers format version 2 is newer"),
    ("kvgen: 1.0\ntransfers: []\n", "expected an integer format version"),
    ("kvgen: 1\ntransfers: [\n", "YAML syntax error"),
])
def test_malformed_files(tmp_path: Path, text: str, word: str) -> None:
    assert any(word in p for p in _errors(tmp_path, text))


def test_layouts_of_another_spec_format_are_refused() -> None:
    hnd = LIBRARY["vllm_flash_attn_hnd"]
    newer = dataclasses.replace(hnd, version=2)
    assert "transfers move single-part (format 1) layouts only" in (content_problem(newer, hnd) or "")
    assert content_problem(hnd, LIBRARY["vllm_flash_attn_nhd"]) is None


def test_build_reports_a_bad_transfers_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    specs = tmp_path / "s"
    specs.mkdir()
    (specs / "transfers.yaml").write_text("kvgen: 1\ntransfers:\n  - NHD -> MLA\n")
    assert main(["build", "--specs", str(specs), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "transfers.yaml:3:5: transfers[2]" not in err  # paths count from zero
    assert "transfers.yaml:3:5: transfers[0]: cannot transfer vllm_flash_attn_nhd -> vllm_mla" in err
    assert not (tmp_path / "out").exists()


def test_verify_catches_a_transfer_that_swaps_k_and_v(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      request: pytest.FixtureRequest) -> None:
    """The generated torch copies are what the mutation breaks; with the compiled kernel
    switched off (KVGEN_NATIVE=0) verify runs them, as on a host without a C compiler."""
    import shutil

    from kvgen.runtime import native
    from kvgen.spec.library import REPO_ROOT

    monkeypatch.setenv("KVGEN_NATIVE", "0")
    native.reset()
    request.addfinalizer(native.reset)  # the next test loads the kernel again

    out = tmp_path / "pkg"
    shutil.copytree(REPO_ROOT / "generated", out, ignore=shutil.ignore_patterns("__pycache__"))
    module = out / "xfer__sglang_mha__vllm_flash_attn_nhd.py"
    text = module.read_text()
    assert text.count("src_caches[kv][layer]") == 2  # _copy, then _copy_layer
    module.write_text(text.replace("src_caches[kv][layer]", "src_caches[1 - kv][layer]", 1))
    assert main(["verify", "--out", str(out), "--only", "xfer__sglang_mha__vllm_flash_attn_nhd"]) == 1
    printed = capsys.readouterr().out
    assert "sglang_mha" in printed and "vllm_flash_attn_nhd" in printed
    row = next(line for line in printed.splitlines() if line.startswith("sglang_mha "))
    assert row.split()[-2:] == ["NO", "yes"]  # the whole copy is wrong; the per-layer one was left alone
