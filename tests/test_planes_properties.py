"""Property-based tests (hypothesis) of format 2: random caches of several parts, some with
typed fields in a row or a block, some parts without slots (per-layer scales), paired with the
packed objects (regions, and rows where every plane fits one). Each connector is rendered and
executed as a module; a store and a load with a random slot mapping are compared bit for bit
with the byte-level reference (kvgen.oracle.reference.planes).
"""

from __future__ import annotations

import tempfile
import types
from pathlib import Path
from typing import Any

import torch
import yaml
from harness import (
    EXT,
    Scenario,
    clone_tree,
    make_cache,
    make_objects,
    reference_load,
    reference_store,
    same_bits,
    spec_data,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgen.emit.render import render_connector, render_package, seal
from kvgen.errors import SpecError
from kvgen.plan.package import connector_plan, plan_package
from kvgen.plan.planes import compatible_planes, plan_planes
from kvgen.runtime import KVLayoutError
from kvgen.spec.library import BUILTIN_SPECS, load_library

OBJECTS = {name: path for name, path in (
    ("kv_planes", BUILTIN_SPECS / "kvgen" / "kv_planes.yaml"),
    ("kv_planes_layer", BUILTIN_SPECS / "kvgen" / "kv_planes_layer.yaml"),
    ("kv_mla_rows", BUILTIN_SPECS / "lmcache" / "kv_mla_rows.yaml"),
    ("kv_mla_rows_layer", BUILTIN_SPECS / "lmcache" / "kv_mla_rows_layer.yaml"),
)}
SLOTS = EXT["B"] * EXT["N"]
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FIELD_DTYPES = ["float32", "bfloat16", "float8_e4m3fn"]


@st.composite
def fields(draw: st.DrawFn) -> list[dict[str, Any]]:
    """1-3 fields, wider element types first so every offset is aligned."""
    dtypes = sorted(draw(st.lists(st.sampled_from(FIELD_DTYPES), min_size=1, max_size=3)),
                    key=lambda t: -{"float32": 4, "bfloat16": 2, "float8_e4m3fn": 1}[t])
    return [{"name": f"f{i}", "dtype": t, "count": draw(st.integers(1, 3))} for i, t in enumerate(dtypes)]


@st.composite
def part(draw: st.DrawFn, index: int, lists: list[str], folded: bool, mla: bool) -> dict[str, Any]:
    """One part; `mla`: one plane per token of every part (no KV, no H), what rows objects hold."""
    axes: list[Any] = [] if "L" in lists else ["L"]
    slots = mla or index == 0 or draw(st.booleans())
    if slots:
        axes += [["B", "N"]] if folded else ["B", "N"]
    if not mla and "KV" not in lists and draw(st.booleans()):
        axes.append("KV")
    if not mla and draw(st.booleans()):
        axes.append("H")
    dims = list(draw(st.permutations(axes)))
    out: dict[str, Any] = {}
    kind = draw(st.sampled_from(["plain", "no_c", "row", "block"]))
    if kind == "block" and slots and not folded:
        dims = [d for d in dims if d not in ("B", "N")] + ["B", "N", "C"]
        out.update(dtypes=["uint8"], fields={"block": draw(fields())})
    elif kind == "row" and slots:
        out.update(dtypes=["uint8"], fields={"row": draw(fields())})
        dims.append("C")
    elif kind == "no_c":
        dims += [1] * draw(st.integers(0, 1))
        out["dtypes"] = [draw(st.sampled_from(["float32", "bfloat16"]))]
    elif "H" in dims and draw(st.booleans()):
        dims.remove("H")
        dims.append(["H", "C"])
    else:
        dims.append("C")
    keep = 3 if "fields" in out and "block" in out["fields"] else 1  # the tail fields fill stays last
    if draw(st.booleans()) and len(dims) >= keep:
        dims.insert(draw(st.integers(0, len(dims) - keep)), 1)
    out["dims"] = dims
    return out


@st.composite
def parts_specs(draw: st.DrawFn) -> dict[str, Any]:
    mla = draw(st.booleans())
    lists = draw(st.sampled_from([["L", "P"], ["P", "L"], ["P"]] + ([] if mla else [["L", "KV", "P"]])))
    folded = draw(st.booleans())
    count = draw(st.integers(2, 3))
    parts = {f"p{i}": draw(part(i, lists, folded, mla)) for i in range(count)}
    sizes = {"H": EXT["H"]}
    if "KV" in lists or any("KV" in p["dims"] for p in parts.values()):
        sizes["KV"] = 2
    if not any(("H" in p["dims"]) or (["H", "C"] in p["dims"]) for p in parts.values()):
        del sizes["H"]
    return {"kvgen": 2, "name": "prop_parts", "kind": "paged", "summary": "Random parts.", "lists": lists,
            "parts": parts, **({"sizes": sizes} if sizes else {})}


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Scenario, list[int]]:
    seq = draw(st.integers(1, 20))
    cut = draw(st.integers(0, seq))
    starts, ends = ((0,), (seq,)) if cut in (0, seq) else ((0, cut), (cut, seq))
    if draw(st.booleans()):
        blocks = draw(st.permutations(range(EXT["B"])))
        slots = [blocks[i // EXT["N"]] * EXT["N"] + i % EXT["N"] for i in range(seq)]
    else:
        slots = draw(st.permutations(range(SLOTS)))[:seq]
    skipped = draw(st.sets(st.integers(0, seq - 1), max_size=3))
    mapping = [-1 if i in skipped else s for i, s in enumerate(slots)]
    return Scenario("random", starts, ends, lambda r, e: mapping, strided=draw(st.booleans())), mapping


def _module(text: str, name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    exec(compile(text, name, "exec"), module.__dict__)
    return module


@SETTINGS
@given(spec=parts_specs(), obj_name=st.sampled_from(sorted(OBJECTS)), scenario=scenarios(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_random_parts_layouts_match_the_reference(spec: dict[str, Any], obj_name: str,
                                                  scenario: tuple[Scenario, list[int]], dtype: torch.dtype) -> None:
    sc, mapping_list = scenario
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "paged.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        # kv_t2d: the rows objects accept its label
        library = load_library([path, *OBJECTS.values(), BUILTIN_SPECS / "lmcache" / "kv_t2d.yaml"], builtin=False)
    paged, obj = library["prop_parts"], library[obj_name]
    if not compatible_planes(paged, obj):  # planes with KV, H or no slot: rows cannot hold them
        assert obj_name.startswith("kv_mla_rows"), "every format-2 cache fits a regions object"
        obj = library[obj_name.replace("kv_mla_rows", "kv_planes")]
    plan = plan_planes(paged, obj)
    text = seal(f"{plan.module}.py", render_connector(connector_plan(plan)))
    connector = _module(text, plan.module).Connector(device="cpu")
    mapping = torch.tensor(mapping_list)
    lengths = [e - s for s, e in zip(sc.starts, sc.ends, strict=True)]

    cache = make_cache(paged, dtype, "cpu", sc.strided)
    connector.bind(cache)
    try:
        connector.get_shape(1)
    except KVLayoutError as exc:  # LMCache's rows are counted in the first part's dtype: refused
        assert obj.pack == "rows" and "not a whole number" in str(exc)
        return
    objs = make_objects(connector, lengths, dtype, "cpu", salt=5)
    want = make_objects(connector, lengths, dtype, "cpu", salt=5)
    _store(connector, objs, sc, cache, mapping)
    reference_store(paged, obj, cache, want, sc, mapping_list)
    assert same_bits(_tensors(objs), _tensors(want)), f"store differs for {paged.arrow()}"

    loaded = make_objects(connector, lengths, dtype, "cpu", salt=900, fmt=connector.format)
    expected = clone_tree(cache)
    _load(connector, loaded, sc, cache, mapping)
    reference_load(paged, obj, expected, loaded, sc, mapping_list)
    assert same_bits(cache, expected), f"load differs for {paged.arrow()}"


def _tensors(objs: list[Any]) -> list[torch.Tensor]:
    return [o.tensor for c in objs for o in (c if isinstance(c, list) else [c])]


def _store(connector: Any, objs: list[Any], sc: Scenario, cache: Any, mapping: torch.Tensor) -> None:
    if not connector.layerwise:
        connector.batched_from_gpu(objs, sc.starts, sc.ends, kvcaches=cache, slot_mapping=mapping)
        return
    per_layer = [[chunk[layer] for chunk in objs] for layer in range(connector.geometry.L)]
    for _ in connector.batched_from_gpu(per_layer, sc.starts, sc.ends, kvcaches=cache, slot_mapping=mapping):
        pass


def _load(connector: Any, objs: list[Any], sc: Scenario, cache: Any, mapping: torch.Tensor) -> None:
    if not connector.layerwise:
        connector.batched_to_gpu(objs, sc.starts, sc.ends, kvcaches=cache, slot_mapping=mapping)
        return
    gen = connector.batched_to_gpu(sc.starts, sc.ends, kvcaches=cache, slot_mapping=mapping)
    next(gen)
    for layer in range(connector.geometry.L):
        gen.send([chunk[layer] for chunk in objs])
    next(gen, None)


# -- random edits inside parts and fields: the loader refuses them with a SpecError, and only that --

FORMAT2 = [spec_data(path) for path in sorted(BUILTIN_SPECS.rglob("*.yaml"))]
FORMAT2 = [d for d in FORMAT2 if d["kvgen"] == 2]
LEAVES = st.none() | st.booleans() | st.integers(-3, 700) | st.text(max_size=6) | st.sampled_from(
    ["B", "N", "H", "C", "KV", "L", "T", "P", 1, ["B", "N"], ["H", "C"], "uint8", "float32", "row", "block",
     "rows", "regions", [], {}])


@st.composite
def edited(draw: st.DrawFn) -> dict[str, Any]:
    import copy

    spec = copy.deepcopy(draw(st.sampled_from(FORMAT2)))
    for _ in range(draw(st.integers(1, 3))):
        node: Any = spec
        path = []
        while isinstance(node, (dict, list)) and node and draw(st.booleans()):
            key = draw(st.sampled_from(sorted(node, key=str) if isinstance(node, dict) else range(len(node))))
            path.append(key)
            parent, node = node, node[key]
        if not path:
            spec[draw(st.sampled_from(["parts", "fields", "pack", "lists", "dims", "sizes"]))] = draw(LEAVES)
            continue
        if draw(st.booleans()):
            parent[path[-1]] = draw(LEAVES)
        elif isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent.pop(path[-1])
    return spec


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(spec=edited())
def test_edited_format2_specs_load_or_are_refused(spec: dict[str, Any]) -> None:
    """Anything but a SpecError is a loader bug; what loads also plans and renders."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "spec.yaml"
        path.write_text(yaml.safe_dump(spec))
        try:
            library = load_library([path, *OBJECTS.values(), BUILTIN_SPECS / "lmcache" / "kv_t2d.yaml"],
                                   builtin=False)
        except SpecError as exc:
            assert exc.problems and all("\n" not in str(p) for p in exc.problems)
            return
    render_package(plan_package(library))
