"""What one process keeps between loads and renders, and why it never changes a result.

A spec file that passed the schema is kept by its bytes (wherever it is read from), and a
generated module body that compiled by its digest: loading or rendering again reads the file
and renders the templates as before, and only skips work whose result the bytes decide.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgen.emit import render
from kvgen.errors import BuildError, SpecError
from kvgen.spec.library import BUILTIN_SPECS, load_each
from kvgen.spec.loader import load_document

SPEC = BUILTIN_SPECS / "vllm" / "flash_attn_nhd.yaml"


def test_each_load_gets_its_own_document(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_bytes(SPEC.read_bytes())
    first = load_document(path)
    first.data["name"] = "edited_by_a_caller"
    first.positions.clear()
    second = load_document(path)
    assert second.data["name"] == "vllm_flash_attn_nhd"
    assert second.positions and second is not first


def test_a_file_edited_in_place_is_read_again(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_bytes(SPEC.read_bytes())
    assert load_document(path).data["name"] == "vllm_flash_attn_nhd"
    path.write_text(SPEC.read_text().replace("name: vllm_flash_attn_nhd", "name: renamed_here"))
    assert load_document(path).data["name"] == "renamed_here"
    path.write_text(SPEC.read_text().replace("kind: paged", "kind: [paged]"))
    with pytest.raises(SpecError, match="kind"):
        load_document(path)


def test_a_spec_that_failed_is_checked_again_and_fails_again(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC.read_text().replace("kind: paged", "kind: 3"))
    for _ in range(2):
        with pytest.raises(SpecError, match="kind"):
            load_document(path)


def test_the_same_file_under_another_name_is_located_under_that_name(tmp_path: Path) -> None:
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    for path in (a, b):
        path.write_bytes(SPEC.read_bytes())
    assert load_document(a).file.endswith("a.yaml")
    assert load_document(b).file.endswith("b.yaml")


def test_a_later_check_of_the_same_bytes_under_another_name_locates_its_problems_there(tmp_path: Path) -> None:
    """The schema passes this spec; the semantic checks that follow it find an axis twice."""
    text = SPEC.read_text().replace("dims: [KV, B, N, H, C]", "dims: [KV, B, N, H, H]")
    for name in ("a.yaml", "b.yaml"):
        (tmp_path / name).write_text(text)
        _, problems = load_each([tmp_path / name])
        assert problems and {p.file for p in problems} == {str(tmp_path / name)}
        assert any("axis H appears twice" in p.message and p.line == 7 for p in problems)


def test_a_body_that_compiled_is_sealed_alike_and_one_that_did_not_fails_every_time() -> None:
    good = "VALUE = 1\n"
    assert render.seal("m.py", good) == render.seal("m.py", good)
    assert render.seal("m.py", good).endswith("\n" + good)
    bad = "def f(:\n"
    for _ in range(2):
        with pytest.raises(BuildError, match="not valid Python"):
            render.seal("m.py", bad)
    assert render.body_digest(bad) not in render._COMPILED
