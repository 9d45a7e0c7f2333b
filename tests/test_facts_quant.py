"""The packed units of the built-in quantized specs (format 3) against the engines' sources as
kvgen.oracle.facts.quant states them: which nibble comes first, which plane each scale scales and
how many values share it. Mutants of those keys (a packing flipped, a group changed, a scale's
relation dropped) are refused by the loader or disagree."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from harness import builtin_library

from kvgen.errors import SpecError
from kvgen.oracle.facts.quant import UNITS, units_disagreement
from kvgen.spec.library import load_specs
from kvgen.tools.verify.run import _check_facts

LIBRARY = builtin_library()
PACKED = sorted(s.name for s in LIBRARY.paged if any(f.is_sub_byte or f.scales for p in s.parts for f in p.fields))


def test_every_spec_with_packed_units_has_facts_and_every_fact_a_spec() -> None:
    assert PACKED == sorted(n for n in UNITS if any(f.is_sub_byte or f.scales for p in LIBRARY[n].parts
                                                    for f in p.fields))
    assert set(UNITS) <= {s.name for s in LIBRARY.paged}


@pytest.mark.parametrize("name", sorted(UNITS))
def test_the_packed_units_agree_with_the_sources(name: str) -> None:
    assert units_disagreement(LIBRARY[name]) is None


def _fields(data: dict[str, Any]) -> list[list[dict[str, Any]]]:
    trees = [data, *data.get("parts", {}).values()]
    return [next(iter(t["fields"].values())) for t in trees if "fields" in t]


def _changed(data: dict[str, Any], at: tuple[int, int], **kw: Any) -> dict[str, Any]:
    """A copy of `data` with field `at` (list, index) changed; None drops a key."""
    copy = yaml.safe_load(yaml.safe_dump(data))
    target = _fields(copy)[at[0]][at[1]]
    for key, value in kw.items():
        if value is None:
            target.pop(key, None)
        else:
            target[key] = value
    return copy


def mutants(data: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for i, items in enumerate(_fields(data)):
        for j, f in enumerate(items):
            if "packing" in f:
                flip = "high_first" if f["packing"] == "low_first" else "low_first"
                out.append((f"{f['name']}: packing {flip}", _changed(data, (i, j), packing=flip)))
            if "group" in f:
                out.append((f"{f['name']}: group x 2, half the scales",
                            _changed(data, (i, j), group=2 * f["group"], count=max(1, f["count"] // 2))))
                out.append((f"{f['name']}: no scale relation", _changed(data, (i, j), scales=None, group=None)))
    return out


@pytest.mark.parametrize("name", sorted(UNITS))
def test_every_mutant_of_the_packed_units_is_caught(name: str, tmp_path: Path) -> None:
    spec = LIBRARY[name]
    data = yaml.safe_load(Path(spec.source).read_text())
    found = mutants(data)
    assert found
    for what, mutant in found:
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(mutant))
        try:
            (loaded, _), = load_specs([path])
        except SpecError:
            continue  # the loader refuses it
        assert units_disagreement(loaded) is not None, f"{name}: mutant survived: {what}"


def test_kvgen_verify_reports_a_wrong_packed_unit(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(UNITS, "vllm_nvfp4", {**UNITS["vllm_nvfp4"], "values": ("high_first", None, None)})
    assert _check_facts(LIBRARY) == 1
    assert "spec vllm_nvfp4 disagrees with the engine's facts: plane values: packing" in capsys.readouterr().err
