"""Mutation check: any edit of a built-in spec's lists, dims or sizes must be caught.

For each built-in spec this writes mutated copies of its YAML (every swap of two adjacent
entries of `dims`, of `lists` and of the axes inside a fused dim; every move of an axis between
`lists` and `dims`; dropping an entry or adding a singleton; dropping, re-valuing, re-keying or
adding `sizes`) and loads each one as a user's spec file would be loaded. A mutant is caught when
the loader refuses it or when it disagrees with the independent facts of kvgen.oracle.facts.layouts
(shape, containers, sizes, or the address of some element). Pure Python, no tensors.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import builtin_library, spec_data, spec_text

from kvgen.errors import SpecError
from kvgen.oracle.facts.layouts import EngineGeometry, disagreement
from kvgen.spec.library import BUILTIN_SPECS, load_specs

#: No two extents equal (KV is 2), so no swap of two axes keeps every address.
G = EngineGeometry(L=3, B=5, N=4, H=6, C=7, T=9)

# Format-2 specs (parts, fields, packs) have mutants of their own: tests/test_spec_mutations_planes.py.
FILES = {spec.name: Path(spec.source).resolve() for spec in builtin_library().specs if spec.is_simple}

#: The edits that passed every test and `kvgen verify` before the facts existed.
NAMED_EDITS = {
    "flash_attn_hnd_dims_in_nhd_order": ("vllm_flash_attn_hnd", "dims: [KV, B, H, N, C]", "dims: [KV, B, N, H, C]"),
    "kv_2td_tokens_outside_kv": ("kv_2td", "dims: [KV, T, [H, C]]", "dims: [T, KV, [H, C]]"),
    "cross_layer_layers_and_kv_swapped": ("vllm_cross_layer", "dims: [B, L, KV, N, H, C]",
                                          "dims: [B, KV, L, N, H, C]"),
    "heads_first_v_before_k": ("vllm_heads_first", "dims: [H, B, N, [KV, C]]", "dims: [H, B, N, [C, KV]]"),
}


def _axes(data: dict[str, Any]) -> list[str]:
    out = list(data.get("lists", []))
    for dim in data["dims"]:
        out += dim if isinstance(dim, list) else ([] if dim == 1 else [dim])
    return out


def _with(data: dict[str, Any], **changes: Any) -> dict[str, Any]:
    new = copy.deepcopy(data)
    for key, value in changes.items():
        if value is None or (key in ("lists", "sizes") and not value):
            new.pop(key, None)  # an empty `lists` or `sizes` is written as no field at all
        else:
            new[key] = value
    return new


def _swapped(items: list[Any], i: int) -> list[Any]:
    out = list(items)
    out[i], out[i + 1] = out[i + 1], out[i]
    return out


def mutants(data: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    lists: list[str] = data.get("lists", [])
    dims: list[Any] = data["dims"]
    sizes: dict[str, int] = data.get("sizes", {})
    for i in range(len(dims) - 1):
        yield f"swap dims {i} and {i + 1}", _with(data, dims=_swapped(dims, i))
    for i in range(len(lists) - 1):
        yield f"swap lists {i} and {i + 1}", _with(data, lists=_swapped(lists, i))
    for i, dim in enumerate(dims):
        if isinstance(dim, list):
            for j in range(len(dim) - 1):
                yield f"swap axes {j} and {j + 1} of dims {i}", _with(data, dims=[*dims[:i], _swapped(dim, j),
                                                                                  *dims[i + 1:]])
    for i, axis in enumerate(lists):
        rest = lists[:i] + lists[i + 1:]
        for j in range(len(dims) + 1):
            yield f"move list {axis} to dims {j}", _with(data, lists=rest, dims=[*dims[:j], axis, *dims[j:]])
    for i, dim in enumerate(dims):
        for axis in dim if isinstance(dim, list) else ([] if dim == 1 else [dim]):
            if isinstance(dim, list):
                left = [a for a in dim if a != axis]
                rest = [*dims[:i], left if len(left) > 1 else left[0], *dims[i + 1:]]
            else:
                rest = dims[:i] + dims[i + 1:]
            for j in range(len(lists) + 1):
                yield f"move {axis} of dims {i} to lists {j}", _with(data, lists=[*lists[:j], axis, *lists[j:]],
                                                                      dims=rest)
    for i in range(len(dims)):
        yield f"drop dims {i}", _with(data, dims=dims[:i] + dims[i + 1:])
    for i in range(len(lists)):
        yield f"drop lists {i}", _with(data, lists=lists[:i] + lists[i + 1:])
    for j in range(len(dims) + 1):
        yield f"singleton at dims {j}", _with(data, dims=[*dims[:j], 1, *dims[j:]])
    if sizes:
        yield "drop sizes", _with(data, sizes=None)
    for axis, value in sizes.items():
        for other in (value - 1, value + 1):
            yield f"size {axis}: {other}", _with(data, sizes={**sizes, axis: other})
        for key in _axes(data):
            if key not in sizes:
                renamed = {(key if k == axis else k): v for k, v in sizes.items()}
                yield f"size of {axis} given to {key}", _with(data, sizes=renamed)
    for key in _axes(data):
        if key not in sizes:
            yield f"add size {key}: 2", _with(data, sizes={**sizes, key: 2})


def _verdict(text: str, path: Path) -> str | None:
    """Why the mutant is caught ('loader: ...' or 'facts: ...'), or None when it survives."""
    path.write_text(text, encoding="utf-8")
    try:
        [(spec, _doc)] = load_specs([path])
    except SpecError as exc:
        return f"loader: {exc.problems[0].message}"
    why = disagreement(spec, G)
    return None if why is None else f"facts: {why}"


@pytest.mark.parametrize("name", sorted(FILES))
def test_unmutated_copy_agrees_with_the_facts(name: str, tmp_path: Path) -> None:
    """The dump/load path itself changes nothing: only the mutations are caught."""
    data = spec_data(FILES[name])
    assert _verdict(spec_text(data), tmp_path / "copy.yaml") is None
    assert _verdict(FILES[name].read_text("utf-8"), tmp_path / "same.yaml") is None


@pytest.mark.parametrize("name", sorted(FILES))
def test_every_mutant_of_a_builtin_spec_is_caught(name: str, tmp_path: Path) -> None:
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
    # The facts, not only the loader, do the work: some mutants are valid specs they refuse.
    assert total >= 10 and by_facts > 0, (total, by_facts)


@pytest.mark.parametrize("case", sorted(NAMED_EDITS))
def test_named_wrong_spec_edits_are_caught_by_the_facts(case: str, tmp_path: Path) -> None:
    """Each edit is a valid spec the loader takes; only the facts can say it is wrong."""
    name, before, after = NAMED_EDITS[case]
    text = FILES[name].read_text("utf-8")
    assert before in text, f"{FILES[name]} no longer says {before!r}"
    verdict = _verdict(text.replace(before, after), tmp_path / f"{case}.yaml")
    assert verdict is not None and verdict.startswith("facts:"), verdict


def test_builtin_specs_are_the_files_mutated() -> None:
    assert FILES and all(path.resolve().is_relative_to(BUILTIN_SPECS.resolve()) for path in FILES.values())
