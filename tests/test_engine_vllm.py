"""vLLM 0.33's own cache code as the oracle: every KVCacheLayout, padded pages, MLA, kernel blocks
smaller than the manager block and a hybrid model's overlaid groups, moved by kvgen both ways.

Caches are made by vLLM's functions (FullAttentionSpec / MLAAttentionSpec / SlidingWindowSpec,
get_kv_cache_config_from_groups with a stand-in for the few VllmConfig fields it reads,
allocate_kv_cache, create_kv_cache_views, compute_layout_strides). vLLM's write kernel
(reshape_and_cache_flash) is CUDA-only, so the values are written through vLLM's logical
[B, H, N, C] view, whose element semantics are the documented ones (C is K's head_size values,
then V's). Each value encodes (layer, block, head, slot in block, content), so a K/V swap, a
transposition or a wrong layer changes it. kvgen stores into objects, which are compared with the
coordinates they must hold, then loads them into a fresh cache made by the same vLLM functions,
which is read back through its logical view. Importing vllm costs seconds; the tests themselves
are small.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from harness import builtin_library, vllm_module

import kvgen
from kvgen import generated
from kvgen.integrations.detect import AmbiguousLayout, NoLayout, detect
from kvgen.integrations.vllm import Pairing
from kvgen.oracle import reference
from kvgen.oracle.facts import vllm as facts_vllm
from kvgen.runtime import KVLayoutError, MemoryObj

iface = vllm_module("vllm.v1.kv_cache_interface")
planning = vllm_module("vllm.v1.core.kv_cache_planning")
vllm_layouts = vllm_module("vllm.v1.kv_cache_layout")
worker = vllm_module("vllm.v1.worker.utils")

LIBRARY = builtin_library()
#: No two extents equal: a swapped pair of axes changes a shape or a value.
L, B, N, H, C = 2, 5, 4, 3, 6
#: vLLM's KVCacheLayouts as kvgen's facts name them (parametrizing needs no vLLM import);
#: test_facts_agree_with_vllms_own_tables_and_views holds both lists to vLLM's enum.
LAYOUTS = list(facts_vllm.KV_CACHE_LAYOUTS)
#: Layouts whose pages are whole runs (L and B outermost): the ones vLLM can pad.
PADDABLE = ["LBHNC", "LBNHC", "BLHNC", "BLNHC"]
#: Scattered slots, a whole block (8..11) among them.
SLOTS = [17, 3, 8, 9, 10, 11, 0, 19, 6]
VERSION = "0.33.0"


def _vllm_config(layout: str, num_blocks: int) -> Any:
    """The VllmConfig fields get_kv_cache_config_from_groups reads (a whole VllmConfig needs a model)."""
    cache = SimpleNamespace(get_resolved_kv_cache_layout=lambda: vllm_layouts.KVCacheLayout[layout],
                            prefix_cache_retention_interval=None, num_gpu_blocks_override=num_blocks)
    return SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=None), cache_config=cache)


def full(**kw: Any) -> Any:
    return iface.FullAttentionSpec(**{"block_size": N, "num_kv_heads": H, "head_size": C, "dtype": torch.float32,
                                      **kw})


def mla(**kw: Any) -> Any:
    return iface.MLAAttentionSpec(block_size=N, num_kv_heads=1, head_size=C, dtype=torch.float32, **kw)


def engine_cache(layout: str, groups: dict[str, Any]) -> tuple[dict[str, torch.Tensor], Any]:
    """vLLM's cache for groups {prefix: spec} of L layers each: its views and its KVCacheConfig."""
    specs = [iface.KVCacheGroupSpec([f"{p}.{i}" for i in range(L)], spec) for p, spec in groups.items()]
    config = planning.get_kv_cache_config_from_groups(_vllm_config(layout, B), specs, 1 << 30)
    config.kv_cache_layout = layout
    return worker.allocate_kv_cache(config, torch.device("cpu"), vllm_layouts.KVCacheLayout[layout]), config


def code(layer: int, shape: torch.Size, salt: int = 0) -> torch.Tensor:
    """Values of one layer's logical [B, H, N, C] view: 1 + the position, layer outermost."""
    b, h, n, c = shape
    base = (salt * L + layer) * b * h * n * c
    return (torch.arange(b * h * n * c, dtype=torch.float32) + 1 + base).reshape(b, h, n, c)


def write(kv: dict[str, torch.Tensor], names: list[str], salt: int = 0) -> None:
    for i, name in enumerate(names):
        kv[name].copy_(code(i, kv[name].shape, salt))  # through vLLM's logical view


def expected(kv: dict[str, torch.Tensor], names: list[str], slots: list[int], planes: int) -> torch.Tensor:
    """The object [KV, L, T, H * C] (MLA: [1, L, T, C]) the slots must give, from the logical views."""
    rows = []
    for name in names:
        v = kv[name]
        n = v.shape[2]
        per_token = torch.stack([v[s // n, :, s % n, :] for s in slots])  # [T, H, content]
        rows.append(torch.stack([per_token[..., k * (v.shape[3] // planes):(k + 1) * (v.shape[3] // planes)]
                                 .reshape(len(slots), -1) for k in range(planes)]))
    return torch.stack(rows, dim=1)


def store(group: Any, planes: int, slots: list[int]) -> MemoryObj:
    width = group.detection.extents["H"] * group.detection.extents["C"] if planes == 2 else \
        group.detection.extents["C"]
    obj = MemoryObj(torch.zeros(planes, len(group.layer_names), len(slots), width))
    group.connector.from_gpu(obj, 0, len(slots), kvcaches=group.kvcaches, slot_mapping=torch.tensor(slots))
    return obj  # labelled with the object's format by the store


def load(group: Any, obj: MemoryObj, slots: list[int]) -> None:
    group.connector.to_gpu(obj, 0, len(slots), kvcaches=group.kvcaches, slot_mapping=torch.tensor(slots))


def read_back(kv: dict[str, torch.Tensor], names: list[str], slots: list[int]) -> torch.Tensor:
    return torch.stack([torch.stack([kv[n][s // kv[n].shape[2], :, s % kv[n].shape[2], :] for s in slots])
                        for n in names])


def roundtrip(layout: str, groups: dict[str, Any], planes: int, **kw: Any) -> None:
    kv, config = engine_cache(layout, groups)
    names = list(config.kv_cache_groups[0].layer_names)
    write(kv, names)
    (group,) = kvgen.from_vllm(kv, config, vllm_layouts.KVCacheLayout[layout], engine_version=VERSION, **kw)
    obj = store(group, planes, SLOTS)
    assert torch.equal(obj.tensor, expected(kv, names, SLOTS, planes))
    fresh, fresh_config = engine_cache(layout, groups)
    (target,) = kvgen.from_vllm(fresh, fresh_config, layout, engine_version=VERSION, **kw)
    load(target, obj, SLOTS)
    assert torch.equal(read_back(fresh, names, SLOTS), read_back(kv, names, SLOTS))
    untouched = sorted(set(range(B * N)) - set(SLOTS))
    assert not read_back(fresh, names, untouched).any()  # nothing written outside the slots


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_kv_cache_layout_moves_both_ways(layout: str) -> None:
    roundtrip(layout, {"attn": full()}, planes=2)


@pytest.mark.parametrize("layout", PADDABLE)
def test_padded_pages_move_both_ways(layout: str) -> None:
    page = H * N * 2 * C * 4
    roundtrip(layout, {"attn": full(page_size_padded=page + 64)}, planes=2)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mla_latent_moves_both_ways(layout: str) -> None:
    roundtrip(layout, {"mla": mla()}, planes=1)


def test_equal_heads_and_block_size_are_read_as_vllm_declares() -> None:
    """The 'Why' regression: with H == N the default LBNHC (legacy NHD) and a padded page were refused."""
    roundtrip("LBNHC", {"attn": full(num_kv_heads=N)}, planes=2)
    roundtrip("LBNHC", {"attn": full(num_kv_heads=N, page_size_padded=N * N * 2 * C * 4 + 64)}, planes=2)
    kv, config = engine_cache("LBNHC", {"attn": full(num_kv_heads=N)})
    views = [kv[n] for n in config.kv_cache_groups[0].layer_names]
    hints = {"engine": "vllm", "engine_version": VERSION, "num_kv_heads": N, "block_size": N}
    assert detect(views, kv_layout="NHD", **hints).layout == "vllm_lbnhc"  # NHD names LBNHC from 0.33 on
    with pytest.raises(NoLayout, match="the memory order is"):
        detect(views, kv_layout="LBHNC", **hints)  # the neighbour: the strides say otherwise


def test_one_kv_head_is_not_taken_for_mla() -> None:
    """With one KV head (a TP rank of a GQA model) the view is [B, 1, N, 2C], which an MLA latent of
    width 2C also is; vLLM's spec says which (MLAAttentionSpec or not), and from_vllm passes it on."""
    roundtrip("LBNHC", {"attn": full(num_kv_heads=1)}, planes=2)
    kv, config = engine_cache("LBNHC", {"attn": full(num_kv_heads=1)})
    views = [kv[n] for n in config.kv_cache_groups[0].layer_names]
    with pytest.raises(AmbiguousLayout, match="use_mla"):
        detect(views, engine="vllm", engine_version=VERSION, kv_layout="LBNHC", block_size=N)


def test_kernel_blocks_smaller_than_the_manager_block_keep_the_manager_views() -> None:
    spec = full(block_size=2 * N)
    kv, config = engine_cache("LBNHC", {"attn": spec})
    tensor = config.kv_cache_tensors[0]
    raw = torch.tensor([], dtype=torch.int8).set_(kv["attn.0"].untyped_storage())  # the one backing buffer
    kernel = iface.create_kv_cache_views(raw, spec, config.num_blocks, vllm_layouts.KVCacheLayout.LBNHC,
                                         tensor, kernel_block_size=N)
    names = list(config.kv_cache_groups[0].layer_names)
    for i, view in enumerate(kernel):  # what attention writes: kernel blocks of N slots
        view.copy_(code(i, view.shape))
    (group,) = kvgen.from_vllm(kv, config, engine_version=VERSION)  # the manager views, blocks of 2N
    slots = [5, 6, 7, 8, 9, 30, 1]
    obj = store(group, 2, slots).tensor
    kernel_kv = dict(zip(names, kernel, strict=True))
    # manager slot s (block s // 2N) is kernel block 2 (s // 2N) + (s % 2N) // N, slot s % N: slot s again
    assert torch.equal(obj, expected(kernel_kv, names, slots, 2))
    with pytest.raises(NoLayout, match="block_size"):
        kvgen.from_vllm(kernel_kv, config, engine_version=VERSION)


def test_a_pairing_names_the_object_and_the_package_the_connector_comes_from() -> None:
    """from_vllm pairs a group with kv_2ltd by default; `pairing=` names another object, and the
    generated package (module or name) whose specs detect the cache and whose module connects it."""
    kv, config = engine_cache("LBNHC", {"attn": full()})
    (default,) = kvgen.from_vllm(kv, config, engine_version=VERSION)
    (t2d,) = kvgen.from_vllm(kv, config, engine_version=VERSION,
                             pairing=Pairing(kv_object="kv_t2d", package=generated))
    (by_name,) = kvgen.from_vllm(kv, config, engine_version=VERSION,
                                 pairing=Pairing(kv_object="kv_2td", package="kvgen.generated"))
    assert [g.connector.memory.name for g in (default, t2d, by_name)] == ["kv_2ltd", "kv_t2d", "kv_2td"]
    assert {g.detection.layout for g in (default, t2d, by_name)} == {"vllm_lbnhc"}
    with pytest.raises(KVLayoutError):
        kvgen.from_vllm(kv, config, engine_version=VERSION, pairing=Pairing(kv_object="no_such_object"))


@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC"])
def test_hybrid_groups_overlay_one_buffer_and_each_has_its_connector(layout: str) -> None:
    kv, config = engine_cache(layout, {"full": full(), "swa": iface.SlidingWindowSpec(
        block_size=N, num_kv_heads=H, head_size=C, dtype=torch.float32, sliding_window=2 * N)})
    groups = kvgen.from_vllm(kv, config, layout, engine_version=VERSION)
    assert [g.layer_names for g in groups] == [tuple(g.layer_names) for g in config.kv_cache_groups]
    assert kv["full.0"].data_ptr() == kv["swa.0"].data_ptr()  # vLLM overlays the groups from byte 0
    full_names, swa_names = (list(g.layer_names) for g in groups)
    write(kv, full_names)  # blocks 0..2 belong to the full group, 3..4 to the window
    full_slots, swa_slots = [1, 4, 5, 6, 7, 9], [12, 13, 18, 19]
    full_obj = store(groups[0], 2, full_slots).tensor
    assert torch.equal(full_obj, expected(kv, full_names, full_slots, 2))
    write(kv, swa_names, salt=1)  # the window group's blocks, over the same bytes
    assert torch.equal(store(groups[1], 2, swa_slots).tensor, expected(kv, swa_names, swa_slots, 2))
    # overlap inside a group is still refused: one layer's view given twice
    twice = dataclasses.replace(groups[0], kvcaches=[groups[0].kvcaches[0]] * L)
    with pytest.raises(KVLayoutError):
        store(twice, 2, full_slots)
    # and an object that is the cache's own memory
    buffer = torch.tensor([], dtype=torch.float32).set_(kv["full.0"].untyped_storage())
    inside = MemoryObj(buffer[:2 * L * len(full_slots) * H * C].view(2, L, len(full_slots), H * C))
    with pytest.raises(KVLayoutError):
        groups[0].connector.from_gpu(inside, 0, len(full_slots), kvcaches=groups[0].kvcaches,
                                     slot_mapping=torch.tensor(full_slots))


def test_facts_agree_with_vllms_own_tables_and_views() -> None:
    members = list(vllm_layouts.KVCacheLayout)
    assert set(facts_vllm.KV_CACHE_LAYOUTS) == set(LAYOUTS) == {m.name for m in members}
    assert PADDABLE == [m.name for m in members if m.is_block_compact]
    for name in LAYOUTS:
        member = vllm_layouts.KVCacheLayout[name]
        assert facts_vllm.KV_CACHE_LAYOUTS[name] == member.value
        assert facts_vllm.layer_view_order(name) == member.layer_view_order
        spec = LIBRARY[facts_vllm.SPEC_OF[name]]
        assert tuple(d.axes[-1] for d in spec.given) == facts_vllm.HANDED_OVER
        kv, config = engine_cache(name, {"attn": full()})
        view = kv[config.kv_cache_groups[0].layer_names[0]]
        memory = view.permute(*member.layer_view_order)
        assert list(memory.stride()) == sorted(memory.stride(), reverse=True)  # vLLM's own view, memory order
        fact = facts_vllm.SPEC_OF[name]
        assert tuple(memory.shape) == generated_shape(fact)


def generated_shape(name: str) -> tuple[int, ...]:
    spec = LIBRARY[name]
    return reference.layouts.leaf_shape(spec, {"L": L, "KV": 2, "B": B, "N": N, "H": H, "C": C})


def _swap(dims: tuple[Any, ...], a: str, b: str) -> tuple[Any, ...]:
    i = next(k for k, d in enumerate(dims) if d.axes == (a,))
    j = next(k for k, d in enumerate(dims) if d.axes == (b,))
    out = list(dims)
    out[i], out[j] = out[j], out[i]
    return tuple(out)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_spec_mutated_to_the_neighbouring_layout_fails(layout: str) -> None:
    """The same comparison with the spec's handed-over order mutated to its neighbour's (H and N
    swapped; H == N so the shapes agree and only the values can tell) gives wrong objects, and the
    neighbouring built-in spec is refused by detection."""
    heads = N
    kv, config = engine_cache(layout, {"attn": full(num_kv_heads=heads)})
    names = list(config.kv_cache_groups[0].layer_names)
    write(kv, names)
    spec = LIBRARY[facts_vllm.SPEC_OF[layout]]
    ext = {"L": L, "KV": 2, "B": B, "N": N, "H": heads, "C": C}
    for candidate, right in ((spec, True), (dataclasses.replace(spec, given=_swap(spec.given, "H", "N")), False)):
        perm = [next(i for i, g in enumerate(candidate.given) if g == d) for d in candidate.dims]
        obj = torch.zeros(2, L, len(SLOTS), heads * C)
        reference.store(candidate, LIBRARY["kv_2ltd"], ext, [kv[n].permute(*perm) for n in names], obj,
                        reference.Span(SLOTS, 0, len(SLOTS)))
        assert torch.equal(obj, expected(kv, names, SLOTS, 2)) is right
    neighbour = {"LBHNC": "LBNHC", "LBNHC": "LBHNC", "BLHNC": "BLNHC", "BLNHC": "BLHNC",
                 "LHBNC": "LBHNC", "BHLNC": "BLNHC"}[layout]
    with pytest.raises(NoLayout, match="the memory order is"):
        kvgen.from_vllm(kv, config, neighbour, engine_version=VERSION)


def test_a_layout_the_library_lacks_for_the_release_is_refused_in_vllms_words() -> None:
    kv, config = engine_cache("LBNHC", {"attn": full()})
    with pytest.raises(NoLayout, match=r"vLLM 0.34.0 KVCacheLayout.LBNHC: kvgen has no layout for it"):
        kvgen.from_vllm(kv, config, engine_version="0.34.0")


def test_without_a_declaration_layouts_that_fit_the_same_tensors_are_refused() -> None:
    kv, config = engine_cache("BLHNC", {"attn": full()})
    views = [kv[n] for n in config.kv_cache_groups[0].layer_names]
    with pytest.raises(AmbiguousLayout, match="kv_layout='BLHNC'"):
        detect(views, engine="vllm", engine_version=VERSION, num_kv_heads=H, block_size=N)
    declared = detect(views, engine="vllm", engine_version=VERSION,
                      kv_layout=vllm_layouts.KVCacheLayout.BLHNC)  # vLLM's enum
    assert declared.layout == "vllm_blhnc" and "given" in declared.decided_by
    assert "vllm_blhnc" in generated.LAYOUTS


# -- Whisper block pooling: several states per token ---------------------------------------------

#: vLLM 0.33's block_pool_size of the built-in spec (Voxtral Realtime's downsample_factor).
POOL = 4


def pooled(pool: int = POOL) -> Any:
    """The KVCacheSpec WhisperCausalAttention.get_kv_cache_spec makes: a full-attention spec with
    tokens_per_state=Fraction(1, block_pool_size)."""
    return dataclasses.replace(full(), tokens_per_state=Fraction(1, pool))


def states_of(slots: list[int]) -> list[int]:
    """The states the pooled attention builder writes for manager slots `slots`, in order: each
    slot s expanded to s * pool + j (whisper_causal.py's slot_buf.view(m, pool) copy)."""
    return [s * POOL + j for s in slots for j in range(POOL)]


#: The pooled spec of each KVCacheLayout: its per-layer memory order (NHD, HND or heads first).
POOLED = {"LBNHC": "vllm_whisper_pooled4", "BLNHC": "vllm_whisper_pooled4", "LBHNC": "vllm_whisper_pooled4_hnd",
          "BLHNC": "vllm_whisper_pooled4_hnd", "BHLNC": "vllm_whisper_pooled4_hnd",
          "LHBNC": "vllm_whisper_pooled4_heads_first"}


@pytest.mark.parametrize("layout", sorted(POOLED))
def test_a_pooled_whisper_cache_moves_each_tokens_states_both_ways(layout: str) -> None:
    kv, config = engine_cache(layout, {"enc": pooled()})
    names = list(config.kv_cache_groups[0].layer_names)
    assert {tuple(kv[n].shape) for n in names} == {(B, H, N * POOL, 2 * C)}  # AttentionSpec.num_states per block
    write(kv, names)
    (group,) = kvgen.from_vllm(kv, config, vllm_layouts.KVCacheLayout[layout], engine_version=VERSION)
    assert group.detection.layout == POOLED[layout]
    # a token's states: 4 object rows
    assert group.connector.get_shape(len(SLOTS), group.kvcaches) == (2, L, len(SLOTS) * POOL, H * C)
    obj = MemoryObj(torch.zeros(2, L, len(SLOTS) * POOL, H * C))
    group.connector.from_gpu(obj, 0, len(SLOTS), kvcaches=group.kvcaches, slot_mapping=torch.tensor(SLOTS))
    assert torch.equal(obj.tensor, expected(kv, names, states_of(SLOTS), 2))  # SLOTS are the manager's
    fresh, fresh_config = engine_cache(layout, {"enc": pooled()})
    (target,) = kvgen.from_vllm(fresh, fresh_config, layout, engine_version=VERSION)
    load(target, obj, SLOTS)
    assert torch.equal(read_back(fresh, names, states_of(SLOTS)), read_back(kv, names, states_of(SLOTS)))
    untouched = sorted(set(range(B * N * POOL)) - set(states_of(SLOTS)))
    assert not read_back(fresh, names, untouched).any()


def test_a_pooled_cache_is_read_only_as_the_engine_declares_it() -> None:
    kv, config = engine_cache("LBNHC", {"enc": pooled()})
    views = [kv[n] for n in config.kv_cache_groups[0].layer_names]
    hints = {"engine": "vllm", "engine_version": VERSION, "kv_layout": "LBNHC", "num_kv_heads": H, "block_size": N}
    with pytest.raises(NoLayout, match=r"vllm_whisper_pooled4: .*only tokens_per_state=Fraction\(1, 4\)"):
        detect(views, **hints)  # the tensors are LBNHC's: block_size says states are not tokens, nothing says what
    assert detect(views, **hints, tokens_per_state=Fraction(1, POOL)).layout == "vllm_whisper_pooled4"
    with pytest.raises(NoLayout, match="tokens_per_state=1/2, the spec stores 1/4 tokens per slot"):
        detect(views, **hints, tokens_per_state="1/2")
    other, other_config = engine_cache("LBNHC", {"enc": pooled(2)})
    with pytest.raises(NoLayout, match="vllm_whisper_pooled4: tokens_per_state=1/2"):
        kvgen.from_vllm(other, other_config, engine_version=VERSION)  # a pool of 2 has no spec yet


# -- `kvgen verify`: the hand-written facts against vLLM's live caches ----------------------------

def test_kvgen_verify_checks_the_vllm_facts_against_vllms_live_caches(capsys: pytest.CaptureFixture[str]) -> None:
    from kvgen.tools.verify import engines as verify_engines

    # the KVCacheLayout table, each layout's fact and the MLA fact under each layout, and the canonical
    # offload pages v1-nhd, v1-hnd and MLA
    assert verify_engines.vllm_disagreements() == ([], 1 + 2 * len(LAYOUTS) + 3)
    verify_engines.run()
    assert f"16 of 16 vLLM {VERSION} cache facts agree with the engine's live caches" in capsys.readouterr().out


def test_a_wrong_vllm_fact_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvgen.oracle.facts import layouts as facts
    from kvgen.tools.verify import engines as verify_engines

    right = facts.FACTS["vllm_lbnhc"]

    def hnd_shape(g: Any) -> tuple[int, ...]:  # LBHNC's reading of an LBNHC view
        return (g.B, g.H, g.N, 2 * g.C)

    def v_first(g: Any, layer: int, kv: int, slot: int, h: int, c: int) -> Any:  # K and V swapped
        return (layer,), (slot // g.N, slot % g.N, h, (1 - kv) * g.C + c)

    for shape, address in ((hnd_shape, right.address), (right.shape, v_first)):
        monkeypatch.setitem(facts.FACTS, "vllm_lbnhc", dataclasses.replace(right, shape=shape, address=address))
        wrong, _ = verify_engines.vllm_disagreements()
        assert len(wrong) == 1 and wrong[0].startswith("vllm_lbnhc:"), wrong
    monkeypatch.setitem(facts.FACTS, "vllm_lbnhc", right)
    page = facts.FACTS["vllm_canonical_lbnhc"]

    def heads_first(g: Any, layer: int, kv: int, slot: int, h: int, c: int) -> Any:  # v1-hnd's place, v1-nhd's shape
        flat = ((h * g.N + slot % g.N) * 2 + kv) * g.C + c
        return (), (slot // g.N, layer, flat // (g.H * 2 * g.C), flat // (2 * g.C) % g.H, flat % (2 * g.C))

    monkeypatch.setitem(facts.FACTS, "vllm_canonical_lbnhc", dataclasses.replace(page, address=heads_first))
    wrong, _ = verify_engines.vllm_disagreements()
    assert len(wrong) == 1 and wrong[0].startswith("vllm_canonical_lbnhc:"), wrong
    monkeypatch.setitem(facts.FACTS, "vllm_canonical_lbnhc", page)
    # a wrong table entry
    monkeypatch.setitem(facts_vllm.KV_CACHE_LAYOUTS, "LBNHC", vllm_layouts.KVCacheLayout.LBHNC.value)
    wrong, _ = verify_engines.vllm_disagreements()
    assert wrong and wrong[0].startswith("KVCacheLayout:")
    assert verify_engines.run() == len(wrong)


def test_kvgen_verify_says_why_the_vllm_checks_were_skipped(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.metadata
    import importlib.util

    from kvgen.tools.verify import engines as verify_engines

    found, version = importlib.util.find_spec, importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.34.0" if name == "vllm" else version(name))
    verify_engines.run()
    assert f"vLLM {VERSION} engine checks skipped: vllm 0.34.0 is installed, these facts describe {VERSION}" \
        in capsys.readouterr().out
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else found(name, *a))
    assert verify_engines.run() == 0
    assert f"vLLM {VERSION} engine checks skipped: vllm is not installed in this Python" in capsys.readouterr().out
