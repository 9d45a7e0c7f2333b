"""Model connectors (layer groups and state) against the reference (kvgen.oracle.reference.models), both
ways, bit for bit, with values that encode their coordinates; the checks that run before
any write; the converters (view_as, member_view); two mutation tests that must fail."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from harness import builtin_library
from model_harness import build_models

import kvgen.generated as generated
from kvgen.errors import KVLayoutError
from kvgen.oracle.reference import models as oracle
from kvgen.oracle.scenarios import models as ms
from kvgen.plan.package import skipped_models
from kvgen.runtime import MemoryObj
from kvgen.runtime.model import connector as runtime_model
from kvgen.spec.library import load_library
from kvgen.spec.model import Pack

LIBRARY = builtin_library()
GROUPS_OBJECTS = [o.name for o in LIBRARY.objects if o.pack is Pack.GROUPS]
#: A short chunk with per-group holes, for every built-in model (the reference is slow on real geometry).
BUILTIN_SCENARIO = ms.ModelScenario("builtin", (1,), (4,), ms.SCENARIOS["minus1_per_group"].mapping)


@pytest.fixture(scope="module")
def toys(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_models(tmp_path_factory.mktemp("models"))


def smallest_rank(model: Any) -> int:
    """The largest TP every group's heads and state split divide (smaller test caches)."""
    values = [g.size("H") for g in model.groups if g.size("H")]
    values += [t.shape[t.split] for s in model.states for t in s.tensors if t.split is not None]
    return math.gcd(*values) if values else 1


# -- every built-in model x groups object ------------------------------------------------------

@pytest.mark.parametrize("obj", GROUPS_OBJECTS)
@pytest.mark.parametrize("model", [m.name for m in LIBRARY.models])
def test_builtin_model_connector_matches_reference(model: str, obj: str) -> None:
    spec = LIBRARY.model(model)
    if (model, obj) not in generated.MODELS:
        why = [w for m, o, w in skipped_models(LIBRARY) if (m, o) == (model, obj)]
        assert why, f"{model} x {obj} is neither generated nor explained"
        pytest.skip(why[0])
    if obj != "kv_groups" and not spec.states and (model, "kv_groups") in generated.MODELS:
        # Without state its sections are kv_groups' own (checked there): same table, same bytes
        mine, full = generated.get_model(model, obj), generated.get_model(model, "kv_groups")
        assert mine.groups == full.groups and not mine.states and not full.states
        return
    assert ms.check_model(generated, LIBRARY, spec, LIBRARY[obj], BUILTIN_SCENARIO,
                          ms.ModelRun(tp=smallest_rank(spec), blocks=2, requests=2)) == (True, True)


def test_generated_registry_finds_model_connectors() -> None:
    cls = generated.get("gpt_oss_120b", "kv_groups")
    assert cls is generated.get_model("GPT_OSS_120B", "KVGEN_GROUPS")
    assert [g.name for g in cls.groups] == ["sliding", "full"] and cls.views == {
        "kv_groups_attention": "gpt_oss_120b__kv_groups_attention"}
    with pytest.raises(KVLayoutError, match="models: .*gpt_oss_120b"):
        generated.get_model("no_such_model", "kv_groups")
    with pytest.raises(KVLayoutError, match="no model connector for gpt_oss_120b <-> kv_2ltd"):
        generated.get_model("gpt_oss_120b", "kv_2ltd")


def test_gpt_oss_every_scenario() -> None:
    spec = LIBRARY.model("gpt_oss_120b")
    connector = generated.get_model("gpt_oss_120b", "kv_groups")(tp=8)
    for name in ("one_group_all_minus1", "sliding_window_chunks"):
        assert ms.check_model(generated, LIBRARY, spec, LIBRARY["kv_groups"], ms.SCENARIOS[name],
                              ms.ModelRun(tp=8, connector=connector)) == (True, True), name


# -- a made-up hybrid model: two attention groups and a state group ---------------------------------

@pytest.mark.parametrize("obj", ["kv_groups", "kv_groups_attention"])
@pytest.mark.parametrize("scenario", list(ms.SCENARIOS))
def test_hybrid_matches_reference(toys: Any, scenario: str, obj: str) -> None:
    lib = toys.library
    assert ms.check_model(toys, lib, lib.model("toy_hybrid"), lib[obj], ms.SCENARIOS[scenario]) == (True, True)


@pytest.mark.parametrize("rows", ["one kernel call", "torch copies"])
def test_state_rows_move_in_one_kernel_call_or_by_torch(toys: Any, rows: str, monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """On the CPU a chunk's state rows (every layer's state tensors) move in one call of the
    compiled kernel; where it cannot (another device, a strided row) the torch copies move them:
    both give the reference's bytes, both ways."""
    native = runtime_model.copy_state_rows
    moved: list[bool] = []

    def recorded(*args: Any) -> bool:
        moved.append(native(*args) if rows == "one kernel call" else False)
        return moved[-1]

    monkeypatch.setattr(runtime_model, "copy_state_rows", recorded)
    lib = toys.library
    assert ms.check_model(toys, lib, lib.model("toy_hybrid"), lib["kv_groups"],
                          ms.SCENARIOS["minus1_per_group"]) == (True, True)
    assert moved and all(moved) == (rows == "one kernel call")


def test_hybrid_at_tp2(toys: Any) -> None:
    lib = toys.library
    assert ms.check_model(toys, lib, lib.model("toy_hybrid"), lib["kv_groups"], ms.SCENARIOS["minus1_per_group"],
                          ms.ModelRun(tp=2)) == (True, True)


# -- the mutations the reference must catch ---------------------------------------------------------

def test_tokens_through_another_groups_block_table_fail(toys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    lib = toys.library
    model, obj, sc = lib.model("toy_twin"), lib["kv_groups"], ms.SCENARIOS["whole_blocks"]
    assert ms.check_model(toys, lib, model, obj, sc) == (True, True)
    honest = runtime_model.mappings

    def swapped(*args: Any) -> dict[str, Any]:
        out = honest(*args)
        return {"even": out["odd"], "odd": out["even"]}

    monkeypatch.setattr(runtime_model, "mappings", swapped)
    assert ms.check_model(toys, lib, model, obj, sc) == (False, False)


def test_state_in_another_requests_slot_fails(toys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    lib = toys.library
    model, obj, sc = lib.model("toy_hybrid"), lib["kv_groups"], ms.SCENARIOS["whole_blocks"]
    honest = runtime_model.state_slots

    def shifted(*args: Any) -> list[int | None]:
        return [None if s is None else s + 1 for s in honest(*args)]

    monkeypatch.setattr(runtime_model, "state_slots", shifted)
    assert ms.check_model(toys, lib, model, obj, sc, ms.ModelRun(slot=0)) == (False, False)


# -- refusals, before any write ---------------------------------------------------------------------

class Setup:
    """toy_hybrid's kv_groups connector, a coded cache list, mappings and one stored object."""

    def __init__(self, toys: Any, obj: str = "kv_groups"):
        lib = toys.library
        self.case = oracle.model_case(lib, lib.model("toy_hybrid"), lib[obj], set(toys.CONNECTORS),
                                      oracle.CaseSizes(blocks=8))
        self.conn = toys.get_model("toy_hybrid", obj)()
        self.kv = ms.make_kvcaches(self.case)
        self.maps = {g: torch.tensor(m) for g, m in ms.group_mappings(self.case, ms.SCENARIOS["minus1_per_group"],
                                                                      "refusals").items()}
        self.obj = ms.make_objects(self.conn, [10], self.kv, "r")[0]

    def store(self, **kw: Any) -> None:
        args: dict[str, Any] = {"kvcaches": self.kv, "slot_mappings": self.maps, "state_slot": 1, **kw}
        self.conn.from_gpu(self.obj, 0, 10, **args)

    def load(self, **kw: Any) -> None:
        args: dict[str, Any] = {"kvcaches": self.kv, "slot_mappings": self.maps, "state_slot": 1, **kw}
        self.conn.to_gpu(self.obj, 0, 10, **args)


def _unchanged(s: Setup, action: Any, match: str) -> None:
    before_obj = s.obj.tensor.clone()
    before_kv = ms.clone_tree([e for e in s.kv if isinstance(e, (torch.Tensor, tuple))])
    label = s.obj.metadata.fmt
    with pytest.raises(KVLayoutError, match=match):
        action()
    assert torch.equal(s.obj.tensor, before_obj) and s.obj.metadata.fmt == label
    assert ms.same_bits([e for e in s.kv if isinstance(e, (torch.Tensor, tuple))], before_kv)


@pytest.mark.parametrize("direction", ["store", "load"])
def test_bad_later_group_or_state_writes_nothing(toys: Any, direction: str) -> None:
    s = Setup(toys)
    s.store()  # a labelled object, so the load reaches the checks below
    move = s.store if direction == "store" else s.load
    good = s.kv[5]
    s.kv[5] = torch.zeros(good.shape[0], good.shape[1], 3, good.shape[3], good.shape[4])  # H 3, declared 2
    _unchanged(s, move, r"group 'global' \(cache-list entries 5\)")
    s.kv[5] = good
    conv, ssm = s.kv[6]
    s.kv[6] = (conv.float(), ssm)
    _unchanged(s, move, r"state 'linear', kvcaches\[6\]\[0\] \(conv\).*dtype float32")
    s.kv[6] = (conv, ssm[:2])
    _unchanged(s, move, "2 request slots")
    s.kv[6] = (conv, ssm)
    _unchanged(s, lambda: move(state_slot=3), "state slot 3 of chunk 0 is out of range")
    _unchanged(s, lambda: move(slot_mappings={**s.maps, "global": s.maps["global"][:-1]}), "lengths differ")
    _unchanged(s, lambda: move(slot_mappings={**s.maps, "nope": s.maps["local"]}), "names 'nope'")
    _unchanged(s, lambda: move(slot_mappings=[s.maps["local"]]), "one per group")
    _unchanged(s, lambda: move(kvcaches=s.kv[:-1]), "must hold 7 entries")


def test_a_load_refuses_one_state_slot_for_two_chunks(toys: Any) -> None:
    """state_slots=[2, 2] in one load would write slot 2 twice, the last chunk winning:
    refused before any write, as a token slot given twice is. A store may read it twice."""
    s = Setup(toys)
    objs = ms.make_objects(s.conn, [5, 5], s.kv, "d")
    s.conn.batched_from_gpu(objs, [0, 5], [5, 10], kvcaches=s.kv, slot_mappings=s.maps, state_slots=[2, 2])
    before = ms.clone_tree([e for e in s.kv if isinstance(e, (torch.Tensor, tuple))])
    with pytest.raises(KVLayoutError, match="toy_hybrid: state slot 2 is loaded from chunks 0 and 1: only one "
                                            "would survive"):
        s.conn.batched_to_gpu(objs, [0, 5], [5, 10], kvcaches=s.kv, slot_mappings=s.maps, state_slots=[2, 2])
    assert ms.same_bits([e for e in s.kv if isinstance(e, (torch.Tensor, tuple))], before)
    s.conn.batched_to_gpu(objs, [0, 5], [5, 10], kvcaches=s.kv, slot_mappings=s.maps, state_slots=[2, None])


def test_a_store_into_an_object_whose_label_cannot_be_set_writes_nothing(toys: Any) -> None:
    """Chunk 1's label is frozen: refused before chunk 0 is written (once a raw AttributeError
    after it)."""
    s = Setup(toys)
    objs = ms.make_objects(s.conn, [5, 5], s.kv, "f")
    frozen = SimpleNamespace(tensor=objs[1].tensor, metadata=FrozenLabel())
    before = [o.tensor.clone() for o in objs]
    with pytest.raises(KVLayoutError, match=r"memory object for chunk 1: its format label \(.metadata.fmt\) cannot "
                                            "be set"):
        s.conn.batched_from_gpu([objs[0], frozen], [0, 5], [5, 10], kvcaches=s.kv, slot_mappings=s.maps)
    assert all(torch.equal(o.tensor, b) for o, b in zip(objs, before, strict=True))
    assert objs[0].metadata.fmt is None


@dataclass(frozen=True)
class FrozenLabel:
    fmt: Any = None


@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("where", ["attention", "state", "object"])
def test_storage_smaller_than_the_view_is_refused(toys: Any, direction: str, where: str) -> None:
    """A group's cache tensor, a state tensor or the object whose storage shrank after the
    connector bound the cache: refused before any write (the shrunk tensor is not read)."""
    s = Setup(toys)
    s.store()  # bound, and a labelled object for the load
    victim = {"attention": lambda: s.kv[5], "state": lambda: s.kv[6][1], "object": lambda: s.obj.tensor}[where]()
    victim.untyped_storage().resize_(16)
    kept = [s.kv[0], s.kv[6][0]] + ([s.obj.tensor] if where != "object" else [])
    before = [t.clone() for t in kept]
    move = s.store if direction == "store" else s.load
    name = {"attention": r"group 'global' \(cache-list entries 5\): .*cache tensor kvcaches\[0\]",
            "state": r"cache tensor kvcaches\[6\]\[1\]", "object": "memory object for chunk 0"}[where]
    with pytest.raises(KVLayoutError, match=rf"{name}: its storage holds 16 bytes"):
        move()
    assert all(torch.equal(t, b) for t, b in zip(kept, before, strict=True))


def test_every_declared_part_width_is_checked() -> None:
    """Llama-3.1-8B on vLLM-Gaudi declares C.k and C.v: a V part of another width is refused
    at bind, not only a K part (the first)."""
    connector = generated.get_model("llama31_8b_gaudi_fp8", "kv_groups")

    def entry(k: int = 128, v: int = 128) -> tuple[torch.Tensor, ...]:
        return (torch.zeros(32, 8, k, dtype=torch.float8_e4m3fn), torch.zeros(32, 8, v, dtype=torch.float8_e4m3fn),
                torch.zeros(32, 8, 1, dtype=torch.bfloat16), torch.zeros(32, 8, 1, dtype=torch.bfloat16))

    connector().bind([entry() for _ in range(32)])
    for k, v, name in ((64, 128, "C.k is 64"), (128, 64, "C.v is 64")):
        with pytest.raises(KVLayoutError, match=f"group 'full' .*: {name}, the model declares {name[:3]} = 128$"):
            connector().bind([entry(k, v) for _ in range(32)])


def test_object_refusals_write_nothing(toys: Any) -> None:
    s = Setup(toys)
    n = s.obj.tensor.shape[0]
    with pytest.raises(KVLayoutError, match=rf"kv_groups \[{n}\] uint8"):
        s.conn.from_gpu(MemoryObj(torch.zeros(n - 16, dtype=torch.uint8)), 0, 10, kvcaches=s.kv,
                        slot_mappings=s.maps)
    _unchanged(s, s.load, "cannot load an object labelled UNDEFINED")
    # An object that shares memory with a state tensor
    conv, ssm = s.kv[6]
    s.kv[6] = (conv, s.obj.tensor[:ssm.numel() * 4].view(torch.float32).view(ssm.shape))
    _unchanged(s, s.store, r"shares memory with cache tensor kvcaches\[6\]\[1\]")
    s.kv[6] = (conv, ssm)
    # Two groups' caches sharing memory
    s.kv[2] = s.kv[0]
    _unchanged(s, s.store, "same memory")


def test_call_signatures(toys: Any) -> None:
    s = Setup(toys)
    with pytest.raises(TypeError, match="did you mean 'state_slot'"):
        s.conn.from_gpu(s.obj, 0, 10, kvcaches=s.kv, slot_mappings=s.maps, state_solt=1)
    with pytest.raises(TypeError, match="state_slots"):
        s.conn.batched_to_gpu([s.obj], [0], [10], kvcaches=s.kv, slot_mappings=s.maps, state_slot=1)
    attention = Setup(toys, "kv_groups_attention")
    with pytest.raises(KVLayoutError, match="carries no state"):
        attention.store()
    with pytest.raises(KVLayoutError, match="tp=4 does not divide"):
        toys.get_model("toy_hybrid", "kv_groups")(tp=4)


# -- objects: plain tensors, unaligned bytes, sections, converters -------------------------------------

def test_plain_tensor_and_unaligned_object(toys: Any) -> None:
    s = Setup(toys)
    n = s.obj.tensor.shape[0]
    want = torch.zeros(n, dtype=torch.uint8)
    oracle.store(s.case, s.kv, want, oracle.ModelChunk({g: m.tolist() for g, m in s.maps.items()}, 0, 10,
                                                       state_slot=2))
    plain = torch.zeros(n, dtype=torch.uint8)
    s.conn.from_gpu(plain, 0, 10, kvcaches=s.kv, slot_mappings=s.maps, state_slot=2)
    odd = torch.zeros(n + 1, dtype=torch.uint8)[1:]
    s.conn.from_gpu(MemoryObj(odd), 0, 10, kvcaches=s.kv, slot_mappings=s.maps, state_slot=2)
    assert torch.equal(plain, want) and torch.equal(odd, want)
    fresh = ms.make_kvcaches(s.case)
    expected = ms.clone_tree(fresh)
    s.conn.to_gpu(MemoryObj(odd, s.conn.format), 0, 10, kvcaches=fresh, slot_mappings=s.maps, state_slot=0)
    oracle.load(s.case, expected, want, oracle.ModelChunk({g: m.tolist() for g, m in s.maps.items()}, 0, 10,
                                                          state_slot=0))
    assert ms.same_bits(fresh, expected)


def test_sections_are_aligned_and_ordered(toys: Any) -> None:
    s = Setup(toys)
    sections = s.conn.sections(10, s.kv)
    assert [x.name for x in sections] == ["local", "global"] + [f"linear[{i}].{t}" for i in (1, 3, 6)
                                                              for t in ("conv", "ssm")]
    assert all(x.offset % 16 == 0 for x in sections)
    placed, total = oracle.sections(s.case, s.kv, 10)
    assert [(x.name, x.offset, x.nbytes) for x in sections] == placed
    assert s.conn.get_shape(10) == torch.Size([total]) and total % 16 == 0


def test_view_as_attention_is_the_prefix(toys: Any) -> None:
    s = Setup(toys)
    s.store()
    view = s.conn.view_as(s.obj, "KV_GROUPS_ATTENTION", 10)
    assert view.tensor.data_ptr() == s.obj.tensor.data_ptr() and view.metadata.fmt.name == "KVGEN_GROUPS_ATTENTION"
    attention = Setup(toys, "kv_groups_attention")
    attention.conn.from_gpu(attention.obj, 0, 10, kvcaches=s.kv, slot_mappings=s.maps)
    assert torch.equal(view.tensor, attention.obj.tensor)
    with pytest.raises(KVLayoutError, match="no view from kv_groups_attention to kv_groups"):
        attention.conn.view_as(attention.obj, "kv_groups", 10)


def test_member_view_is_the_members_object(toys: Any) -> None:
    s = Setup(toys)
    s.obj.tensor.zero_()  # skipped tokens keep zeros, as in the member's own object below
    s.store()
    for g in s.conn.groups:
        view = s.conn.member_view(s.obj, g.name, 10)
        member = s.conn.members[g.name]
        assert view.metadata.fmt.name == member.memory.format
        direct = MemoryObj(torch.zeros_like(view.tensor))
        member.from_gpu(direct, 0, 10, kvcaches=[s.kv[i] for i in g.layers], slot_mapping=s.maps[g.name])
        assert torch.equal(view.tensor, direct.tensor)
        assert s.obj.tensor.data_ptr() <= view.tensor.data_ptr() < s.obj.tensor.data_ptr() + s.obj.tensor.numel()
    with pytest.raises(KVLayoutError, match="carries no group 'linear'"):
        s.conn.member_view(s.obj, "linear", 10)


def test_skipped_pairs_say_why(tmp_path: Path) -> None:
    spec = (tmp_path / "m.yaml")
    spec.write_text((Path(__file__).parent / "specs_models" / "toy_twin.yaml").read_text()
                    .replace("toy_twin", "toy_mla").replace("vllm_flash_attn_nhd", "vllm_mla")
                    .replace("{H: 2, C: 4}", "{}"))
    obj = tmp_path / "o.yaml"
    obj.write_text((Path(__file__).parent.parent / "specs" / "kvgen" / "kv_groups.yaml").read_text()
                   .replace("name: kv_groups", "name: kv_groups_2ltd").replace("[kv_2ltd, kv_mla, kv_planes]",
                                                                               "[kv_2ltd]")
                   .replace("KVGEN_GROUPS", "KVGEN_GROUPS_2LTD").replace("code: 130", "code: 139"))
    lib = load_library([tmp_path])
    why = {(m, o): w for m, o, w in skipped_models(lib)}
    assert "group 'even' (vllm_mla) has no member" in why[("toy_mla", "kv_groups_2ltd")]


def test_verify_runs_and_matches_model_connectors(toys: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from kvgen.tools.verify import models as verify_models
    from kvgen.tools.verify import pool as verify_pool
    from kvgen.tools.verify import run as verify

    twin = [p for p in toys.plans if p.model.name == "toy_twin"]
    ctx = verify_pool.Context(verify_pool.Inputs(Path("out"), (), None), toys.library, [], [], twin, toys)
    with verify_pool.Rows(ctx, 1, verify.check_row) as rows:
        assert verify_models.run(rows, twin, twin, ["cpu"]) == (4, 0)
    assert "toy_twin                 kv_groups              cpu    yes      yes" in capsys.readouterr().out
    package = type("Package", (), {"MODELS": {("toy_twin", "kv_groups"): "x"}})
    said = verify_models.mismatch(package, twin, Path("out"), [])  # type: ignore[arg-type]
    assert said is not None and "lacks 1 model connectors" in said and "toy_twin__kv_groups_attention" in said
