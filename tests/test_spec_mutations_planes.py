"""Mutation check for the format-2 built-in specs: any edit of their parts, fields, dims, lists,
sizes, dtypes or pack must be refused by the loader or disagree with kvgen.oracle.facts.planes.

Mutants: swapping adjacent parts, fields, dims, list levels or fused axes; dropping a dim, a part
or a field; adding a singleton; changing a field's count, dtype or place (row <-> block, `at`);
changing a part's dtypes; dropping or adding sizes; switching an object's pack. Pure Python.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import builtin_library, spec_data, spec_text

from kvgen.errors import SpecError
from kvgen.oracle.facts.layouts import EngineGeometry, disagreement
from kvgen.spec.library import load_specs

G = EngineGeometry(L=3, B=5, N=4, H=6, C=7, T=9)
# Groups objects have no dims or parts to mutate: tests/test_facts_groups.py mutates them.
FILES = {spec.name: Path(spec.source).resolve() for spec in builtin_library().specs
         if not spec.is_simple and spec.carries is None}
OTHER_DTYPE = {"float32": "bfloat16", "bfloat16": "float32", "float8_e4m3fn": "float8_e5m2", "uint8": "int8",
               "float8_e5m2": "float8_e4m3fn", "float16": "float32", "int8": "uint8",
               "fp4_e2m1": "int4", "int4": "fp4_e2m1", "uint4": "int4", "ue8m0": "uint8",  # format 3 fields
               "float8_e8m0fnu": "float8_e4m3fn", "uint3": "uint4"}


def _swap(items: list[Any], i: int) -> list[Any]:
    out = list(items)
    out[i], out[i + 1] = out[i + 1], out[i]
    return out


def _tree_mutants(tree: dict[str, Any], what: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Mutants of one tensor tree (a part, or a spec's top level): dims, fields, dtypes, sizes."""
    dims = tree.get("dims", [])
    for i in range(len(dims) - 1):
        yield f"{what}: swap dims {i}, {i + 1}", {**tree, "dims": _swap(dims, i)}
    for i, d in enumerate(dims):
        yield f"{what}: drop dim {i}", {**tree, "dims": dims[:i] + dims[i + 1:]}
        if isinstance(d, list):
            yield f"{what}: swap axes of dim {i}", {**tree, "dims": [*dims[:i], list(reversed(d)), *dims[i + 1:]]}
    yield f"{what}: add a singleton", {**tree, "dims": [1, *dims]}
    for dtype in tree.get("dtypes", []):
        others = [t for t in tree["dtypes"] if t != dtype]
        yield f"{what}: dtype {dtype} -> {OTHER_DTYPE[dtype]}", {**tree, "dtypes": [*others, OTHER_DTYPE[dtype]]}
        if others:
            yield f"{what}: drop dtype {dtype}", {**tree, "dtypes": others}
    if "dtypes" not in tree:
        yield f"{what}: restrict dtypes", {**tree, "dtypes": ["float32"]}
    fields = tree.get("fields")
    if fields:
        (where, items), = fields.items()
        flip = "block" if where == "row" else "row"
        yield f"{what}: fields in a {flip}", {**tree, "fields": {flip: items}}
        for i in range(len(items) - 1):
            yield f"{what}: swap fields {i}, {i + 1}", {**tree, "fields": {where: _swap(items, i)}}
        for i, f in enumerate(items):
            changed = [dict(x) for x in items]
            changed[i]["count"] = f["count"] + 1
            yield f"{what}: field {f['name']} count + 1", {**tree, "fields": {where: changed}}
            changed = [dict(x) for x in items]
            changed[i]["dtype"] = OTHER_DTYPE[f["dtype"]]
            yield f"{what}: field {f['name']} dtype", {**tree, "fields": {where: changed}}
            if len(items) > 1:
                yield f"{what}: drop field {f['name']}", {**tree, "fields": {where: items[:i] + items[i + 1:]}}
            if where == "row" and i:
                changed = [dict(x) for x in items]
                changed[i]["at"] = sum(x["count"] for x in items[:i]) * 4 + 16
                yield f"{what}: field {f['name']} moved", {**tree, "fields": {where: changed}}


def mutants(data: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    lists = data.get("lists", [])
    for i in range(len(lists) - 1):
        yield f"swap lists {i}, {i + 1}", {**data, "lists": _swap(lists, i)}
    sizes = data.get("sizes", {})
    if sizes:
        yield "drop sizes", {k: v for k, v in data.items() if k != "sizes"}
    yield "add size H: 6", {**data, "sizes": {**sizes, "H": 6}}
    if "parts" in data:
        names = list(data["parts"])
        for i in range(len(names) - 1):
            order = _swap(names, i)
            yield f"swap parts {names[i]}, {names[i + 1]}", {**data, "parts": {n: data["parts"][n] for n in order}}
        for n in names:
            yield f"drop part {n}", {**data, "parts": {k: v for k, v in data["parts"].items() if k != n}}
            for what, tree in _tree_mutants(data["parts"][n], f"part {n}"):
                yield what, {**data, "parts": {**data["parts"], n: tree}}
    else:
        yield from _tree_mutants(data, "spec")
    if "pack" in data:
        yield "switch pack", {**data, "pack": "rows" if data["pack"] == "regions" else "regions"}


def _verdict(text: str, path: Path) -> str | None:
    path.write_text(text, encoding="utf-8")
    try:
        [(spec, _doc)] = load_specs([path])
    except SpecError as exc:
        return f"loader: {exc.problems[0].message}"
    why = disagreement(spec, G)
    return None if why is None else f"facts: {why}"



def test_every_format2_builtin_spec_is_mutated() -> None:
    assert len(FILES) >= 11


@pytest.mark.parametrize("name", sorted(FILES))
def test_unmutated_format2_copy_agrees_with_the_facts(name: str, tmp_path: Path) -> None:
    data = spec_data(FILES[name])
    assert _verdict(spec_text(data), tmp_path / "copy.yaml") is None


@pytest.mark.parametrize("name", sorted(FILES))
def test_every_mutant_of_a_format2_spec_is_caught(name: str, tmp_path: Path) -> None:
    data = spec_data(FILES[name])
    survivors, by_facts, total = [], 0, 0
    for i, (what, mutant) in enumerate(mutants(data)):
        total += 1
        verdict = _verdict(spec_text(mutant), tmp_path / f"m{i}.yaml")
        if verdict is None:
            survivors.append(what)
        elif verdict.startswith("facts:"):
            by_facts += 1
    assert not survivors, f"{name}: mutants no test would see: {survivors}"
    assert total >= 5 and by_facts > 0, (total, by_facts)
