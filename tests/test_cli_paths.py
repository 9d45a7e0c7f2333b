"""Where `kvgen build`, `check` and `verify` write and read by default: never into an
installed kvgen package; the checkout's generated/ only when kvgen runs from a checkout."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgen.spec.library import REPO_ROOT
from kvgen.tools import cli, paths


def _fake_installed(root: Path) -> Path:
    """site-packages/kvgen as a wheel installs it: specs, templates, generated inside the package."""
    package = root / "site-packages" / "kvgen"
    for sub in ("specs", "templates", "generated"):
        (package / sub).mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "generated" / "__init__.py").write_text("# the installed connectors\n")
    return package


def _fake_checkout(root: Path) -> Path:
    repo = root / "repo"
    for sub in ("kvgen", "specs", "templates"):
        (repo / sub).mkdir(parents=True)
    (repo / "pyproject.toml").write_text('[project]\nname = "kvgen"\nversion = "0.1.0"\n')
    return repo / "kvgen"


def test_checkout_detection(tmp_path: Path) -> None:
    assert paths.source_checkout(REPO_ROOT / "kvgen") == REPO_ROOT
    assert paths.source_checkout(_fake_checkout(tmp_path)) == tmp_path / "repo"
    assert paths.source_checkout(_fake_installed(tmp_path)) is None
    other = tmp_path / "other"
    for sub in ("kvgen", "specs", "templates"):
        (other / sub).mkdir(parents=True)
    (other / "pyproject.toml").write_text('[project]\nname = "someone-else"\n')
    assert paths.source_checkout(other / "kvgen") is None


def test_default_out_in_a_checkout() -> None:
    assert paths.default_out() == REPO_ROOT / "generated"
    assert str(REPO_ROOT / "generated") in _help("build")


def _help(command: str) -> str:
    sub = next(a for a in cli.parser()._actions if a.dest == "command")
    return " ".join(sub.choices[command].format_help().split())


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run as an installed kvgen would, from a project folder that is the working directory."""
    package = _fake_installed(tmp_path)
    monkeypatch.setattr(paths, "PACKAGE_DIR", package)
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    return package


def test_installed_build_writes_into_the_working_directory(installed: Path, capsys) -> None:
    before = {p: p.read_bytes() for p in installed.rglob("*") if p.is_file()}
    assert cli.main(["build"]) == 0
    assert (Path.cwd() / "generated" / "vllm_flash_attn_nhd__kv_2ltd.py").is_file()
    assert {p: p.read_bytes() for p in installed.rglob("*") if p.is_file()} == before
    assert cli.main(["check"]) == 0
    assert "up to date" in capsys.readouterr().out


def test_installed_build_refuses_to_write_into_the_package(installed: Path, capsys) -> None:
    before = {p: p.read_bytes() for p in installed.rglob("*") if p.is_file()}
    assert cli.main(["build", "--out", str(installed / "generated")]) == 1
    err = capsys.readouterr().err
    assert "refusing to write into the kvgen package itself" in err and "shared by everyone" in err
    assert {p: p.read_bytes() for p in installed.rglob("*") if p.is_file()} == before


def test_installed_help_says_the_default(installed: Path) -> None:
    for command in ("build", "check", "verify"):
        text = _help(command)
        assert "default: ./generated" in text, text
        assert "not run from a source checkout" in text


def test_build_check_verify_agree(installed: Path) -> None:
    outs = {c: cli.parser().parse_args([c]).out for c in ("build", "check", "verify")}
    assert set(outs.values()) == {Path("generated")}


def test_build_never_replaces_what_it_did_not_write(tmp_path: Path, capsys) -> None:
    """A build replaces --out whole: a folder of someone's files, or a file, is refused untouched."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.txt").write_text("mine\n")
    assert cli.main(["build", "--out", str(project)]) == 1
    assert "did not write" in capsys.readouterr().err
    assert [p.name for p in project.iterdir()] == ["notes.txt"]
    assert cli.main(["build", "--out", str(project / "notes.txt")]) == 1
    assert cli.main(["build", "--out", str(project / "notes.txt" / "out")]) == 1
    assert capsys.readouterr().err.count("is a file, not a folder") == 2
    assert (project / "notes.txt").read_text() == "mine\n"
    # A folder a build wrote, or an empty one, is replaced.
    out = project / "gen"
    out.mkdir()
    assert cli.main(["build", "--out", str(out)]) == 0
    assert cli.main(["build", "--out", str(out)]) == 0
    assert (out / "__init__.py").is_file()
