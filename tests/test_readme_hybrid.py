"""The README walkthrough "A hybrid model (groups and state)", run as written: its one spec
file, its build command and its Python, then the object it stored checked bit for bit against
the model reference (kvgen.oracle.reference.models) and the sections it printed."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
import torch

from kvgen.oracle.reference import models as oracle
from kvgen.spec.library import load_library
from kvgen.tools.cli import main

README = Path(__file__).resolve().parent.parent / "README.md"
TITLE = "## A hybrid model (groups and state)"


def section() -> str:
    text = README.read_text("utf-8")
    start = text.index(TITLE)
    return text[start:text.index("\n## ", start + len(TITLE))]


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.DOTALL)


def test_readme_hybrid_walkthrough(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    (shell,), (python,) = blocks(section(), "sh"), blocks(section(), "python")
    heredocs = re.findall(r"cat > (\S+) <<'YAML'\n(.*?)\nYAML\n", shell, re.DOTALL)
    assert len(heredocs) == 1, "the walkthrough writes one spec file"
    monkeypatch.chdir(tmp_path)
    spec_file = tmp_path / heredocs[0][0]
    spec_file.parent.mkdir(parents=True)
    spec_file.write_text(heredocs[0][1] + "\n")
    commands = [shlex.split(line) for line in shell.splitlines() if line.startswith("kvgen ")]
    assert [c[1] for c in commands] == ["build"]
    assert main(commands[0][1:]) == 0
    capsys.readouterr()

    monkeypatch.syspath_prepend(str(tmp_path))
    torch.manual_seed(0)
    space: dict[str, object] = {}
    try:
        exec(compile(python, "README.md", "exec"), space)
        printed = capsys.readouterr().out.splitlines()
        conn, cache, obj, maps = space["conn"], space["cache"], space["obj"], space["maps"]
        library = load_library([spec_file.parent])
        model = library.model("my_hybrid")
        package = space["hybrid_connectors"]
        case = oracle.model_case(library, model, library["kv_groups"], set(package.CONNECTORS),  # type: ignore
                                 oracle.CaseSizes(blocks=64, block_size=16))
        want = torch.zeros_like(obj.tensor)  # type: ignore[attr-defined]
        oracle.store(case, cache, want, oracle.ModelChunk({g: m.tolist() for g, m in maps.items()}, 0, 32,  # type: ignore
                                                          state_slot=3))
        assert torch.equal(obj.tensor, want)  # type: ignore[attr-defined]
        assert obj.metadata.fmt.name == "KVGEN_GROUPS"  # type: ignore[attr-defined]
        # the local group's first 8 tokens were out of the window: their bytes stay zero
        local = conn.member_view(obj, "local", 32)  # type: ignore[attr-defined]
        assert not local.tensor[:, :, :8].any() and local.tensor[:, :, 8:].any()
        names = [line.split()[0] for line in printed]
        assert names == ["local", "global"] + [f"linear[{i}].{t}" for i in (1, 2, 4) for t in ("conv", "ssm")]
        state = conn.sections(32)[2]  # type: ignore[attr-defined]
        raw = obj.tensor[state.offset:state.offset + state.nbytes]  # type: ignore[attr-defined]
        assert torch.equal(raw.view(torch.bfloat16).view(3, 256), cache[1][0][3])  # type: ignore[index]
    finally:
        for name in [m for m in sys.modules if m == "hybrid_connectors" or m.startswith("hybrid_connectors.")]:
            del sys.modules[name]
