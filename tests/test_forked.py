"""tests/forked.py: a script in a fork of the test process, its output read back, its failures and
hangs shown."""

from __future__ import annotations

import time
from pathlib import Path

from forked import run_forked


def test_a_child_ends_as_a_process_running_the_script_would(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text("import sys\nprint(' '.join(sys.argv[1:]))\nif sys.argv[1] == 'exit':\n    sys.exit(3)\n")
    assert run_forked(script, ["ends", "here"], tmp_path / "log.txt") == ("ends here\n", 0)
    assert run_forked(script, ["exit"], tmp_path / "log.txt") == ("exit\n", 3)


def test_a_child_that_fails_shows_why_and_one_that_hangs_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text("import sys, time\nprint('ok one', flush=True)\nif sys.argv[1] == 'fail':\n"
                      "    raise RuntimeError('the engine broke')\ntime.sleep(60)\n")
    out, status = run_forked(script, ["fail"], tmp_path / "fail.txt")
    assert (out, status) == ("ok one\n", 70)
    assert "RuntimeError: the engine broke" in (tmp_path / "fail.txt").read_text()
    start = time.monotonic()
    out, status = run_forked(script, ["hang"], tmp_path / "hang.txt", timeout=0.2)
    assert (out, status) == ("ok one\n", None) and time.monotonic() - start < 10


def test_a_child_of_a_parent_whose_torch_ran_on_threads_runs_its_parallel_ops(tmp_path: Path) -> None:
    """The parent's OpenMP team has threads the fork does not: a child that used them would hang."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.ones(1 << 24).add_(1)  # large enough to run on the team
        script = tmp_path / "child.py"
        script.write_text("import torch\nprint(int(torch.ones(1 << 24).add_(1).sum()))\n")
        assert run_forked(script, [], tmp_path / "log.txt", timeout=60) == (f"{2 << 24}\n", 0)
    finally:
        torch.set_num_threads(before)
