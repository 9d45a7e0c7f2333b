"""Layout detection: every built-in layout is found, every ambiguity is refused with the
hint that decides it, every engine narrows correctly, strides are a fact, and nothing is
guessed. Caches are built from the specs by the reference (kvgen.oracle), not by detection.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from fractions import Fraction

import pytest
import torch
from harness import builtin_library

import kvgen
from kvgen import generated
from kvgen.integrations.detect import (
    AmbiguousLayout,
    CacheShape,
    LayoutFacts,
    NoLayout,
    detect,
    detectable,
    layout_facts,
    memory_order,
)
from kvgen.integrations.shapes import map_leaves
from kvgen.oracle import reference
from kvgen.oracle.scenarios import EXT, make_cache
from kvgen.runtime import KVLayoutError

LIBRARY = builtin_library()
PAGED = [s.name for s in LIBRARY.paged if detectable(generated.LAYOUTS[s.name])]
#: A KVCacheLayout each pooled vLLM spec (no name of its own) is the cache of: one of its per-layer order.
POOLED_UNDER = {"vllm_whisper_pooled4": "LBNHC", "vllm_whisper_pooled4_hnd": "LBHNC",
                "vllm_whisper_pooled4_heads_first": "LHBNC"}
#: Geometries where extents coincide, the only way two layouts can share a shape.
TIES = [{}, {"N": 2}, {"B": 2}, {"N": 1}, {"H": 1}, {"B": 2, "N": 2, "H": 2}, {"L": 2}, {"H": 4},
        {"B": 4, "N": 4, "H": 4}, {"L": 2, "B": 2}]
#: Pairs that must be among the ambiguities found (the field's known traps).
KNOWN = {("vllm_flash_attn_hnd", "vllm_flash_attn_nhd"), ("vllm_flashinfer_hnd", "vllm_flashinfer_nhd"),
         ("vllm_flash_attn_nhd", "vllm_flashinfer_nhd"), ("vllm_packed_hnd", "vllm_packed_nhd"),
         ("sglang_mla", "vllm_mla"), ("trtllm_pool", "vllm_cross_layer"),
         ("vllm_blocks_first_hnd", "vllm_blocks_first_nhd")}


def _family(name: str) -> str:
    return generated.LAYOUTS[name]["engines"][0].split("/")[0].split("-")[0].replace("tensorrt_llm", "trtllm")


def _release(name: str) -> str | None:
    """A release of the spec's engine it describes (vLLM: 0.33 for the KVCacheLayout specs, 0.32 for
    the older ones), so detection does not depend on which vllm is installed here."""
    if _family(name) != "vllm":
        return None
    return "0.33.0" if ">=0.33" in dict(LIBRARY[name].versions).get("vllm", "") else "0.32.0"


def _handed_over(name: str) -> tuple[int, ...]:
    """The memory-order dim each dim of what the engine hands over holds (`given`; else as is)."""
    spec = LIBRARY[name]
    perm = detect_facts(name).given_permutation() if spec.given else tuple(range(len(spec.dims)))
    return tuple(perm.index(j) for j in range(len(perm)))


def detect_facts(name: str) -> LayoutFacts:
    return next(f for f in layout_facts() if f.name == name)


def _shape(name: str, ext: dict[str, int]) -> CacheShape:
    spec = LIBRARY[name]
    memory = reference.layouts.leaf_shape(spec, ext)
    return CacheShape(tuple(ext[a] for a in spec.lists), tuple(memory[i] for i in _handed_over(name)), None,
                      "float32")


def _facts(name: str, ext: dict[str, int]) -> dict[str, object]:
    """Every hint a deployment knows (LMCache's metadata and the engine)."""
    spec = LIBRARY[name]
    mla = generated.LAYOUTS[name]["planes"] == 1
    hints: dict[str, object] = {"engine": _family(name), "num_layers": ext["L"], "head_size": ext["C"],
                                "num_kv_heads": 1 if mla else ext["H"], "use_mla": mla}
    if _release(name):
        hints["engine_version"] = _release(name)
    per = _slots_per_token(name)
    if any(d.axes == ("N",) for d in spec.dims):
        hints["block_size"] = ext["N"] // per  # a block of tokens stored as `per` slots each
    if per > 1:  # vLLM's KVCacheSpec states it; a pooled cache's tensors are its base layout's
        hints["tokens_per_state"] = Fraction(1, per)
    return hints


def _slots_per_token(name: str) -> int:
    return int(generated.LAYOUTS[name].get("slots_per_token", 1))


def _fits(cache: CacheShape, **hints: object) -> set[str]:
    try:
        return {detect(cache, **hints).layout}
    except AmbiguousLayout as e:
        return set(e.candidates)
    except NoLayout:
        return set()


@pytest.mark.parametrize("name", PAGED)
def test_every_layout_is_detected_from_a_live_cache(name: str) -> None:
    memory = make_cache(LIBRARY[name], torch.float32, "cpu")
    cache = map_leaves(memory, lambda t: t.permute(*_handed_over(name)))  # as the engine hands it over
    hints = _facts(name, EXT)
    found = _fits(_shape(name, EXT), **hints)
    if found != {name}:  # the cache alone cannot say: the engine's layout hint decides
        hints["kv_layout"] = (generated.LAYOUTS[name]["aliases"] or (POOLED_UNDER[name],))[0]
    got = detect(cache, **hints)
    assert got.layout == name
    assert got.lmcache == generated.LAYOUTS[name]["lmcache"]
    for axis in ("L", "KV", "H", "C"):
        if LIBRARY[name].has(axis):
            assert got.extents[axis] == EXT[axis]
    if LIBRARY[name].given:  # read in the declared order, the view is the memory order
        assert all(v.stride() == m.stride() and v.shape == m.shape and v.data_ptr() == m.data_ptr()
                   for v, m in zip(got.view(cache), memory, strict=True)) and "given" in got.decided_by
    else:
        assert got.view(cache) is cache  # contiguous: handed over as it is


def test_ambiguities_are_refused_and_each_candidate_has_a_deciding_hint() -> None:
    seen: set[tuple[str, str]] = set()
    same: set[tuple[str, ...]] = set()
    for name, tie in itertools.product(PAGED, TIES):
        ext = {**EXT, **tie}
        ext["N"] *= _slots_per_token(name)  # a pooled block stores whole tokens
        cache = _shape(name, ext)
        if _slots_per_token(name) > 1:  # never read from the tensors alone: only tokens_per_state selects it
            assert name not in _fits(cache), f"{name} {tie}: a pooled layout was read from the tensors alone"
        for hints in ({}, _facts(name, ext)) if _slots_per_token(name) == 1 else (_facts(name, ext),):
            fits = _fits(cache, **hints)
            assert name in fits, f"{name} {tie}: detection lost the true layout with {hints}"
            if len(fits) == 1:
                continue
            seen.update(itertools.combinations(sorted(fits), 2))
            with pytest.raises(AmbiguousLayout) as err:
                detect(cache, **hints)
            assert all(c in str(err.value) for c in fits)
            decide = err.value.candidates[name]
            assert decide["layout"] == name
            assert detect(cache, **{**hints, **decide}).layout == name
            facts = {k: v for k, v in decide.items() if k != "layout"}
            try:  # the facts alone decide, or leave only layouts that no fact tells apart
                assert detect(cache, **{**hints, **facts}).layout == name
            except AmbiguousLayout as left:
                same.add(tuple(sorted(left.candidates)))
    missing = KNOWN - seen
    assert not missing, f"ambiguities not found: {missing}"
    # only these share every fact a hint can state (the layout's name decides):
    # [B L H N 2C] / [B H L N 2C] when L == H, [B H N 2C] / [H B N 2C] when B == H, and
    # [2 B N H C] / [B N H 2 C] when B == 2
    assert same == {("vllm_blocks_first_hnd", "vllm_blocks_heads_first"), ("vllm_heads_first", "vllm_packed_hnd"),
                    ("vllm_flash_attn_nhd", "vllm_packed_nhd_5d")}


@pytest.mark.parametrize("name", PAGED)
def test_engines_narrow_to_their_own_layouts(name: str) -> None:
    cache = _shape(name, EXT)
    base = {k: v for k, v in _facts(name, EXT).items() if k != "engine"}
    for engine in ("vllm", "sglang", "trtllm"):
        fits = _fits(cache, engine=engine, **base)
        if engine == _family(name):
            assert name in fits
        else:
            assert name not in fits
            assert all(_family(f) == engine for f in fits)
    if _family(name) != "trtllm":
        with pytest.raises(NoLayout, match="engine 'trtllm'"):
            detect(cache, **{**base, "engine": "trtllm", "layout": name})


def test_lmcache_engine_type_enum_is_an_engine_hint() -> None:
    class EngineType:  # LMCache's enum members carry the engine name as .value
        value = "sglang"

    cache = _shape("sglang_mla", {**EXT, "N": 1})
    with pytest.raises(AmbiguousLayout):
        detect(cache)
    assert detect(cache, engine=EngineType()).layout == "sglang_mla"


def test_vllm_hnd_logical_view_is_found_by_its_strides() -> None:
    physical = make_cache(LIBRARY["vllm_flash_attn_hnd"], torch.float32, "cpu")  # [2, B, H, N, C]
    logical = [t.permute(0, 1, 3, 2, 4) for t in physical]  # what vLLM hands over: [2, B, N, H, C]
    hints = {"num_kv_heads": EXT["H"], "head_size": EXT["C"]}
    got = detect(logical, **hints)
    assert got.layout == "vllm_flash_attn_hnd" and got.permuted and "strides" in got.decided_by
    view = got.view(logical)
    assert all(v.data_ptr() == p.data_ptr() and v.shape == p.shape and v.stride() == p.stride()
               for v, p in zip(view, physical, strict=True))
    # the shape alone says NHD: only the strides tell
    assert detect(CacheShape((EXT["L"],), tuple(logical[0].shape)), **hints).layout == "vllm_flash_attn_nhd"


def test_equal_heads_and_block_size_strides_and_vllm_order_decide() -> None:
    ext = {**EXT, "H": 4, "N": 4}
    spec = LIBRARY["vllm_flash_attn_hnd"]
    physical = [torch.zeros(reference.layouts.leaf_shape(spec, ext)) for _ in range(ext["L"])]
    logical = [t.permute(0, 1, 3, 2, 4) for t in physical]
    with pytest.raises(AmbiguousLayout, match="kv_layout='HND'"):
        detect(logical)  # memory order alone: [2, B, 4, 4, C] is NHD or HND
    old = {"engine": "vllm", "engine_version": "0.32"}  # before KVCacheLayout: the two-plane caches
    assert detect(logical, **old).layout == "vllm_flash_attn_hnd"  # vLLM permutes to N-before-H
    with pytest.raises(AmbiguousLayout):
        detect(physical, **old)  # contiguous: nothing says which 4 is which
    assert detect(physical, **old, given_order="NHD").layout == "vllm_flash_attn_nhd"
    assert detect(physical, kv_layout="HND").layout == "vllm_flash_attn_hnd"


def test_memory_order_keeps_singletons_in_place() -> None:
    t = torch.zeros(2, 5, 3, 1, 4, 6).permute(0, 1, 4, 3, 2, 5)  # RBLN-like with N and H swapped
    assert memory_order(t.shape, t.stride()) == (0, 1, 4, 3, 2, 5)


def test_no_fit_says_which_facts_disagreed() -> None:
    with pytest.raises(NoLayout) as err:
        detect(CacheShape((3,), (2, 12, 4, 2, 4), None, "float32"), num_kv_heads=3)
    text = str(err.value)
    assert "num_kv_heads=3" in text and "vllm_flash_attn_nhd" in text
    assert "rank" in err.value.reasons["vllm_mla"]
    with pytest.raises(NoLayout, match="dtype int16"):
        detect(CacheShape((3,), (2, 12, 4, 2, 4), None, "int16"), layout="NHD")


def test_bad_caches_and_hints_are_refused() -> None:
    with pytest.raises(KVLayoutError, match="equally long"):
        detect([[torch.zeros(4, 2)], [torch.zeros(4, 2), torch.zeros(4, 2)]])
    with pytest.raises(KVLayoutError, match="one shape"):
        detect([torch.zeros(2, 3, 4, 2, 4), torch.zeros(2, 4, 4, 2, 4)])
    with pytest.raises(TypeError, match="unknown hint 'heads'"):
        detect(CacheShape((3,), (2, 12, 4, 2, 4)), heads=2)
    with pytest.raises(KVLayoutError, match="hints disagree"):
        detect(CacheShape((3,), (2, 12, 4, 2, 4)), kv_shape=(3, 2, 16, 2, 4), num_kv_heads=4)
    with pytest.raises(KVLayoutError, match="no layout or object named"):
        detect(CacheShape((3,), (2, 12, 4, 2, 4)), layout="nope")


def test_lmcache_hint_names_are_accepted() -> None:
    cache = _shape("vllm_flash_attn_nhd", {**EXT, "H": 4, "N": 4})
    got = detect(cache, tokens_per_block=4, head_dim=4, kv_shape=(3, 2, 256, 4, 4), kv_layout="NHD")
    assert got.layout == "vllm_flash_attn_nhd"


def test_kvgen_detect_is_exported_lazily_and_import_stays_torch_free() -> None:
    assert kvgen.detect is detect
    code = "import sys, kvgen; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_detect_prints_the_layout_and_refuses_ambiguity(capsys: pytest.CaptureFixture[str]) -> None:
    from kvgen.tools.cli import main

    assert main(["detect", "32x[2,1000,16,8,128]", "--num-kv-heads", "8", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("vllm_flash_attn_nhd (LMCache format: NL_X_TWO_NB_BS_NH_HS)") and "as given" in out
    # vLLM's HND logical view: the strides say HND, the engine says the given order is N-before-H
    assert main(["detect", "32x[2,1000,16,8,128]", "--stride", "2048000,16384,128,2048,1", "--engine", "vllm",
                 "--engine-version", "0.32", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"layout": "vllm_flash_attn_hnd"' in out and '"permutation": [\n    0,\n    1,\n    3,\n    2' in out
    assert main(["detect", "32x[2,1000,8,8,128]", "--num-kv-heads", "8"]) == 1
    err = capsys.readouterr().err
    assert "kvgen does not guess" in err and "kv_layout='HND'" in err and "kv_layout='NHD'" in err
    assert main(["detect", "2x32x[4096,8,128]", "--engine", "sglang", "--no-mla"]) == 0
    assert capsys.readouterr().out.startswith("sglang_mha")
    assert main(["detect", "32x2,3"]) == 1
    assert "write list lengths" in capsys.readouterr().err


def test_only_single_tree_kv_and_mla_caches_are_detected() -> None:
    """Caches of several parts or typed fields, K or V alone, and host pools are named, never detected."""
    left = {s.name for s in LIBRARY.paged} - set(PAGED)
    assert left == {s.name for s in LIBRARY.paged
                    if not s.is_simple or (s.planes == 1 and s.has("H")) or s.placement == "host"}
    assert "vllm_offload_nhd" in left and "vllm_cross_layer" in PAGED  # one arrangement, two places
    assert "vllm_flash_attn_nhd" in PAGED and "vllm_mla" in PAGED and "vllm_mla_fp8" in left
    cache = [torch.zeros(12, 4, 656, dtype=torch.uint8) for _ in range(3)]
    with pytest.raises(KVLayoutError, match="take its connector by name"):
        detect(cache, kv_layout="vllm_mla_fp8")


def test_the_engine_release_picks_the_specs_and_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvgen.integrations import hints as detect_hints

    handed = CacheShape((3,), (12, 2, 4, 8), (64, 8, 16, 1), "float32")  # vLLM 0.33 LBNHC: [B, H, N, C] view
    old = CacheShape((3,), (2, 12, 4, 2, 4), None, "float32")  # vLLM 0.32 FlashAttention NHD
    hints = {"engine": "vllm", "num_kv_heads": 2, "block_size": 4}
    assert detect(handed, engine_version="0.33.1", kv_layout="NHD", **hints).layout == "vllm_lbnhc"
    assert detect(old, engine_version="0.32", kv_layout="NHD", **hints).layout == "vllm_flash_attn_nhd"
    with pytest.raises(NoLayout, match="describes vllm <0.33, not release 0.33.0"):
        detect(old, engine_version="0.33.0", layout="vllm_flash_attn_nhd", **hints)
    with pytest.raises(NoLayout, match=r"vLLM 0.34.0 KVCacheLayout.LBNHC: kvgen has no layout for it"):
        detect(handed, engine_version="0.34.0", kv_layout="LBNHC", **hints)
    with pytest.raises(KVLayoutError, match="needs the engine"):
        detect(handed, engine_version="0.33.0")
    with pytest.raises(KVLayoutError, match="expected release numbers"):
        detect(handed, engine="vllm", engine_version="latest")
    monkeypatch.setattr(detect_hints, "installed_version", lambda engine: "0.33.0")
    assert detect(handed, kv_layout="LBNHC", **hints).layout == "vllm_lbnhc"  # the installed release
    with pytest.raises(NoLayout):
        detect(old, kv_layout="NHD", **hints)  # a 0.32 cache is not what vLLM 0.33 hands over
    monkeypatch.setattr(detect_hints, "installed_version", lambda engine: None)  # vllm not installed: every release
    with pytest.raises(AmbiguousLayout, match="engine_version"):
        detect(handed, **hints)
