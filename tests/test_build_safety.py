"""`kvgen build` never leaves a half-written package, `kvgen check` tells every kind of
drift apart, builds are byte-for-byte reproducible, and the generator never needs torch."""

from __future__ import annotations

import hashlib
import importlib
import itertools
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import kvgen.emit.build
import kvgen.emit.render
from kvgen import __version__
from kvgen.emit.build import DEFAULT_OUT, build, check, render
from kvgen.emit.render import DIGEST_PREFIX, body_digest, seal, unseal
from kvgen.errors import BuildError
from kvgen.spec.library import BUILTIN_SPECS, REPO_ROOT, load_library

pytestmark = pytest.mark.slow

SAMPLE = "vllm_flash_attn_nhd__kv_2ltd.py"
_PACKAGES = itertools.count()


@pytest.fixture(scope="module")
def files() -> dict[str, str]:
    return render()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, files: dict[str, str]) -> Path:
    """One build of the built-ins for this module; `previous_build` copies it where a test needs
    an earlier build's output (a build costs seconds, a copy a fraction of one). Never changed."""
    out = tmp_path_factory.mktemp("built") / "generated"
    kvgen.emit.build.write_atomically(out, files)  # what build(out) writes, from the module's render
    return out


@pytest.fixture
def render_once(files: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """build and check of the built-ins alone use the module's render instead of rendering the
    library again (seconds each): for tests about writing and comparing, where the specs and
    templates do not change while they run. Extra specs still render afresh."""
    real_render = kvgen.emit.build.render

    def rendered(extra_specs: Sequence[Path] = (), *, builtin: bool = True) -> dict[str, str]:
        return dict(files) if builtin and not extra_specs else real_render(extra_specs, builtin=builtin)

    monkeypatch.setattr(kvgen.emit.build, "render", rendered)


def previous_build(built: Path, out: Path) -> None:
    """`out` as `kvgen build --out out` leaves it: the module's build, copied."""
    shutil.copytree(built, out)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


def import_package(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Import `folder` as a package under a fresh name and make a connector. Its other modules
    are not imported here: the tests first find the folder byte for byte the library's build,
    the committed generated/, whose every module the rest of the suite imports."""
    package = f"kvgen_safety_{next(_PACKAGES)}"
    root = folder.parent / f"importroot{package}"
    shutil.copytree(folder, root / package)
    monkeypatch.syspath_prepend(str(root))
    try:
        pkg = importlib.import_module(package)
        assert pkg.connector("vllm_flash_attn_nhd", "kv_2ltd", "cpu").layout.name == "vllm_flash_attn_nhd"
    finally:
        for mod in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            del sys.modules[mod]


# -- interrupted builds -------------------------------------------------------------------


@pytest.mark.parametrize("fail_at", [1, 5, "last"])
def test_failed_write_keeps_previous_output(built: Path, fail_at: int | str, files: dict[str, str], tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch, render_once: None) -> None:
    out = tmp_path / "generated"
    previous_build(built, out)
    (out / "__pycache__").mkdir()  # a previous import's cache stays out of the way too
    before = snapshot(out)
    real_write = Path.write_text
    calls = itertools.count(1)
    stop = len(files) if fail_at == "last" else fail_at

    def flaky(self: Path, *args: object, **kwargs: object) -> int:
        if next(calls) == stop:
            raise OSError(28, "No space left on device")
        return real_write(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "write_text", flaky)
    with pytest.raises(BuildError, match="No space left"):
        build(out)
    monkeypatch.setattr(Path, "write_text", real_write)
    assert snapshot(out) == before
    assert leftovers(tmp_path, "generated") == [], "staging or backup folders were left behind"
    assert check(out).ok
    import_package(out, monkeypatch)


def test_failed_render_keeps_previous_output(built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "generated"
    previous_build(built, out)
    before = snapshot(out)

    def broken(*args: object, **kwargs: object) -> dict[str, str]:
        raise BuildError("template exploded")

    monkeypatch.setattr(kvgen.emit.build, "render_package", broken)
    with pytest.raises(BuildError, match="template exploded"):
        build(out)
    assert snapshot(out) == before
    assert leftovers(tmp_path, "generated") == []


def test_invalid_spec_keeps_previous_output(built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "generated"
    previous_build(built, out)
    before = snapshot(out)
    bad = tmp_path / "specs"
    bad.mkdir()
    (bad / "broken.yaml").write_text("kvgen: 1\nname: Broken\n")
    with pytest.raises(ValueError):  # SpecError
        build(out, [bad])
    assert snapshot(out) == before


def test_keyboard_interrupt_mid_write_leaves_nothing_behind(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch, render_once: None) -> None:
    out = tmp_path / "fresh"
    real_write = Path.write_text
    calls = itertools.count(1)

    def interrupted(self: Path, *args: object, **kwargs: object) -> int:
        if next(calls) == 3:
            raise KeyboardInterrupt
        return real_write(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "write_text", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build(out)
    assert not out.exists(), "a first build that failed must not leave a partial folder"
    assert leftovers(tmp_path, "fresh") == []


def test_build_replaces_exactly(tmp_path: Path, files: dict[str, str], render_once: None) -> None:
    """A build leaves exactly its files: stray files and old modules are gone."""
    out = tmp_path / "generated"
    out.mkdir()
    (out / "old_layout__kv_2ltd.py").write_text("# from a spec since deleted\n")
    (out / "notes.txt").write_text("hand-written")
    build(out)
    assert sorted(p.name for p in out.iterdir()) == sorted(files)


# -- kvgen check ----------------------------------------------------------------------------


def test_check_reports_each_kind_of_drift(built: Path, tmp_path: Path, render_once: None) -> None:
    out = tmp_path / "generated"
    previous_build(built, out)
    assert check(out).ok and check(out).lines() == []

    sample = out / SAMPLE
    sample.write_text(sample.read_text().replace("for layer in range(g.L):", "for layer in range(g.L - 1):", 1))
    undigested = out / "formats.py"
    undigested.write_text(unseal(undigested.read_text())[1])  # digest line removed: also a hand edit
    old = out / "sglang_mha__kv_2ltd.py"
    recorded, body = unseal(old.read_text())
    body = body.replace("runtime.require_abi(1", "runtime.require_abi(1", 1) + "\n# from an older template\n"
    old.write_text(f"{DIGEST_PREFIX}{body_digest(body)}\n{body}")  # sealed by kvgen, just not this one
    (out / "vllm_mla__kv_mla.py").unlink()
    (out / "scratch.py").write_text("print('hi')\n")
    (out / "__pycache__").mkdir()

    report = check(out)
    assert not report.ok
    assert report.edited == sorted([SAMPLE, "formats.py"])
    assert report.stale == ["sglang_mha__kv_2ltd.py"]
    assert report.missing == ["vllm_mla__kv_mla.py"]
    assert report.stray == ["scratch.py"]
    text = "\n".join(report.lines())
    for expected in (f"edited by hand: {SAMPLE}", "out of date (specs or templates changed): sglang_mha__kv_2ltd.py",
                     "missing: vllm_mla__kv_mla.py", "stray file, not written by kvgen build: scratch.py"):
        assert expected in text


def test_check_sees_changed_specs_as_stale(tmp_path: Path, render_once: None) -> None:
    specs = tmp_path / "specs"
    specs.mkdir()
    source = (BUILTIN_SPECS / "vllm/flash_attn_nhd.yaml").read_text()
    mine = (source.replace("name: vllm_flash_attn_nhd", "name: my_layout").replace("aliases: [NHD]\n", "")
            .replace("engines: [vllm/FLASH_ATTN]\n", "").replace('versions: {vllm: "<0.33"}\n', ""))
    (specs / "mine.yaml").write_text(mine)
    out = tmp_path / "generated"
    build(out, [specs])
    assert check(out, [specs]).ok
    assert check(out).stray == sorted(p.name for p in out.glob("my_layout__*.py"))

    (specs / "mine.yaml").write_text(mine.replace("summary: vLLM", "summary: Changed, vLLM"))
    report = check(out, [specs])
    assert report.stale and not report.edited and not report.missing and not report.stray
    assert all(n.startswith("my_layout__") or n == "__init__.py" for n in report.stale)


def test_check_of_missing_folder(tmp_path: Path, files: dict[str, str], render_once: None) -> None:
    report = check(tmp_path / "nowhere")
    assert report.missing == sorted(files) and not report.ok


def test_cli_check_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str], render_once: None) -> None:
    from kvgen.tools.cli import main

    out = tmp_path / "generated"
    assert main(["build", "--out", str(out)]) == 0
    assert main(["check", "--out", str(out)]) == 0
    (out / SAMPLE).write_text((out / SAMPLE).read_text() + "# hand edit\n")
    assert main(["check", "--out", str(out)]) == 1
    assert f"edited by hand: {SAMPLE}" in capsys.readouterr().err


def test_committed_package_is_current() -> None:
    report = check(DEFAULT_OUT)
    assert report.ok, "generated/ differs from `kvgen build`:\n" + "\n".join(report.lines())


# -- reproducibility ------------------------------------------------------------------------


def test_rebuilds_are_byte_identical(tmp_path: Path) -> None:
    build(tmp_path / "a")
    build(tmp_path / "b")
    build(tmp_path / "b")  # over an existing build too
    assert snapshot(tmp_path / "a") == snapshot(tmp_path / "b")


_DIGEST_SCRIPT = (
    "import hashlib, json; from kvgen.emit.build import render; "
    "print(json.dumps({k: hashlib.sha256(v.encode()).hexdigest() for k, v in render().items()}))"
)


def test_render_does_not_depend_on_hash_seed_or_cwd(files: dict[str, str], tmp_path: Path) -> None:
    import json

    want = {k: hashlib.sha256(v.encode()).hexdigest() for k, v in files.items()}

    def digests(seed: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO_ROOT)}
        return subprocess.run([sys.executable, "-c", _DIGEST_SCRIPT], capture_output=True, text=True,
                              env=env, cwd=tmp_path, check=True, timeout=120)

    seeds = ("1", "12345")
    with ThreadPoolExecutor(max_workers=2) as pool:  # the two interpreters run side by side
        for seed, done in zip(seeds, pool.map(digests, seeds), strict=True):
            assert json.loads(done.stdout) == want, f"render differs under PYTHONHASHSEED={seed}"


# That the generator never imports torch (plan, render, build, check in a fresh interpreter) is
# test_architecture.py::test_building_the_library_never_imports_torch: one interpreter checks both.


def test_seal_skips_the_compile_only_for_bodies_a_build_compiled(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A render that repeats a module of the shipped generated/ is not compiled again: a build
    compiled it (its recorded digest is its body's). A body edited by hand after its build, or
    new, is compiled, and one that does not compile is refused."""
    shipped = tmp_path / "generated"
    shipped.mkdir()
    as_built, edited, new = "value = (\n", "other = (\n", "third = (\n"  # none of them compiles
    (shipped / "a.py").write_text(f"{DIGEST_PREFIX}{body_digest(as_built)}\n{as_built}")
    before_edit = "other = 1\n"
    (shipped / "b.py").write_text(f"{DIGEST_PREFIX}{body_digest(before_edit)}\n{edited}")
    monkeypatch.setattr(kvgen.emit.render, "data_dir", lambda name: tmp_path / name)
    kvgen.emit.render._shipped.cache_clear()
    try:
        assert seal("a", as_built).endswith(as_built)  # taken as compiled: what a build wrote
        for name, body in (("b", edited), ("c", new)):
            with pytest.raises(BuildError, match="is not valid Python"):
                seal(name, body)
    finally:
        kvgen.emit.render._shipped.cache_clear()


# -- what every generated file says about itself --------------------------------------------


def test_every_file_has_the_do_not_edit_header(files: dict[str, str]) -> None:
    library = load_library()
    by_origin = {s.origin: s for s in (*library.specs, *library.models)}  # models: their connectors
    for name, text in files.items():
        lines = text.splitlines()
        assert re.fullmatch(r"# kvgen-body-sha256: [0-9a-f]{64}", lines[0]), name
        assert lines[1] == f"# DO NOT EDIT: generated by kvgen {__version__} from", name
        sources = []
        for line in lines[2:]:
            m = re.fullmatch(r"#   (\S+) \(sha256 ([0-9a-f]{16})\)", line)
            if not m:
                break
            spec = by_origin[m.group(1)]
            assert spec.digest.startswith(m.group(2)), f"{name}: stale digest for {m.group(1)}"
            assert hashlib.sha256((REPO_ROOT / m.group(1)).read_bytes()).hexdigest() == spec.digest
            sources.append(spec)
        assert sources, f"{name}: names no source spec"
        assert lines[2 + len(sources)].startswith("# Change the specs or templates/"), name
        if name.startswith("xfer__"):  # a transfer: its source and destination (once when they are one)
            src, dst = name.removesuffix(".py").split("__")[1:]
            assert [s.name for s in sources] == list(dict.fromkeys([src, dst])), name
        elif "__" in name.removesuffix(".py").strip("_"):
            paged, obj = name.removesuffix(".py").removesuffix("_triton").split("__")  # a connector or its kernel
            assert [s.name for s in sources] == [paged, obj], name
        elif name == "__init__.py":
            assert len(sources) == len(library.specs)
        elif name == "formats.py":
            assert {s.name for s in sources} == {s.name for s in library.objects}


def test_generated_package_passes_ruff(built: Path, tmp_path: Path) -> None:
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed")
    out = tmp_path / "generated"
    previous_build(built, out)
    done = subprocess.run([ruff, "check", "--no-cache", "--config", str(REPO_ROOT / "pyproject.toml"), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
