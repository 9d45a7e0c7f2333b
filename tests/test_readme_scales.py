"""The README walkthrough "A cache with scales (spec format 2)", run as written.

The spec, the commands and the Python are taken from README.md itself, so the walkthrough
cannot drift. Then every token's values and scales are checked where the kv_planes object keeps
them (docs/spec-language.md, "regions"), and against the byte-level reference.
"""

from __future__ import annotations

import importlib
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch

from kvgen.oracle.reference import Span, planes
from kvgen.spec.library import load_library
from kvgen.tools.cli import main

README = Path(__file__).resolve().parent.parent / "README.md"
TITLE = "## A cache with scales (spec format 2)"


def section() -> str:
    text = README.read_text("utf-8")
    start = text.index(TITLE)
    end = text.index("\n## ", start + len(TITLE))
    return text[start:end]


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.DOTALL)


def test_readme_scales_walkthrough(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    (shell,), (python,) = blocks(section(), "sh"), blocks(section(), "python")
    heredoc = re.search(r"cat > (\S+) <<'YAML'\n(.*?)\nYAML\n", shell, re.DOTALL)
    assert heredoc, "the walkthrough writes its spec with a heredoc"
    monkeypatch.chdir(tmp_path)
    spec_file = tmp_path / heredoc.group(1)
    spec_file.parent.mkdir(parents=True)
    spec_file.write_text(heredoc.group(2) + "\n")
    commands = [shlex.split(line) for line in shell.splitlines() if line.startswith("kvgen ")]
    assert [c[1] for c in commands] == ["build", "explain"]
    for command in commands:
        assert main(command[1:]) == 0
    shown = capsys.readouterr().out
    assert "scale          float32        x 1    kvcaches[l][1][kv, slot // N, slot % N, h]" in shown

    monkeypatch.syspath_prepend(str(tmp_path))
    torch.manual_seed(0)
    space: dict[str, object] = {}
    try:
        exec(compile(python, "README.md", "exec"), space)
        cache, obj, slots = space["cache"], space["obj"], space["slots"]
        assert space["conn"].get_dtype() == torch.uint8
        package = importlib.import_module("my_connectors")
        assert package.LAYOUTS["my_fp8_scaled"]["parts"] == ("kv", "scale")
    finally:
        for name in [m for m in sys.modules if m.startswith("my_connectors")]:
            del sys.modules[name]

    # Where the object keeps each token's scale: per layer the kv region [KV T H C] of fp8
    # bytes, then (at a multiple of 16 bytes) the scale region [KV T H] of float32.
    T, H, C, N = 32, 8, 128, 16
    start = -(-2 * T * H * C // 16) * 16
    for layer in (0, 3):
        values, scales = cache[layer]
        region = obj.tensor[layer, start:start + 2 * T * H * 4].view(torch.float32).view(2, T, H)
        kv = obj.tensor[layer, :2 * T * H * C].view(torch.float8_e4m3fn).view(2, T, H, C)
        for t, slot in enumerate(slots.tolist()):
            assert torch.equal(region[:, t], scales[:, slot // N, slot % N])
            assert torch.equal(kv[:, t].view(torch.uint8), values[:, slot // N, slot % N].view(torch.uint8))

    # and byte for byte as the reference stores it
    library = load_library([spec_file.parent])
    want = torch.zeros_like(obj.tensor)
    ext = {"L": 4, "KV": 2, "B": 64, "N": N, "H": H, "C": C}
    planes.store(library["my_fp8_scaled"], library["kv_planes"], ext, cache, want, Span(slots.tolist(), 0, T))
    assert torch.equal(want, obj.tensor)
