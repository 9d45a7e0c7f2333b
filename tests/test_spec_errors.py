"""Every invalid spec in tests/specs_err fails with a located, readable SpecError.

Each `*.yaml` there starts with `# expect: <substring of a message>` and optionally
`# expect-line: N`; each folder under `crossfile/` is a set of files that are valid alone
but clash, with its expectation in `expect.txt`. Cases that cannot be committed as files
(huge, not UTF-8, empty, control bytes) are generated in tmp_path below.
"""

from __future__ import annotations

import re
import time
import tracemalloc
from pathlib import Path

import pytest

from kvgen.errors import SpecError
from kvgen.spec.library import load_library, load_specs
from kvgen.spec.loader import MAX_SPEC_BYTES

CORPUS = Path(__file__).parent / "specs_err"
SINGLE = sorted(CORPUS.glob("*.yaml"))
CROSS = sorted(p for p in (CORPUS / "crossfile").iterdir() if p.is_dir())
#: FILE:LINE:COL: YAML.PATH: message, on one line.
PROBLEM = re.compile(r"^[^:]+:\d+:\d+: \S+: .+")

VALID = """\
kvgen: 1
name: t_paged
kind: paged
summary: Test layout.
lists: [L]
dims: [KV, B, N, H, C]
sizes: {KV: 2}
"""


def expectations(text: str) -> tuple[str, int | None]:
    """The `# expect:` substring and optional `# expect-line:` of a case."""
    expect = re.search(r"^# expect: (.+)$", text, re.MULTILINE)
    line = re.search(r"^# expect-line: (\d+)$", text, re.MULTILINE)
    assert expect, "case has no '# expect:' line"
    return expect.group(1), int(line.group(1)) if line else None


def problems_of(paths: list[Path]) -> list[str]:
    """Load `paths` as a whole library (no built-ins); return the problems as printed."""
    with pytest.raises(SpecError) as info:
        load_library(paths, builtin=False)
    return [str(p) for p in info.value.problems]


def check(problems: list[str], expect: str, line: int | None) -> None:
    for text in problems:
        assert PROBLEM.fullmatch(text), f"badly formed problem: {text!r}"
    hits = [p for p in problems if expect in p]
    assert hits, f"no problem contains {expect!r}:\n" + "\n".join(problems)
    if line is not None:
        lines = [int(p.split(":")[1]) for p in hits]
        assert line in lines, f"expected line {line}, got {lines}:\n" + "\n".join(hits)


def test_corpus_is_large_enough() -> None:
    assert len(SINGLE) + sum(len(list(d.glob("*.yaml"))) for d in CROSS) >= 64


@pytest.mark.parametrize("path", SINGLE, ids=[p.name for p in SINGLE])
def test_invalid_spec(path: Path) -> None:
    expect, line = expectations(path.read_text("utf-8"))
    check(problems_of([path]), expect, line)


@pytest.mark.parametrize("folder", CROSS, ids=[f"crossfile/{p.name}" for p in CROSS])
def test_invalid_across_files(folder: Path) -> None:
    files = sorted(folder.glob("*.yaml"))
    assert len(files) >= 2
    # Each file is valid on its own; only the library-wide check finds the clash.
    assert len(load_specs(files)) == len(files)
    expect, line = expectations((folder / "expect.txt").read_text("utf-8"))
    check(problems_of([folder]), expect, line)


def test_all_schema_problems_at_once(tmp_path: Path) -> None:
    spec = tmp_path / "three.yaml"
    spec.write_text(VALID.replace("t_paged", "T-Paged") + "dtypes: [float64]\nstride: 4\n")
    problems = problems_of([spec])
    assert len(problems) == 3, problems
    for expect in ("name: 'T-Paged' is not allowed", "dtypes[0]: 'float64'", "unknown field 'stride'"):
        check(problems, expect, None)


def test_all_semantic_problems_at_once(tmp_path: Path) -> None:
    spec = tmp_path / "three.yaml"
    spec.write_text(VALID.replace("[L]", "[L, B]").replace("B, N, H, C", "N, T, H, C")
                    .replace("{KV: 2}", "{KV: 3}"))
    problems = problems_of([spec])
    assert len(problems) == 3, problems
    for expect in ("B cannot be a list level", "T (token in a chunk) belongs to objects",
                   "its size is 2, not 3"):
        check(problems, expect, None)


def test_problems_of_several_files_together(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(VALID.replace("kvgen: 1", "kvgen: 0"))
    (tmp_path / "b.yaml").write_text(VALID.replace("{KV: 2}", "{KV: 2, B: 4}"))
    problems = problems_of([tmp_path])
    assert [Path(p.split(":")[0]).name for p in problems] == ["a.yaml", "b.yaml"]


def test_huge_file(tmp_path: Path) -> None:
    spec = tmp_path / "huge.yaml"
    spec.write_text(VALID + "".join(f"# padding line {i:06d} " + "x" * 60 + "\n" for i in range(1000)))
    assert spec.stat().st_size > MAX_SPEC_BYTES
    check(problems_of([spec]), f"a spec may be at most {MAX_SPEC_BYTES}", 1)


def test_limit_is_inclusive(tmp_path: Path) -> None:
    spec = tmp_path / "big.yaml"
    pad = MAX_SPEC_BYTES - len(VALID)
    spec.write_text(VALID + "#" + "x" * (pad - 2) + "\n")
    assert spec.stat().st_size == MAX_SPEC_BYTES
    load_specs([spec])


def test_not_utf8(tmp_path: Path) -> None:
    spec = tmp_path / "latin1.yaml"
    spec.write_bytes(VALID.replace("Test layout.", "Caf\xe9 layout.").encode("latin-1"))
    check(problems_of([spec]), "file is not UTF-8 text (byte 47 is 0xe9)", 4)


def test_utf16(tmp_path: Path) -> None:
    spec = tmp_path / "utf16.yaml"
    spec.write_bytes(VALID.encode("utf-16"))
    check(problems_of([spec]), "file is not UTF-8 text", 1)


def test_empty_file(tmp_path: Path) -> None:
    spec = tmp_path / "empty.yaml"
    spec.write_bytes(b"")
    check(problems_of([spec]), "empty spec", 1)


@pytest.mark.parametrize("char", ["\x00", "\x07", "\x1b", "\x7f"])
def test_control_character_in_text(tmp_path: Path, char: str) -> None:
    spec = tmp_path / "control.yaml"
    spec.write_text(VALID.replace("Test layout.", f"Test{char}layout."))
    check(problems_of([spec]), f"character {char!r} (U+{ord(char):04X}) cannot appear", 4)


def test_deep_nesting_is_rejected_before_composing(tmp_path: Path) -> None:
    # PyYAML's composer recurses once per level; this would be a RecursionError.
    spec = tmp_path / "deep.yaml"
    spec.write_text(VALID + "x: " + "[" * 20000 + "]" * 20000 + "\n")
    check(problems_of([spec]), "nesting is deeper than", 8)


@pytest.mark.serial  # a time limit
def test_billion_laughs_does_not_expand() -> None:
    spec = CORPUS / "billion_laughs.yaml"
    tracemalloc.start()
    start = time.perf_counter()
    try:
        problems = problems_of([spec])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - start < 5
    assert peak < 2 * 1024 * 1024, f"peak {peak} bytes"
    check(problems, "anchors and aliases are not allowed", 3)


def test_python_tags_run_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    spec = tmp_path / "evil.yaml"
    spec.write_text(VALID + f"x: !!python/object/apply:os.system ['touch {marker}']\n")
    check(problems_of([spec]), "YAML tag !!python/object/apply:os.system is not allowed", 8)
    assert not marker.exists()


def test_builtin_library_still_loads() -> None:
    assert len(load_library().specs) > 0
