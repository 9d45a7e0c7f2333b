"""The groups objects against their facts (kvgen.oracle.facts.groups), and every edit of one
caught by the loader or the facts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from harness import builtin_library

from kvgen.errors import SpecError
from kvgen.oracle.facts.groups import GROUPS_FACTS
from kvgen.oracle.facts.layouts import EngineGeometry, disagreement
from kvgen.spec.library import load_specs

LIBRARY = builtin_library()
GROUPS = {s.name: s for s in LIBRARY.objects if s.carries is not None}
G = EngineGeometry(L=3, B=5, N=4, H=6, C=7, T=9)


def test_every_groups_object_has_facts() -> None:
    assert sorted(GROUPS) == sorted(GROUPS_FACTS)


@pytest.mark.parametrize("name", sorted(GROUPS))
def test_groups_object_matches_its_facts(name: str) -> None:
    assert disagreement(GROUPS[name], G) is None


def _mutants(data: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    members, carries = data["members"], data["carries"]
    out = [("swap members 0, 1", {**data, "members": [members[1], members[0], *members[2:]]}),
           ("drop the last member", {**data, "members": members[:-1]}),
           ("code + 1", {**data, "code": data["code"] + 1}),
           ("other format", {**data, "format": data["format"] + "_X"})]
    for key in ("groups", "state"):
        other = "none" if carries[key] == "all" else "all"
        out.append((f"carries {key} {other}", {**data, "carries": {**carries, key: other}}))
    out.append(("pack regions", {**data, "pack": "regions"}))
    return out


@pytest.mark.parametrize("name", sorted(GROUPS))
def test_every_edit_of_a_groups_object_is_caught(name: str, tmp_path: Path) -> None:
    data = yaml.safe_load(Path(GROUPS[name].source).read_text("utf-8"))
    for what, mutant in _mutants(data):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(mutant, sort_keys=False))
        try:
            [(spec, _doc)] = load_specs([path])
        except SpecError:
            continue  # the loader refuses it
        assert disagreement(spec, G) is not None, f"{name}: {what} is seen by no test"
