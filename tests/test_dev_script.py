"""`scripts/dev run` tells a newcomer what it is doing: each step with its time, then one
summary line, also naming the step that failed (issue 20, item 21). A stand-in Python
records the calls, so no set-up, build or verify really runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(tmp_path: Path, fail_on: str = "", *args: str, code: int = 3) -> subprocess.CompletedProcess[str]:
    """scripts/dev with a stand-in Python that logs its arguments and exits `code` when they
    contain `fail_on`."""
    fake = tmp_path / "python"
    log = tmp_path / "calls"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {log}\ncase "$*" in *"{fail_on or "@never@"}"*) exit {code};; esac\n'
                    'exit 0\n')
    fake.chmod(0o755)
    return subprocess.run([str(ROOT / "scripts" / "dev"), *(args or ("run",))], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHON": str(fake), "KVGEN_TEST_WORKERS": "2",
                                           "KVGEN_NO_ENGINES": "1"})  # the engines' venv is not under test


def _pytest_calls(tmp_path: Path) -> list[str]:
    return [c for c in (tmp_path / "calls").read_text().splitlines() if c.startswith("-m pytest")]


def test_run_prints_its_steps_with_times_and_a_summary(tmp_path: Path) -> None:
    done = _run(tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    for step in ("set-up", "build", "check", "verify"):
        assert f"scripts/dev: {step} ..." in lines
        assert any(re.fullmatch(f"scripts/dev: {step} done \\(\\d+ s\\)", line) for line in lines), lines
    assert re.fullmatch(r"scripts/dev run: passed in \d+ s \(set-up \d+ s, build \d+ s, check \d+ s, verify \d+ s\)",
                        lines[-1]), lines[-1]
    calls = (tmp_path / "calls").read_text().splitlines()
    assert [c for c in calls if c.startswith("-m kvgen")] == ["-m kvgen build", "-m kvgen check", "-m kvgen verify"]


@pytest.mark.parametrize("command", ["run", "test"])
def test_set_up_compiles_the_checkouts_python_once_for_every_process(tmp_path: Path, command: str) -> None:
    """Bytecode for kvgen and the generated package, which every process of a run imports (where
    PYTHONDONTWRITEBYTECODE is set, none of them writes any), made before the first of them starts."""
    done = _run(tmp_path, "", command)
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    compiled = calls.index("-m compileall -q -j 0 kvgen generated")
    assert compiled < min(i for i, c in enumerate(calls) if c.startswith(("-m kvgen", "-m pytest")))


def test_a_failing_step_is_named_in_the_summary(tmp_path: Path) -> None:
    done = _run(tmp_path, fail_on="kvgen check")
    assert done.returncode == 3
    assert "scripts/dev: verify ..." not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"scripts/dev run: FAILED at check after \d+ s \(exit 3\); done before it: set-up \d+ s, "
                        r"build \d+ s", last), last


def test_test_runs_the_parallel_pass_then_the_serial_tests_alone(tmp_path: Path) -> None:
    done = _run(tmp_path, "", "test", "tests/test_words.py", "-x")
    assert done.returncode == 0, done.stderr
    bounded = "-m pytest -q -o hang_dump_after=600"
    assert _pytest_calls(tmp_path) == [f"{bounded} -n 2 --max-worker-restart=0 -m not serial tests/test_words.py -x",
                                       f"{bounded} -m serial tests/test_words.py -x"]


def test_a_pass_that_hangs_is_stopped_and_fails_the_run(tmp_path: Path) -> None:
    """A stuck test must fail CI, not hold it: a pass past KVGEN_TEST_TIMEOUT is stopped (its
    process group with it), named, and the run fails; the other pass still runs."""
    fake = tmp_path / "python"
    log = tmp_path / "calls"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {log}\ncase "$*" in *"not serial"*) sleep 60 & wait;; esac\nexit 0\n')
    fake.chmod(0o755)
    done = subprocess.run([str(ROOT / "scripts" / "dev"), "test", "tests/test_words.py"], capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL,
                          env={**os.environ, "PYTHON": str(fake), "KVGEN_TEST_WORKERS": "2", "KVGEN_NO_ENGINES": "1",
                               "KVGEN_TEST_TIMEOUT": "0.5"})
    assert done.returncode == 124, (done.stdout, done.stderr)
    assert "the parallel pass ran past 0.5 s (KVGEN_TEST_TIMEOUT) and was stopped" in done.stderr, done.stderr
    assert len(_pytest_calls(tmp_path)) == 2


@pytest.mark.parametrize("failing", ["not serial", "-m serial"])
def test_a_failing_pass_fails_test_and_the_other_pass_still_runs(tmp_path: Path, failing: str) -> None:
    done = _run(tmp_path, failing, "test", code=1)
    assert done.returncode == 1
    assert len(_pytest_calls(tmp_path)) == 2


@pytest.mark.parametrize("empty, code", [("-m serial", 0), ("-m pytest", 5)], ids=["one_pass", "both_passes"])
def test_a_pass_that_selects_no_test_fails_only_when_both_do(tmp_path: Path, empty: str, code: int) -> None:
    done = _run(tmp_path, empty, "test", code=5)
    assert done.returncode == code, done.stderr


def _scratch_of_each_pass(tmp_path: Path, **env: str) -> tuple[list[tuple[str, str]], subprocess.CompletedProcess[str]]:
    """(TMPDIR, its mode) as each pytest pass of `scripts/dev test` saw them, and the run."""
    fake = tmp_path / "python"
    log = tmp_path / "scratch"
    fake.write_text(f'#!/bin/sh\ncase "$*" in *"-m pytest"*) echo "$TMPDIR $(stat -c %a "$TMPDIR")" >> {log};; esac\n'
                    'exit 0\n')
    fake.chmod(0o755)
    done = subprocess.run([str(ROOT / "scripts" / "dev"), "test", "tests/test_words.py"], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHON": str(fake), "KVGEN_TEST_WORKERS": "2",
                                                      "KVGEN_NO_ENGINES": "1", **env})
    return [tuple(line.split()) for line in log.read_text().splitlines()], done


def _roomy_tmpfs(path: str) -> bool:
    """Whether `path` is a writable tmpfs with scripts/dev's SCRATCH_MIN_MB (2 GiB) free."""
    if sys.platform != "linux" or not os.path.isdir(path) or not os.access(path, os.W_OK):
        return False
    kind = subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True).stdout.strip()
    st = os.statvfs(path)
    return kind == "tmpfs" and st.f_bavail * st.f_frsize >= 2 << 30


def test_the_passes_write_their_temporary_files_to_a_private_tmpfs_folder_removed_after(tmp_path: Path) -> None:
    """Creating a file costs a disk file system 20 times what it costs a tmpfs, and the suite
    creates tens of thousands: where /dev/shm is a tmpfs with room, both passes get a folder of
    their own there (0700), gone when the run ends, as is one a killed run left; elsewhere the
    system's temporary folder."""
    roomy = _roomy_tmpfs("/dev/shm")
    ended = subprocess.Popen(["true"])
    ended.wait()
    left = Path(f"/dev/shm/kvgen-test-{os.getuid()}-{ended.pid}")  # a run killed before its clean-up
    if roomy:
        left.mkdir()
    seen, done = _scratch_of_each_pass(tmp_path, TMPDIR=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert len(seen) == 2 and seen[0] == seen[1], seen
    folder, mode = seen[0]
    if not roomy:
        assert folder == str(tmp_path)
        return
    assert re.fullmatch(rf"/dev/shm/kvgen-test-{os.getuid()}-\d+", folder) and mode == "700", seen
    assert not os.path.exists(folder), "the run left its scratch folder behind"
    assert not left.exists(), "a folder of a run that is gone was kept"


def test_kvgen_test_tmpdir_names_the_passes_temporary_folder_and_it_is_kept(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o750)
    seen, done = _scratch_of_each_pass(tmp_path, KVGEN_TEST_TMPDIR=str(mine))
    assert done.returncode == 0, done.stderr
    assert seen == [(str(mine), "750")] * 2
    assert mine.is_dir()


def _whole_test_run(tmp_path: Path, venv_python: str) -> subprocess.CompletedProcess[str]:
    """A whole `scripts/dev test` with a stand-in Python that logs its calls to tmp_path/calls and
    passes, and SGLang's venv (its base too) a folder whose python runs the script `venv_python`."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    vpy = venv / "bin" / "python"
    vpy.write_text(venv_python)
    vpy.chmod(0o755)
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {tmp_path / "calls"}\nexit 0\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "KVGEN_NO_ENGINES"}
    return subprocess.run([str(ROOT / "scripts" / "dev"), "test"], capture_output=True, text=True, timeout=60,
                          env={**env, "PYTHON": str(fake), "KVGEN_TEST_WORKERS": "2",
                               "KVGEN_SGLANG_VENV": str(venv), "KVGEN_SGLANG_BASE": str(venv)})


def test_a_whole_test_run_sets_up_sglang_meanwhile_and_fails_when_that_set_up_fails(tmp_path: Path) -> None:
    """The SGLang venv is set up in the background while the suite runs; a set-up that fails
    fails the run with its output, after both passes of the suite ran."""
    done = _whole_test_run(tmp_path, '#!/bin/sh\ncase "$*" in *"pip install"*) echo "no wheel for sglang here" >&2;'
                           ' exit 1;; esac\nexit 1\n')
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "setting up" in done.stderr and "no wheel for sglang here" in done.stderr, done.stderr
    assert len(_pytest_calls(tmp_path)) == 2


@pytest.mark.parametrize("writable", ["base", "its folder"])
def test_the_shared_sglang_venv_is_refused_where_another_user_could_write_it(tmp_path: Path, writable: str) -> None:
    """The SGLang venv that every checkout shares is code the tests import: a folder of it that
    its group or others may write is refused before anything in it runs."""
    base = tmp_path / "shared" / "sglang"
    (base / "bin").mkdir(parents=True)
    ran = tmp_path / "ran"
    vpy = base / "bin" / "python"
    vpy.write_text(f'#!/bin/sh\ntouch {ran}\nexit 1\n')
    vpy.chmod(0o755)
    (tmp_path / "shared").chmod(0o700)
    (base if writable == "base" else tmp_path / "shared").chmod(0o777)
    env = {k: v for k, v in os.environ.items() if k != "KVGEN_NO_ENGINES"}
    done = subprocess.run([str(ROOT / "scripts" / "dev"), "engines"], capture_output=True, text=True, timeout=60,
                          env={**env, "KVGEN_SGLANG_VENV": str(tmp_path / "none"), "KVGEN_SGLANG_BASE": str(base)})
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "that no one else can write" in done.stderr, done.stderr
    assert not ran.exists()


def test_a_sglang_venv_with_pip_of_its_own_is_made_again(tmp_path: Path) -> None:
    """A checkout's SGLang venv that an earlier set-up made with pip and setuptools of its own (an
    old setuptools, ahead of the shared venv's on its path, cannot install kvgen editable) is
    removed and made again without them, then kvgen installed into it and the tests run there."""
    log, base, venv = tmp_path / "calls", tmp_path / "base", tmp_path / "venv"
    old_site, new_site = venv / "lib" / "site-packages", tmp_path / "new-site"
    for folder in (base / "bin", venv / "bin", old_site / "pip", new_site):
        folder.mkdir(parents=True)
    (old_site / "kvgen-sglang-base.pth").write_text("import site\n")  # made by an earlier set-up

    def shim(path: Path, name: str, site: Path, body: str = "", rc: int = 0) -> None:
        path.write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\ncase "$*" in *sysconfig*) echo {site}; exit 0;; esac\n'
                        f'{body}exit {rc}\n')
        path.chmod(0o755)

    new = tmp_path / "new-python"
    shim(new, "new", new_site)
    # the shared venv: installed already; its `venv` makes the checkout's venv with the new python
    shim(base / "bin" / "python", "base", tmp_path / "base-site",
         f'case "$*" in *"-m venv --without-pip"*)\n'
         f'  for d; do :; done; mkdir -p "$d/bin"; cp {new} "$d/bin/python";;\nesac\n')
    shim(venv / "bin" / "python", "old", old_site, rc=1)  # kvgen from this checkout: not installed there
    env = {k: v for k, v in os.environ.items() if k != "KVGEN_NO_ENGINES"}
    done = subprocess.run([str(ROOT / "scripts" / "dev"), "engines"], capture_output=True, text=True, timeout=60,
                          env={**env, "KVGEN_SGLANG_VENV": str(venv), "KVGEN_SGLANG_BASE": str(base)})
    assert done.returncode == 0, (done.stdout, done.stderr)
    calls = log.read_text().splitlines()
    assert f"base -m venv --without-pip {venv}" in calls, calls
    assert not (old_site / "pip").exists() and (venv / "bin" / "python").read_text() == new.read_text()
    installs = [c for c in calls if "pip install" in c]
    assert installs and all(c.startswith("new ") for c in installs), calls
    assert any(c.startswith("new -m pytest") and "tests/test_engine_sglang" in c for c in calls), calls
    assert (new_site / "kvgen-sglang-base.pth").is_file()


def test_a_whole_test_run_runs_the_sglang_tests_beside_the_parallel_pass_and_fails_with_them(tmp_path: Path) -> None:
    """With SGLang's venv in place, its engine tests run in the background beside the parallel
    pass and are joined before the serial pass; when they fail, the run fails with their output."""
    log = tmp_path / "calls"
    # the set-up check passes; the tests fail
    done = _whole_test_run(tmp_path, f'#!/bin/sh\ncase "$*" in *"-m pytest"*) echo "sglang $*" >> {log};'
                           ' echo "2 failed in SGLang"; exit 1;; esac\nexit 0\n')
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "2 failed in SGLang" in done.stdout and "SGLang engine tests failed" in done.stderr, done
    calls = [c for c in log.read_text().splitlines() if "-m pytest" in c]
    sglang = next(i for i, c in enumerate(calls) if c.startswith("sglang "))
    serial = calls.index("-m pytest -q -o hang_dump_after=600 -m serial")
    assert "tests/test_engine_sglang" in calls[sglang] and sglang < serial, calls


# -- set-up reads what is installed from package metadata (scripts/installed.py) -------------------


def _dist(site: Path, name: str, version: str, requires: tuple[str, ...] = (), url: str | None = None) -> Path:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"  # as wheels name it
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("\n".join(lines) + "\n")
    if url is not None:
        (info / "direct_url.json").write_text(f'{{"dir_info": {{"editable": true}}, "url": "{url}"}}')
    return info


def _installed(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "installed.py"), *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(site)})


def test_set_up_finds_kvgen_installed_from_this_checkout_by_its_metadata(tmp_path: Path) -> None:
    """kvgen counts as set up only when installed editable from this checkout after pyproject.toml
    last changed, with the requirements of the extra asked for; anything else says what to do."""
    checkout, site = tmp_path / "checkout", tmp_path / "site"
    checkout.mkdir()
    (checkout / "pyproject.toml").write_text("[project]\n")
    os.utime(checkout / "pyproject.toml", (1_000_000, 1_000_000))
    requires = ("pytest>=1", 'no-such-package-kvgen>=1; extra == "extra"')
    _dist(site, "kvgen", "0.1.0", requires, checkout.resolve().as_uri())
    assert _installed(site, "kvgen", str(checkout), "").returncode == 0
    missing = _installed(site, "kvgen", str(checkout), "extra")
    assert missing.returncode == 1 and "no-such-package-kvgen is not installed" in missing.stderr
    other = _installed(site, "kvgen", str(tmp_path), "")
    assert other.returncode == 1 and "not editable from" in other.stderr
    (checkout / "pyproject.toml").touch()  # edited after the install
    assert "pyproject.toml changed" in _installed(site, "kvgen", str(checkout), "").stderr


def test_set_up_installs_kvgen_alone_where_its_requirements_are_met(tmp_path: Path) -> None:
    """Before an editable install, the checkout's own pyproject.toml says whether pip has any
    requirement left to install (else it installs kvgen with --no-deps)."""
    checkout, site = tmp_path / "checkout", tmp_path / "site"
    checkout.mkdir()
    (checkout / "pyproject.toml").write_text(
        '[project]\ndependencies = ["dep-kvgen-test>=1"]\n'
        '[project.optional-dependencies]\ntest = ["extra-kvgen-test==2.0"]\n')
    _dist(site, "dep-kvgen-test", "1.5")
    assert _installed(site, "requirements", str(checkout), "").returncode == 0
    missing = _installed(site, "requirements", str(checkout), "test")
    assert missing.returncode == 1 and "extra-kvgen-test is not installed" in missing.stderr
    _dist(site, "extra-kvgen-test", "2.1")
    other = _installed(site, "requirements", str(checkout), "test")
    assert other.returncode == 1 and "extra-kvgen-test 2.1 does not meet ==2.0" in other.stderr


def test_set_up_finds_pinned_packages_by_their_metadata(tmp_path: Path) -> None:
    site = tmp_path / "site"
    _dist(site, "engine-kvgen-test", "2.14.1+cu128")
    assert _installed(site, "pinned", "engine-kvgen-test==2.14.1", "pytest").returncode == 0
    assert _installed(site, "pinned", "engine-kvgen-test>=2.5").returncode == 0
    for wanted, said in [("engine-kvgen-test==2.14.0", "2.14.1+cu128 is installed, not 2.14.0"),
                         ("engine-kvgen-test>=2.15", "older than 2.15"), ("absent-kvgen-test", "not installed")]:
        done = _installed(site, "pinned", wanted)
        assert done.returncode == 1 and said in done.stderr, (wanted, done.stderr)
