"""Property-based tests (hypothesis).

(a) Random valid paged layouts: any order of KV, B, N, H, C (L a dim or a list level
    [L], [L, KV], [KV, L]), optional fused groups [KV, C] / [H, C] in either order with the
    sizes that make them solvable, an optional folded slot axis [B, N] and singleton dims.
    Each is paired with a built-in LMCache object, its connector rendered and executed as a
    module, and a store and a load with a random slot mapping are compared bit for bit with
    kvgen.oracle.reference.
(b) Random invalid input (any text, any bytes, YAML-ish token soup, valid specs with random
    mutations) never makes the loader fail with anything but a SpecError; what it accepts
    also plans and renders.
"""

from __future__ import annotations

import tempfile
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from harness import EXT, Scenario, clone_tree, make_cache, make_objects, reference_load, reference_store, same_bits
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvgen.emit.render import render_connector, render_package, seal
from kvgen.errors import SpecError
from kvgen.plan.copy import compatible, make_plan
from kvgen.plan.package import connector_plan, plan_package
from kvgen.spec.library import BUILTIN_SPECS, load_library, spec_files
from kvgen.spec.loader import load_document

OBJECTS = {name: BUILTIN_SPECS / "lmcache" / f"{name}.yaml" for name in ("kv_2ltd", "kv_t2d", "kv_2td")}
SLOTS = EXT["B"] * EXT["N"]
FAST = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- (a) random valid paged layouts ---------------------------------------------------------------


@st.composite
def paged_specs(draw: st.DrawFn) -> dict[str, Any]:
    lists = draw(st.sampled_from([[], ["L"], ["L", "KV"], ["KV", "L"]]))
    fuse = draw(st.sampled_from(["none", "KV_C", "H_C"] if "KV" not in lists else ["none", "H_C"]))
    folded = draw(st.booleans())
    sizes: dict[str, int] = {"KV": 2}
    dims: list[Any] = []
    if fuse == "KV_C":
        dims.append(draw(st.permutations(["KV", "C"])))
        dims.append("H")
    elif fuse == "H_C":
        dims.append(draw(st.permutations(["H", "C"])))
        known = draw(st.sampled_from(["H", "C"]))
        sizes[known] = EXT[known]
        if "KV" not in lists:
            dims.append("KV")
    else:
        dims += ["H", "C"] + ([] if "KV" in lists else ["KV"])
    dims += [["B", "N"]] if folded else ["B", "N"]
    if "L" not in lists:
        dims.append("L")
    dims += [1] * draw(st.integers(0, 1))
    dims = draw(st.permutations(dims))
    if draw(st.booleans()) and not folded:
        sizes["N"] = EXT["N"]
    if draw(st.booleans()):
        sizes["H"] = EXT["H"]
    spec: dict[str, Any] = {"kvgen": 1, "name": "prop_paged", "kind": "paged", "summary": "Random layout.",
                            "dims": [list(d) if isinstance(d, (list, tuple)) else d for d in dims],
                            "sizes": sizes}
    if lists:
        spec["lists"] = lists
    return spec


def load_module(text: str, name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    exec(compile(text, name, "exec"), module.__dict__)
    return module


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Scenario, list[int]]:
    """One or two chunks over a sequence whose tokens have distinct slots (some skipped)."""
    seq = draw(st.integers(1, 24))
    cut = draw(st.integers(0, seq))
    starts, ends = ((0,), (seq,)) if cut in (0, seq) else ((0, cut), (cut, seq))
    slots = draw(st.permutations(range(SLOTS)))[:seq]
    if draw(st.booleans()):  # vLLM-style: whole blocks in random order, token i at slot block*N + i % N
        blocks = draw(st.permutations(range(EXT["B"])))
        slots = [blocks[i // EXT["N"]] * EXT["N"] + i % EXT["N"] for i in range(seq)]
    skipped = draw(st.sets(st.integers(0, seq - 1), max_size=3))
    mapping = [-1 if i in skipped else s for i, s in enumerate(slots)]
    strided = draw(st.booleans())
    return Scenario("random", starts, ends, lambda r, e: mapping, strided=strided), mapping


@FAST
@given(spec=paged_specs(), obj_name=st.sampled_from(sorted(OBJECTS)), scenario=scenarios(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_random_layouts_match_the_reference(spec: dict[str, Any], obj_name: str,
                                            scenario: tuple[Scenario, list[int]], dtype: torch.dtype) -> None:
    sc, mapping_list = scenario
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "paged.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        library = load_library([path, OBJECTS[obj_name]], builtin=False)
    paged, obj = library["prop_paged"], library[obj_name]
    assert compatible(paged, obj)
    plan = make_plan(paged, obj)
    text = seal(f"{plan.module}.py", render_connector(connector_plan(plan)))
    connector = load_module(text, plan.module).Connector(device="cpu")
    mapping = torch.tensor(mapping_list)
    lengths = [e - s for s, e in zip(sc.starts, sc.ends, strict=True)]

    cache = make_cache(paged, dtype, "cpu", sc.strided)
    connector.bind(cache)
    objs = make_objects(connector, lengths, dtype, "cpu", salt=5)
    expected = make_objects(connector, lengths, dtype, "cpu", salt=5)
    _store(connector, objs, sc, cache, mapping)
    reference_store(paged, obj, cache, expected, sc, mapping_list)
    assert same_bits(_tensors(objs), _tensors(expected)), f"store differs for {plan.paged.arrow()}"

    loaded = make_objects(connector, lengths, dtype, "cpu", salt=900, fmt=connector.format)
    want = clone_tree(cache)
    _load(connector, loaded, sc, cache, mapping)
    reference_load(paged, obj, want, loaded, sc, mapping_list)
    assert same_bits(cache, want), f"load differs for {plan.paged.arrow()}"


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


# -- (b) the loader refuses garbage with a SpecError, and only that --------------------------------


def load_or_refuse(files: list[Path]) -> None:
    """Load `files` as a library; anything but a SpecError is a loader bug. What loads must
    also plan and render."""
    try:
        library = load_library(files, builtin=False)
    except SpecError as exc:
        assert exc.problems and all(str(p).strip() for p in exc.problems)
        for problem in exc.problems:
            assert "\n" not in str(problem), f"a problem spans lines: {problem!r}"
        return
    render_package(plan_package(library))


def write_and_load(contents: list[bytes]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for i, data in enumerate(contents):
            path = Path(tmp) / f"spec{i}.yaml"
            path.write_bytes(data)
            files.append(path)
        load_or_refuse(files)


@settings(max_examples=40, deadline=None)
@given(text=st.text(max_size=300))
def test_any_text(text: str) -> None:
    write_and_load([text.encode("utf-8", "surrogatepass")])


@settings(max_examples=25, deadline=None)
@given(data=st.binary(max_size=300))
def test_any_bytes(data: bytes) -> None:
    write_and_load([data])


YAML_TOKENS = [
    "kvgen: 1\n", "name: t_x\n", "kind: paged\n", "kind: object\n", "summary: s\n", "dims: ", "lists: ", "sizes: ",
    "format: F\n", "code: 3\n", "accepts: ", "aliases: ", "engines: ", "lmcache: ", "dtypes: ",
    "[", "]", "{", "}", ", ", ": ", "- ", "? ", "\n", "  ", "\t", "'", '"', "#", "|", ">", "---\n", "...\n",
    "%YAML 1.1\n", "&a ", "*a", "<<: ", "!!python/object/apply:os.system ", "!!binary ", "!!int 1", "!!str ",
    "!custom ", "KV", "B", "N", "H", "C", "L", "T", "1", "2", "0", "-1", "1.0", "1e400", "0x10", "~", "null",
    "yes", "no", "2001-12-14", ".nan", "\\u2028", "\u2028", "\x85", "é", "\\", "\x00", "\ufeff",
    "9" * 30, "[[[[[[[[", "]]]]]]]]",
]


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.sampled_from(YAML_TOKENS), max_size=40))
def test_yaml_token_soup(tokens: list[str]) -> None:
    write_and_load(["".join(tokens).encode("utf-8", "surrogatepass")])


#: PyYAML's int and float constructors index value[0], so an explicit !!int / !!float tag
#: on an empty scalar raises IndexError, which kvgen/loader.py's _build does not catch.
EMPTY_NUMBER_TAGS = ["!!int", "!!float ", "x: !!int", 'x: !!float ""', "kvgen: !!int\nname: x\n"]


@pytest.mark.parametrize("text", EMPTY_NUMBER_TAGS)
def test_number_tag_on_empty_scalar(text: str) -> None:
    write_and_load([text.encode()])


BUILTIN = [load_document(path).data for path, _ in spec_files([BUILTIN_SPECS])]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=20)
    | st.sampled_from(["KV", "B", "N", "H", "C", "L", "T", "UNDEFINED", "KV_2LTD", "paged", "object", "x_y"]),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8) | st.sampled_from(
        ["KV", "H", "C", "format"]), inner, max_size=4),
    max_leaves=12)

FIELDS = ["kvgen", "name", "kind", "summary", "lists", "dims", "sizes", "aliases", "lmcache", "engines", "dtypes",
          "format", "code", "accepts"]


@st.composite
def mutated_spec(draw: st.DrawFn) -> dict[str, Any]:
    spec = dict(draw(st.sampled_from(BUILTIN)))
    spec["name"] = draw(st.sampled_from(["m_one", "m_two", spec["name"]]))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["drop", "set", "add", "dims", "sizes", "swap_kind"]))
        key = draw(st.sampled_from(FIELDS))
        if op == "drop":
            spec.pop(key, None)
        elif op in ("set", "add"):
            spec[key if op == "set" else draw(st.text(max_size=10))] = draw(json_values)
        elif op == "dims" and isinstance(spec.get("dims"), list) and spec["dims"]:
            dims = list(spec["dims"])
            i = draw(st.integers(0, len(dims) - 1))
            dims[i] = draw(st.sampled_from(["KV", "B", "N", "H", "C", "L", "T", 1, 2, ["B", "N"], ["H", "C"],
                                            ["KV", "C"], ["N", "B"], ["T", "C"], [], ["H"], ["H", "H"]]))
            if draw(st.booleans()):
                dims.append(draw(st.sampled_from(["T", "L", 1, ["KV", "H", "C"]])))
            spec["dims"] = dims
        elif op == "sizes":
            spec["sizes"] = draw(st.dictionaries(st.sampled_from(["KV", "B", "N", "H", "C", "L", "T"]),
                                                 st.integers(-3, 2**21), max_size=3))
        elif op == "swap_kind":
            spec["kind"] = "object" if spec.get("kind") == "paged" else "paged"
    return spec


@settings(max_examples=80, deadline=None)
@given(specs=st.lists(mutated_spec(), min_size=1, max_size=3))
def test_mutated_specs(specs: list[dict[str, Any]]) -> None:
    texts = []
    for spec in specs:
        try:
            texts.append(yaml.safe_dump(spec, allow_unicode=True).encode("utf-8", "surrogatepass"))
        except yaml.YAMLError:
            assume(False)
    write_and_load(texts)


@pytest.mark.parametrize("spec", BUILTIN, ids=[d["name"] for d in BUILTIN])
def test_builtin_specs_survive_a_yaml_round_trip(spec: dict[str, Any]) -> None:
    """The mutation tests start from specs the loader accepts after safe_dump."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "spec.yaml"
        path.write_text(yaml.safe_dump(spec))
        assert load_document(path).data == spec
