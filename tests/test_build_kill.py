"""`kvgen build` under SIGKILL and concurrency: `--out` is always the complete old or the
complete new output, killed builds leave nothing that the next build does not clean up,
and concurrent builds of one folder take turns.

Kills are real SIGKILLs: a helper process imports kvgen once, then forks one child per build
(a fork costs milliseconds where a fresh interpreter costs half a second). Most kills are placed,
not timed: the child watches its own file-system changes through Python's audit hooks and kills
itself just before a chosen one, so every window between two changes is hit on every run,
however loaded the machine, and without hooks in the code under test. A few more land at times
spread over a write, one after another, each write starting on what the last kill left.
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
from pathlib import Path

import pytest

import kvgen.emit.build as kbuild
from kvgen.emit.build import build, check, recover, render, write_atomically
from kvgen.errors import BuildError
from kvgen.spec.library import BUILTIN_SPECS, REPO_ROOT

# The kills that assert where they land are placed, not timed, and the lock tests wait on the
# lock, not on a clock, so this file runs beside others.
pytestmark = pytest.mark.slow

HAVE_TRITON = importlib.util.find_spec("triton") is not None

Snapshot = dict[str, bytes]
_PACKAGES = itertools.count()

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
    """Two different complete outputs: the built-in library (A) and one with an extra layout (B), for
    the tests whose output must be the library's: `kvgen check` and the CLI's concurrent builds."""
    a, b = render(), render([extra_specs])
    assert set(a) < set(b) and a["__init__.py"] != b["__init__.py"]
    return {"A": a, "B": b}


@pytest.fixture(scope="module")
def small_outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    """Two different complete outputs of a small library (a few files, so that a write takes
    milliseconds and the kill tests can kill dozens): one layout and LMCache's object (A), and one
    more layout (B); every test of the write's own steps (lock, exchange, fallback, recovery) uses these."""
    outs = {}
    for which, names in (("A", ("vllm/flash_attn_nhd", "lmcache/kv_2ltd")),
                         ("B", ("vllm/flash_attn_nhd", "vllm/flash_attn_hnd", "lmcache/kv_2ltd"))):
        specs = tmp_path_factory.mktemp(f"small_{which}")
        for name in names:
            (specs / f"{Path(name).name}.yaml").write_text((BUILTIN_SPECS / f"{name}.yaml").read_text())
        outs[which] = render([specs], builtin=False)
    assert set(outs["A"]) < set(outs["B"]) and len(outs["A"]) >= 3
    return outs


def encoded(files: dict[str, str]) -> Snapshot:
    return {name: text.encode() for name, text in files.items()}


def snapshot(folder: Path) -> Snapshot | None:
    if not folder.is_dir():
        return None
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def leftovers(parent: Path, name: str) -> list[str]:
    """Everything a build keeps beside `out`: staging, backup and lock."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


def backups_of(out: Path) -> list[Path]:
    """The backups a fallback write killed between its renames left beside `out`."""
    return [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.old-")]


def import_package(folder: Path, monkeypatch: pytest.MonkeyPatch, layout: str, skip: Snapshot | None = None) -> None:
    """Import `folder` as a package under a fresh name, every module (but those byte for byte
    in `skip`), and make a connector."""
    package = f"kvgen_kill_{next(_PACKAGES)}"
    root = folder.parent / f"importroot_{package}"
    shutil.copytree(folder, root / package)
    monkeypatch.syspath_prepend(str(root))
    try:
        pkg = importlib.import_module(package)
        for path in sorted((root / package).glob("*.py")):
            if path.name == "__init__.py" or (skip and skip.get(path.name) == path.read_bytes()):
                continue
            # kernel modules import triton, an optional extra
            if HAVE_TRITON or not path.stem.endswith("_triton"):
                importlib.import_module(f"{package}.{path.stem}")
        assert pkg.connector(layout, "kv_2ltd", "cpu").layout.name == layout
    finally:
        for mod in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            del sys.modules[mod]
        shutil.rmtree(root)


# The helper reads lines "WHICH AT DELAY": it forks a child that writes output WHICH into OUT and
# prints how the child ended and how long it ran. With AT = k > 0 the child SIGKILLs itself just
# before the k-th operation of the write that changes the file system (an audit event, see
# _WRITES), with AT = 0 it writes the names of those operations to OUT's parent as events.json,
# and a DELAY >= 0 has the helper send it SIGKILL after that many seconds.
_HELPER = r"""
import json, os, signal, sys, time
from pathlib import Path
from kvgen.emit.build import write_atomically
out, outputs = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
CHANGES = {"os.mkdir", "os.rename", "os.remove", "os.rmdir", "shutil.rmtree", "fcntl.flock", "os.truncate"}

def changes(event, args):
    if event == "open":  # open(path, mode, flags): a write, a create or an append
        mode, flags = args[1], args[2]
        return any(c in (mode or "") for c in "wax+") or bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
    return event in CHANGES

def watch(at):
    seen = []
    def hook(event, args):
        if changes(event, args):
            seen.append(event)
            if len(seen) == at:
                os.kill(os.getpid(), signal.SIGKILL)
    sys.addaudithook(hook)
    return seen

print("ready", flush=True)
for line in sys.stdin:
    which, at, delay = line.split()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            seen = watch(int(at)) if at != "-" else []
            write_atomically(out, outputs[which])
            if at == "0":
                (out.parent / "events.json").write_text(json.dumps(seen))
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

    def __init__(self, out: Path, outputs: dict[str, dict[str, str]], no_exchange: bool, pause: float = 0) -> None:
        self.out = out
        data = out.parent / "outputs.json"
        data.write_text(json.dumps(outputs))
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        env.pop(kbuild.NO_EXCHANGE_HOOK, None)
        env.pop(kbuild.PAUSE_HOOK, None)
        if no_exchange:
            env[kbuild.NO_EXCHANGE_HOOK] = "1"
        if pause:
            env[kbuild.PAUSE_HOOK] = str(pause)
        self.proc = subprocess.Popen([sys.executable, "-c", _HELPER, str(out), str(data)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        assert self.readline() == "ready"

    def readline(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        assert line, f"helper died (rc {self.proc.poll()})"
        return line

    def run(self, which: str, at: int | None = None, delay: float = -1) -> tuple[str, float]:
        """How a write of `which` ended ("killed", "exit0", ...) and its seconds: killed before
        its `at`-th change of the file system, or after `delay` seconds, or neither."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{which} {'-' if at is None else at} {delay}\n")
        self.proc.stdin.flush()
        ended, seconds = self.readline().split()
        return ended, float(seconds)

    def events(self, which: str) -> list[str]:
        """The file-system changes of a whole write of `which`, in order (`which` is then in place)."""
        assert self.run(which, 0)[0] == "exit0"
        return json.loads((self.out.parent / "events.json").read_text())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(timeout=30) == 0


def kill_points(events: list[str]) -> list[int]:
    """Where to kill a write whose file-system changes are `events` (1-based: before that
    change): before every change that is one of a kind, and before the first, a middle and the
    last of each run of one kind (the files written into staging, the old output's files deleted),
    and after the last."""
    points: set[int] = {len(events) + 1}
    i = 0
    while i < len(events):
        j = i
        while j + 1 < len(events) and events[j + 1] == events[i]:
            j += 1
        points.update({i + 1, (i + j) // 2 + 1, j + 1})
        i = j + 1
    return sorted(points)


#: What a kill leaves, in the order a write passes through them: the old output, no output but
#: the old one in a backup (the fallback, between its two renames), the new output.
OLD, ASIDE, NEW = "old", "aside", "new"


def kill_everywhere(out: Path, outputs: dict[str, dict[str, str]], *, no_exchange: bool) -> dict[str, list[str]]:
    """Write B over A and A over B, killed before each of their file-system changes that
    kill_points picks, the earlier kill's debris cleared by `recover` first. After each kill
    `out` is the complete old or new output (or, in the fallback, missing with the old one in
    its backup, which `recover` puts back). Returns what each transition's kills left, in order."""
    snaps = {k: encoded(v) for k, v in outputs.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    killer = Killer(out, outputs, no_exchange=no_exchange)
    left: dict[str, list[str]] = {}
    try:
        for current, target in (("A", "B"), ("B", "A")):
            write_atomically(out, outputs[current])
            events = killer.events(target)
            killer.events(current)
            left[target] = []
            for at in kill_points(events):
                ended, _ = killer.run(target, at)
                assert ended == ("exit0" if at > len(events) else "killed"), (target, at, ended)
                state = snapshot(out)
                if state is None:
                    backups = backups_of(out)
                    assert len(backups) == 1 and snapshot(backups[0]) == snaps[current], (target, at, events[at - 1])
                    left[target].append(ASIDE)
                else:
                    assert state in (snaps[current], snaps[target]), f"killed before change {at}: neither output"
                    left[target].append(NEW if state == snaps[target] else OLD)
                recover(out)
                assert leftovers(out.parent, out.name) == [], "recover must clean what a killed write left"
                if snapshot(out) == snaps[target]:
                    write_atomically(out, outputs[current])
    finally:
        killer.close()
    return left


def kill_at_random(out: Path, outputs: dict[str, dict[str, str]], *, no_exchange: bool, kills: int = 12) -> None:
    """Writes killed one after another at points spread over a whole write's time, each write
    starting on the debris the last kill left. Each kill must leave the old or the new output
    (in the fallback, perhaps only the old one in a backup); where the kills land depends on
    the machine's load, so which windows they hit is not asserted (kill_everywhere is)."""
    snaps = {k: encoded(v) for k, v in outputs.items()}
    write_atomically(out, outputs["A"])
    killer = Killer(out, outputs, no_exchange=no_exchange)
    try:
        span = sorted(killer.run(which)[1] for which in "BAB")[1]
        current = "B"
        for i in range(kills):
            target = "A" if current == "B" else "B"
            killer.run(target, delay=span * (i + 0.5) / kills)
            state = snapshot(out)
            if state is None:
                assert no_exchange, f"kill {i}: --out is missing"
                backups = backups_of(out)
                assert len(backups) == 1 and snapshot(backups[0]) == snaps[current], f"kill {i}"
                if i % 2:
                    recover(out)  # else the next write recovers it itself
                continue
            assert state in (snaps[current], snaps[target]), f"kill {i}: --out is neither old nor new output"
            current = target if state == snaps[target] else current
        assert killer.run("A")[0] == "exit0"
    finally:
        killer.close()
    assert snapshot(out) == snaps["A"]
    assert leftovers(out.parent, out.name) == [], "a normal write must clean what killed writes left"


def in_order(left: list[str]) -> bool:
    """The kills of one write left the old output first, then (the fallback) its backup, then the new one."""
    rank = {OLD: 0, ASIDE: 1, NEW: 2}
    return [rank[x] for x in left] == sorted(rank[x] for x in left)


def test_both_outputs_import(outputs: dict[str, dict[str, str]], small_outputs: dict[str, dict[str, str]],
                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The outputs the kill and lock tests compare against are complete, importable packages, so
    a folder equal to one of them byte for byte is too. (The library's modules that equal the
    committed generated/ are left out: the rest of the suite imports those.)"""
    committed = {p.name: p.read_bytes() for p in (REPO_ROOT / "generated").glob("*.py")}
    for which, files, layout, skip in (("A", outputs["A"], "vllm_flash_attn_nhd", committed),
                                       ("B", outputs["B"], "my_layout", committed),
                                       ("small_A", small_outputs["A"], "vllm_flash_attn_nhd", None),
                                       ("small_B", small_outputs["B"], "vllm_flash_attn_hnd", None)):
        write_atomically(tmp_path / which, files)
        import_package(tmp_path / which, monkeypatch, layout, skip)


def test_sigkill_at_any_point_leaves_old_or_new_output(small_outputs: dict[str, dict[str, str]],
                                                       tmp_path: Path) -> None:
    for target, left in kill_everywhere(tmp_path / "generated", small_outputs, no_exchange=False).items():
        assert in_order(left) and OLD in left and NEW in left and ASIDE not in left, (target, left)
    kill_at_random(tmp_path / "timed" / "generated", small_outputs, no_exchange=False)


def test_sigkill_without_exchange_is_recovered(small_outputs: dict[str, dict[str, str]], tmp_path: Path) -> None:
    """Where the folders cannot be exchanged in one step, a kill between the two renames
    leaves the old output in a backup, and the next build, check or recover puts it back."""
    for target, left in kill_everywhere(tmp_path / "generated", small_outputs, no_exchange=True).items():
        assert in_order(left) and {OLD, ASIDE, NEW} <= set(left), (target, left)
    kill_at_random(tmp_path / "timed" / "generated", small_outputs, no_exchange=True)


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


def test_second_build_waits_for_the_lock(small_outputs: dict[str, dict[str, str]], tmp_path: Path) -> None:
    out = tmp_path / "generated"
    write_atomically(out, small_outputs["A"])
    lock = tmp_path / ".generated.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        done = threading.Event()
        errors: list[BaseException] = []

        def other() -> None:
            try:
                write_atomically(out, small_outputs["B"])
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)
            done.set()

        thread = threading.Thread(target=other)
        thread.start()
        time.sleep(0.3)
        assert not done.is_set(), "a build ran while another held the lock"
        assert snapshot(out) == encoded(small_outputs["A"])
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".generated.new-")] == []
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    thread.join(timeout=30)
    assert done.is_set() and not errors, errors
    assert snapshot(out) == encoded(small_outputs["B"])
    assert leftovers(tmp_path, "generated") == []


def test_lock_file_lives_beside_out_and_is_removed(small_outputs: dict[str, dict[str, str]], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "generated"
    seen: list[list[str]] = []
    real = kbuild._swap

    def spy(staging: Path, target: Path) -> Path | None:
        seen.append(leftovers(tmp_path, "generated"))
        assert not any(p.name.endswith(".lock") for p in staging.iterdir())
        return real(staging, target)

    monkeypatch.setattr(kbuild, "_swap", spy)
    write_atomically(out, small_outputs["A"])
    write_atomically(out, small_outputs["A"])
    assert [n for n in seen[0] if not n.startswith(".generated.new-")] == [".generated.lock"]
    assert sorted(p.name for p in out.iterdir()) == sorted(small_outputs["A"])
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


def test_recover_drops_backup_when_the_new_output_is_in_place(small_outputs: dict[str, dict[str, str]],
                                                              tmp_path: Path) -> None:
    out = tmp_path / "generated"
    backup = killed_between_renames(out, small_outputs["A"])
    write_atomically(tmp_path / "scratch", small_outputs["B"])
    os.rename(tmp_path / "scratch", out)  # killed after the second rename, before the clean-up
    shutil.copytree(out, backup.with_name(".generated.old-0000000000000000000-1"))
    recover(out)
    assert snapshot(out) == encoded(small_outputs["B"])
    assert leftovers(tmp_path, "generated") == []


def no_exchange(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kbuild.NO_EXCHANGE_HOOK, "1")


@pytest.mark.parametrize("mode", ["exchange", "fallback"])
def test_failed_second_rename_keeps_previous_output(mode: str, small_outputs: dict[str, dict[str, str]], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """An OSError while moving the new output in (not a kill) leaves the old output, a
    BuildError and no debris."""
    out = tmp_path / "generated"
    write_atomically(out, small_outputs["A"])
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
        write_atomically(out, small_outputs["B"])
    monkeypatch.undo()
    assert snapshot(out) == encoded(small_outputs["A"])
    assert leftovers(tmp_path, "generated") == []


@pytest.mark.parametrize("code", ["EINVAL", "ENOSYS", "missing"])
def test_exchange_refused_falls_back(code: str, small_outputs: dict[str, dict[str, str]], tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem that refuses RENAME_EXCHANGE (EINVAL), a kernel without renameat2 (ENOSYS)
    or no way to call it: the build still replaces the output, through the fallback."""
    import errno

    out = tmp_path / "generated"
    write_atomically(out, small_outputs["A"])
    calls: list[bytes] = []

    def refusing(a: bytes, b: bytes, flags: int) -> int:
        calls.append(a)
        return getattr(errno, code)

    monkeypatch.setattr(kbuild, "_renameat2", lambda: None if code == "missing" else refusing)
    write_atomically(out, small_outputs["B"])
    assert snapshot(out) == encoded(small_outputs["B"])
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


def test_out_that_is_a_file_is_refused(small_outputs: dict[str, dict[str, str]], tmp_path: Path) -> None:
    out = tmp_path / "generated"
    out.write_text("not a folder")
    with pytest.raises(BuildError, match="not a folder"):
        write_atomically(out, small_outputs["A"])
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
