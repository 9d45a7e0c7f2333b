"""`kvgen build` under SIGKILL and concurrency: `--out` is always the complete old or the
complete new output, killed builds leave nothing that the next build does not clean up,
and concurrent builds of one folder take turns.

Kills are real: a helper process imports kvgen once, then forks one child per build and
sends it SIGKILL after a chosen delay (a fork costs milliseconds where a fresh interpreter
costs half a second, so 30+ kills stay cheap). The test hook KVGEN_TESTHOOK_BUILD_PAUSE
makes the build sleep at each step so the kills land in every window between steps.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

import kvgen.emit.build as kbuild
from kvgen.emit.build import build, check, recover, render, write_atomically
from kvgen.errors import BuildError
from kvgen.spec.library import BUILTIN_SPECS, REPO_ROOT

# Kills at timed points and lock waits: run alone (conftest.py).
pytestmark = pytest.mark.serial

HAVE_TRITON = importlib.util.find_spec("triton") is not None

Snapshot = dict[str, bytes]
_PACKAGES = itertools.count()
KILLS = 32

fcntl = pytest.importorskip("fcntl")


@pytest.fixture(scope="module")
def extra_specs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A spec folder with one more layout."""
    specs = tmp_path_factory.mktemp("specs")
    source = (BUILTIN_SPECS / "vllm/flash_attn_nhd.yaml").read_text()
    mine = (source.replace("name: vllm_flash_attn_nhd", "name: my_layout").replace("aliases: [NHD]\n", "")
            .replace("engines: [vllm/FLASH_ATTN]\n", "").replace('versions: {vllm: "<0.33"}\n', ""))
    (specs / "mine.yaml").write_text(mine)
    return specs


@pytest.fixture(scope="module")
def outputs(extra_specs: Path) -> dict[str, dict[str, str]]:
    """Two different complete outputs: the built-in library (A) and one with an extra layout (B)."""
    a, b = render(), render([extra_specs])
    assert set(a) < set(b) and a["__init__.py"] != b["__init__.py"]
    return {"A": a, "B": b}


def encoded(files: dict[str, str]) -> Snapshot:
    return {name: text.encode() for name, text in files.items()}


def snapshot(folder: Path) -> Snapshot | None:
    if not folder.is_dir():
        return None
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def leftovers(parent: Path, name: str) -> list[str]:
    """Everything a build keeps beside `out`: staging, backup and lock."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


def import_package(folder: Path, monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    """Import `folder` as a package under a fresh name, every module, and make a connector."""
    package = f"kvgen_kill_{next(_PACKAGES)}"
    root = folder.parent / f"importroot_{package}"
    shutil.copytree(folder, root / package)
    monkeypatch.syspath_prepend(str(root))
    try:
        pkg = importlib.import_module(package)
        for path in sorted((root / package).glob("*.py")):
            # kernel modules import triton, an optional extra
            if path.name != "__init__.py" and (HAVE_TRITON or not path.stem.endswith("_triton")):
                importlib.import_module(f"{package}.{path.stem}")
        assert pkg.connector(layout, "kv_2ltd", "cpu").layout.name == layout
    finally:
        for mod in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            del sys.modules[mod]
        shutil.rmtree(root)


# The helper reads lines "WHICH DELAY": it forks a child that writes output WHICH into OUT,
# sends it SIGKILL after DELAY seconds (a negative delay lets it finish) and prints how the
# child ended and how long it ran.
_HELPER = r"""
import json, os, signal, sys, time
from pathlib import Path
from kvgen.emit.build import write_atomically
out, outputs = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
print("ready", flush=True)
for line in sys.stdin:
    which, delay = line.split()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            write_atomically(out, outputs[which])
        except BaseException as exc:
            print(f"child failed: {exc!r}", file=sys.stderr, flush=True)
            code = 3
        os._exit(code)
    if float(delay) >= 0:
        time.sleep(float(delay))
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    ended = "killed" if os.WIFSIGNALED(status) else f"exit{os.WEXITSTATUS(status)}"
    print(ended, time.monotonic() - start, flush=True)
"""


class Killer:
    """The fork-and-kill helper process."""

    def __init__(self, out: Path, outputs: dict[str, dict[str, str]], pause: float, no_exchange: bool) -> None:
        data = out.parent / "outputs.json"
        data.write_text(json.dumps(outputs))
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), kbuild.PAUSE_HOOK: str(pause)}
        env.pop(kbuild.NO_EXCHANGE_HOOK, None)
        if no_exchange:
            env[kbuild.NO_EXCHANGE_HOOK] = "1"
        self.proc = subprocess.Popen([sys.executable, "-c", _HELPER, str(out), str(data)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        assert self.readline() == "ready"

    def readline(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        assert line, f"helper died (rc {self.proc.poll()})"
        return line

    def run(self, which: str, delay: float) -> tuple[str, float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{which} {delay}\n")
        self.proc.stdin.flush()
        ended, seconds = self.readline().split()
        return ended, float(seconds)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(timeout=30) == 0


def kill_many(out: Path, outputs: dict[str, dict[str, str]], *, no_exchange: bool, stretch: float = 1.0
              ) -> Counter[str]:
    """Alternate builds of A and B into `out`, killing each at a different point over `stretch`
    times a whole build's time; after every kill `out` (or, in the fallback, the backup that
    recovery restores) is the complete old or the complete new output. Returns what was seen:
    "new" and "old" count the builds that were killed, "exit0" those that ended first."""
    snaps = {k: encoded(v) for k, v in outputs.items()}
    write_atomically(out, outputs["A"])
    # Each step of a build waits this long, so every window (between the renames, after the
    # swap) stays a sizeable share of a build however many files the library writes.
    killer = Killer(out, outputs, pause=0.03, no_exchange=no_exchange)
    seen: Counter[str] = Counter()
    try:
        spans = []
        for which in "BAB":  # whole builds: how long the kills have to land in
            ended, seconds = killer.run(which, -1)
            assert ended == "exit0" and snapshot(out) == snaps[which]
            spans.append(seconds)
        span = sorted(spans)[1]
        current = "B"
        for i in range(KILLS):
            target = "A" if current == "B" else "B"
            ended, _ = killer.run(target, stretch * span * (i + 0.5) / KILLS)  # over the whole build
            seen[ended] += 1
            state = snapshot(out)
            if state is None:
                # only the fallback may leave `out` missing, and only with the old output
                # complete in one backup, which the next build, check or recover restores
                assert no_exchange, f"kill {i}: --out is missing"
                backups = [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.old-")]
                assert len(backups) == 1 and snapshot(backups[0]) == snaps[current], f"kill {i}"
                seen["missing"] += 1
                if i % 2:
                    recover(out)  # else the next build recovers it itself
                    state = snapshot(out)
                else:
                    continue
            assert state in (snaps[current], snaps[target]), f"kill {i}: --out is neither old nor new output"
            if ended == "killed":
                seen["new" if state == snaps[target] else "old"] += 1
            seen["stale"] += bool([n for n in leftovers(out.parent, out.name) if not n.endswith(".lock")])
            current = target if state == snaps[target] else current
        ended, _ = killer.run("A", -1)
        assert ended == "exit0"
    finally:
        killer.close()
    assert snapshot(out) == snaps["A"]
    assert leftovers(out.parent, out.name) == [], "a normal build must clean what killed builds left"
    return seen


def test_both_outputs_import(outputs: dict[str, dict[str, str]], tmp_path: Path,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The two outputs the kill tests compare against are complete, importable packages, so a
    folder equal to one of them byte for byte is too."""
    for which, layout in (("A", "vllm_flash_attn_nhd"), ("B", "my_layout")):
        write_atomically(tmp_path / which, outputs[which])
        import_package(tmp_path / which, monkeypatch, layout)


def kill_rounds(out: Path, outputs: dict[str, dict[str, str]], *, no_exchange: bool,
                enough: Callable[[Counter[str]], bool], rounds: int = 3) -> Counter[str]:
    """kill_many until the kills have landed at every point `enough` asks for. Where a kill
    lands depends on the machine's load (a build killed mid-way may run slower than the whole
    builds it was timed by), so a busy machine may need another round, each spread a quarter
    further past the timed build; every kill of every round must leave the old or the new output."""
    seen: Counter[str] = Counter()
    for k in range(rounds):
        seen += kill_many(out, outputs, no_exchange=no_exchange, stretch=1.0 + 0.25 * k)
        if enough(seen):
            break
    return seen


def test_sigkill_at_any_point_leaves_old_or_new_output(outputs: dict[str, dict[str, str]], tmp_path: Path) -> None:
    def enough(seen: Counter[str]) -> bool:
        # the kills did land inside builds, before and after the swap, and left debris to clean
        return seen["killed"] >= KILLS // 2 and seen["old"] >= 3 and seen["new"] >= 3 and seen["stale"] >= 3

    seen = kill_rounds(tmp_path / "generated", outputs, no_exchange=False, enough=enough)
    assert enough(seen), seen
    assert seen["missing"] == 0


def test_sigkill_without_exchange_is_recovered(outputs: dict[str, dict[str, str]], tmp_path: Path) -> None:
    """Where the folders cannot be exchanged in one step, a kill between the two renames
    leaves the old output in a backup, and the next build, check or recover puts it back."""
    def enough(seen: Counter[str]) -> bool:
        return seen["killed"] >= KILLS // 2 and seen["old"] >= 3 and seen["new"] >= 3 and seen["missing"] >= 1

    seen = kill_rounds(tmp_path / "generated", outputs, no_exchange=True, enough=enough)
    assert enough(seen), f"kills did not land at every point (between the renames: 'missing'): {seen}"


def test_concurrent_cli_builds_take_turns(outputs: dict[str, dict[str, str]], extra_specs: Path,
                                          tmp_path: Path) -> None:
    """Three `kvgen build` processes into one --out: each exits 0 and the result is complete."""
    out = tmp_path / "generated"
    build(out)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), kbuild.PAUSE_HOOK: "0.02"}
    args = [[], ["--specs", str(extra_specs)], []]
    procs = [subprocess.Popen([sys.executable, "-m", "kvgen.tools.cli", "build", "--out", str(out), *extra],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for extra in args]
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "Traceback" not in stderr, stderr
    assert snapshot(out) in (encoded(outputs["A"]), encoded(outputs["B"]))
    assert leftovers(tmp_path, "generated") == []


def test_second_build_waits_for_the_lock(outputs: dict[str, dict[str, str]], tmp_path: Path) -> None:
    out = tmp_path / "generated"
    write_atomically(out, outputs["A"])
    lock = tmp_path / ".generated.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        done = threading.Event()
        errors: list[BaseException] = []

        def other() -> None:
            try:
                write_atomically(out, outputs["B"])
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)
            done.set()

        thread = threading.Thread(target=other)
        thread.start()
        time.sleep(0.3)
        assert not done.is_set(), "a build ran while another held the lock"
        assert snapshot(out) == encoded(outputs["A"])
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".generated.new-")] == []
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    thread.join(timeout=30)
    assert done.is_set() and not errors, errors
    assert snapshot(out) == encoded(outputs["B"])
    assert leftovers(tmp_path, "generated") == []


def test_lock_file_lives_beside_out_and_is_removed(outputs: dict[str, dict[str, str]], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "generated"
    seen: list[list[str]] = []
    real = kbuild._swap

    def spy(staging: Path, target: Path) -> Path | None:
        seen.append(leftovers(tmp_path, "generated"))
        assert not any(p.name.endswith(".lock") for p in staging.iterdir())
        return real(staging, target)

    monkeypatch.setattr(kbuild, "_swap", spy)
    write_atomically(out, outputs["A"])
    write_atomically(out, outputs["A"])
    assert [n for n in seen[0] if not n.startswith(".generated.new-")] == [".generated.lock"]
    assert sorted(p.name for p in out.iterdir()) == sorted(outputs["A"])
    assert leftovers(tmp_path, "generated") == []


# -- the recovery step and the fallback, forced ------------------------------------------------


def killed_between_renames(out: Path, old: dict[str, str]) -> Path:
    """The state a fallback build killed between its two renames leaves: no `out`, the old
    output in a backup, a complete staging folder and a stale lock file."""
    write_atomically(out, old)
    backup = out.parent / f".{out.name}.old-0000000000000000001-99999"
    os.rename(out, backup)
    staging = out.parent / f".{out.name}.new-99999-deadbeef"
    staging.mkdir()
    (staging / "__init__.py").write_text("# half written\n")
    (out.parent / f".{out.name}.lock").touch()
    return backup


def test_check_and_build_restore_a_backup_left_by_a_kill(outputs: dict[str, dict[str, str]],
                                                         tmp_path: Path) -> None:
    out = tmp_path / "generated"
    killed_between_renames(out, outputs["A"])
    assert check(out).ok, "check must restore the output a killed build had moved aside"
    assert snapshot(out) == encoded(outputs["A"])
    assert leftovers(tmp_path, "generated") == []

    killed_between_renames(out, outputs["B"])
    write_atomically(out, outputs["A"])
    assert snapshot(out) == encoded(outputs["A"])
    assert leftovers(tmp_path, "generated") == []


def test_recover_drops_backup_when_the_new_output_is_in_place(outputs: dict[str, dict[str, str]],
                                                              tmp_path: Path) -> None:
    out = tmp_path / "generated"
    backup = killed_between_renames(out, outputs["A"])
    write_atomically(tmp_path / "scratch", outputs["B"])
    os.rename(tmp_path / "scratch", out)  # killed after the second rename, before the clean-up
    shutil.copytree(out, backup.with_name(".generated.old-0000000000000000000-1"))
    recover(out)
    assert snapshot(out) == encoded(outputs["B"])
    assert leftovers(tmp_path, "generated") == []


def no_exchange(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kbuild.NO_EXCHANGE_HOOK, "1")


@pytest.mark.parametrize("mode", ["exchange", "fallback"])
def test_failed_second_rename_keeps_previous_output(mode: str, outputs: dict[str, dict[str, str]], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """An OSError while moving the new output in (not a kill) leaves the old output, a
    BuildError and no debris."""
    out = tmp_path / "generated"
    write_atomically(out, outputs["A"])
    if mode == "fallback":
        no_exchange(monkeypatch)
    real_rename = os.rename

    def flaky(src: object, dst: object) -> None:
        if Path(str(src)).name.startswith(".generated.new-"):
            raise OSError(18, "Invalid cross-device link")
        real_rename(src, dst)  # type: ignore[arg-type]

    def refused(a: bytes, b: bytes, flags: int) -> int:
        return 18  # EXDEV

    monkeypatch.setattr(kbuild.os, "rename", flaky)
    monkeypatch.setattr(kbuild, "_renameat2", lambda: refused)
    with pytest.raises(BuildError, match="cross-device"):
        write_atomically(out, outputs["B"])
    monkeypatch.undo()
    assert snapshot(out) == encoded(outputs["A"])
    assert leftovers(tmp_path, "generated") == []


@pytest.mark.parametrize("code", ["EINVAL", "ENOSYS", "missing"])
def test_exchange_refused_falls_back(code: str, outputs: dict[str, dict[str, str]], tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem that refuses RENAME_EXCHANGE (EINVAL), a kernel without renameat2 (ENOSYS)
    or no way to call it: the build still replaces the output, through the fallback."""
    import errno

    out = tmp_path / "generated"
    write_atomically(out, outputs["A"])
    calls: list[bytes] = []

    def refusing(a: bytes, b: bytes, flags: int) -> int:
        calls.append(a)
        return getattr(errno, code)

    monkeypatch.setattr(kbuild, "_renameat2", lambda: None if code == "missing" else refusing)
    write_atomically(out, outputs["B"])
    assert snapshot(out) == encoded(outputs["B"])
    assert leftovers(tmp_path, "generated") == []
    assert len(calls) == (0 if code == "missing" else 1)


def test_exchange_through_raw_syscall(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where libc has no renameat2 wrapper, the exchange goes through syscall(2)."""
    if kbuild._syscall_number() is None:
        pytest.skip("renameat2's number is not known for this machine")
    monkeypatch.setattr(kbuild, "_LIBC_WRAPPER", "no_such_function")
    monkeypatch.setattr(kbuild, "_renameat2_cached", None)
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    (first / "one").write_text("1")
    (second / "two").write_text("2")
    assert kbuild._exchange(first, second)
    assert [p.name for p in first.iterdir()] == ["two"] and [p.name for p in second.iterdir()] == ["one"]


def test_out_that_is_a_file_is_refused(outputs: dict[str, dict[str, str]], tmp_path: Path) -> None:
    out = tmp_path / "generated"
    out.write_text("not a folder")
    with pytest.raises(BuildError, match="not a folder"):
        write_atomically(out, outputs["A"])
    assert out.read_text() == "not a folder"
    assert leftovers(tmp_path, "generated") == []


def test_cli_build_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A file where the output folder should be: `kvgen: message`, exit 1, no traceback."""
    from kvgen.tools.cli import main

    out = tmp_path / "generated"
    out.write_text("a file where the folder should be")
    assert main(["build", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvgen: ") and "not a folder" in err and "Traceback" not in err


def test_lock_that_cannot_be_created(outputs: dict[str, dict[str, str]], tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A build refuses with BuildError and leaves the output; a check of a read-only place still runs."""
    out = tmp_path / "generated"
    write_atomically(out, outputs["A"])
    real_open = os.open

    def refuse_lock(path: object, *args: object, **kwargs: object) -> int:
        if str(path).endswith(".lock"):
            raise PermissionError(13, "Permission denied")
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(kbuild.os, "open", refuse_lock)
    with pytest.raises(BuildError, match="cannot create lock file .*Permission denied"):
        write_atomically(out, outputs["B"])
    assert check(out).ok
    monkeypatch.undo()
    assert snapshot(out) == encoded(outputs["A"])
    assert leftovers(tmp_path, "generated") == []
