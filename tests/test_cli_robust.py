"""No traceback from the command line: every command with its output pipe closed early
(as `kvgen list | head -1` does), each in its own process, and with bad arguments (each through
cli.main, two samples in their own process)."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(argv: list[str], cwd: Path, *, closed_stdout: bool) -> subprocess.CompletedProcess[str]:
    """Run `python -m kvgen ARGV`; with closed_stdout, the reader of its stdout is gone before
    it writes, so every write meets a broken pipe, as with `| head -1` on a longer output."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if not closed_stdout:
        return subprocess.run([sys.executable, "-m", "kvgen", *argv], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=120)
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "kvgen", *argv], cwd=cwd, env=env, stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    return proc


def _specs(tmp: Path) -> Path:
    specs = tmp / "myspecs"
    specs.mkdir()
    (specs / "mine.yaml").write_text(
        "kvgen: 1\nname: my_layout\nkind: paged\nsummary: x\nlists: [L]\ndims: [KV, B, N, H, C]\nsizes: {KV: 2}\n")
    return specs


PIPED = [
    ["build", "--out", "{tmp}/out"],
    ["check"],
    ["validate", "{root}/specs"],
    ["list"],
    ["list", "--json"],
    ["explain", "nhd"],
    ["verify", "--only", "vllm_flash_attn_nhd__kv_2ltd"],
    ["bench", "--help"],
    ["--help"],
]

BAD = [
    ["build", "--specs", "{tmp}/nonexist", "--out", "{tmp}/out2"],
    ["build", "--out", "{tmp}/afile/out"],
    ["check", "--specs", "{tmp}/nonexist"],
    ["validate", "{tmp}/nonexist.yaml"],
    ["validate", "{tmp}/afile"],
    ["list", "--specs", "{tmp}/nonexist"],
    ["list", "--json", "--specs", "{tmp}/afile"],
    ["explain", "no_such_layout"],
    ["explain"],
    ["explain", "--tp", "3:8", "nhd"],
    ["explain", "--tp", "two:8", "nhd"],
    ["explain", "--tp", "2:4", "kv_2ltd"],
    ["verify", "--out", "{tmp}/nonexist"],
    ["verify", "--out", "{tmp}/afile"],
    ["verify", "--out", "{tmp}", "--only", "x"],
    ["verify", "--specs", "{tmp}/nonexist"],
    ["bench", "--tokens", "abc"],
    ["pd", "--src", "no_such_layout", "--dst", "nhd"],
    ["pd", "--src", "nhd:tp=3", "--dst", "hnd"],
    ["pd", "--src", "nhd:tp=x", "--dst", "hnd"],
    ["no_such_command"],
]


def _fill(argv: list[str], tmp: Path) -> list[str]:
    return [a.format(tmp=tmp, root=ROOT) for a in argv]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("robust")
    (tmp / "afile").write_text("not a folder\n")
    _specs(tmp)
    return tmp


def _all(jobs: list[list[str]], tmp: Path, closed: bool) -> list[tuple[list[str], subprocess.CompletedProcess[str]]]:
    with ThreadPoolExecutor(max_workers=2) as pool:
        procs = list(pool.map(lambda a: _run(_fill(a, tmp), tmp, closed_stdout=closed), jobs))
    return list(zip(jobs, procs, strict=True))


def _closed_stdout_problems(argv: list[str], status: int, stderr: str) -> list[str]:
    """What is wrong with how `kvgen ARGV` met a closed stdout; empty when it exits quietly."""
    problems = []
    if "Traceback" in stderr or "BrokenPipeError" in stderr or "Exception ignored" in stderr:
        problems.append(f"{argv}: traceback or ignored exception: {stderr}")
    # Like a C tool killed by SIGPIPE, the shell sees 128 + 13; argparse itself drops a
    # help text longer than the output buffer that meets a closed pipe, and exits 0.
    if status not in ((0, 141) if "--help" in argv else (141,)):
        problems.append(f"{argv}: exit {status}: {stderr}")
    return problems


def _in_process_closed(argv: list[str], tmp: Path, monkeypatch: pytest.MonkeyPatch,
                       capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`kvgen ARGV` through cli.main with sys.stdout on a pipe whose reader is gone: (status, stderr)."""
    read, write = os.pipe()
    os.close(read)
    stream = open(write, "w", closefd=False)  # noqa: SIM115 - closed below, after main has met the pipe
    monkeypatch.setattr(sys, "stdout", stream)
    try:
        status, _, err = _in_process(argv, tmp, monkeypatch, capsys)
    finally:
        monkeypatch.undo()
        try:
            stream.close()
        except BrokenPipeError:
            pass
        os.close(write)
    return status, err


def test_closed_stdout_never_shows_a_traceback(tmp: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Every command, through cli.main, writing to a closed pipe."""
    problems = []
    for argv in PIPED:
        problems += _closed_stdout_problems(argv, *_in_process_closed(argv, tmp, monkeypatch, capsys))
    assert not problems, "\n".join(problems)


# The process-level wiring (nothing left for the interpreter's last flush to complain about,
# the status the shell sees): a command's output and argparse's own help text.
PIPED_IN_A_PROCESS = [["list"], ["--help"]]


def test_closed_stdout_quiet_in_a_process(tmp: Path) -> None:
    problems = []
    for argv, proc in _all(PIPED_IN_A_PROCESS, tmp, closed=True):
        problems += _closed_stdout_problems(argv, proc.returncode, proc.stderr)
    assert not problems, "\n".join(problems)


def _in_process(argv: list[str], tmp: Path, monkeypatch: pytest.MonkeyPatch,
                capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """`kvgen ARGV` run by cli.main in this interpreter, from tmp: (exit status, stdout, stderr);
    an argparse usage error leaves main as SystemExit, which the interpreter turns into the status."""
    from kvgen.tools import cli

    monkeypatch.chdir(tmp)
    try:
        status = cli.main(_fill(argv, tmp))
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return status, out, err


def _bad_input_problems(argv: list[str], status: int, stdout: str, stderr: str) -> list[str]:
    """What is wrong with how `kvgen ARGV` refused bad input; empty when it is a message and a failure."""
    problems = []
    if "Traceback" in stderr:
        problems.append(f"{argv}: traceback: {stderr}")
    if status == 0:
        problems.append(f"{argv}: exit 0: {stdout} {stderr}")
    if not stderr.strip():
        problems.append(f"{argv}: nothing on stderr")
    elif not (stderr.strip().splitlines()[-1].startswith(("kvgen", "usage:")) or ": error:" in stderr):
        problems.append(f"{argv}: last line is not kvgen's message: {stderr}")
    return problems


def test_bad_input_is_a_message_and_a_failure(tmp: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Every bad input, through cli.main: a message on stderr and a failing status."""
    problems = []
    for argv in BAD:
        problems += _bad_input_problems(argv, *_in_process(argv, tmp, monkeypatch, capsys))
    assert not problems, "\n".join(problems)


# The process-level wiring (python -m kvgen turns main's status, and argparse's SystemExit, into
# the status the shell sees): one sample of kvgen's own refusal, one of argparse's.
BAD_IN_A_PROCESS = [["explain", "no_such_layout"], ["bench", "--tokens", "abc"]]


def test_bad_input_fails_the_process(tmp: Path) -> None:
    problems = []
    for argv, proc in _all(BAD_IN_A_PROCESS, tmp, closed=False):
        problems += _bad_input_problems(argv, proc.returncode, proc.stdout, proc.stderr)
    assert not problems, "\n".join(problems)


def test_interrupt_is_quiet(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Ctrl-C during a command: exit 130 and a one-line note, no traceback."""
    from kvgen.tools import cli

    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_list", interrupted)
    assert cli.main(["list"]) == 130
    assert capsys.readouterr().err == "kvgen: interrupted\n"


def test_a_bug_is_one_line_unless_asked(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from kvgen.tools import cli

    def buggy(args: object) -> int:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(cli, "cmd_list", buggy)
    monkeypatch.delenv("KVGEN_TRACEBACK", raising=False)
    assert cli.main(["list"]) == 70
    assert "internal error" in capsys.readouterr().err
    monkeypatch.setenv("KVGEN_TRACEBACK", "1")
    with pytest.raises(ZeroDivisionError):
        cli.main(["list"])
