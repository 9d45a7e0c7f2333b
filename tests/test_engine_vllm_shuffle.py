"""vLLM 0.33's ROCm AITER SHUFFLE cache (vllm/v1/attention/backends/rocm_aiter_fa.py, kv_cache_layout
"SHUFFLE") as the oracle, bound by kvgen.from_vllm(..., layout="SHUFFLE") to the vectorized_5d specs.

The cache is made by vLLM's own functions on CPU: AiterFlashAttentionBackend.customize_spec (K and V as
two head slots of num_kv_heads * head_size values), get_kv_cache_config_from_groups and allocate_kv_cache
under LHBNC (the sides planes of whole blocks) and LBHNC (the sides alternating block by block), split
into K and V by AiterFlashAttentionImpl._split_kv_cache; from_vllm binds both.
`is_shuffle_kv_cache_enabled` answers only on ROCm with AITER (if_aiter_supported), so the tests make it
answer True. Values are written by vLLM's own writer, reshape_and_cache_shuffle_triton and its Triton
kernel (defined only on ROCm: compiled from vLLM's source file, run in Triton's interpreter; fp8 caches
are copied as their uint8 storage, kv_cache_dtype "auto", so no quantization changes a byte), and the
tests also restate that kernel's offsets (rocm_aiter_fa.py, reshape_and_cache_shuffle_kernel: K at block
* stride0 + h * hs * N + d // x * N * x + n * x + d % x, V at block * stride0 + h * hs * N + n // x * hs
* x + d * x + n % x) and check the writer against them. Every value's bits code its layer, side, slot,
head and position; kvgen stores the slots into a kv_planes object (K's and V's rows in token order),
loads them into a fresh vLLM cache at other slots, where every byte must be what vLLM's writer puts
there; the spec's own address arithmetic must find every value; a spec with K and V or a tile and its
place swapped does not.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from harness import builtin_library, tile_codes, vllm_module

iface = vllm_module("vllm.v1.kv_cache_interface")
planning = vllm_module("vllm.v1.core.kv_cache_planning")
worker = vllm_module("vllm.v1.worker.utils")
vllm_layouts = vllm_module("vllm.v1.kv_cache_layout")
aiter_fa = vllm_module("vllm.v1.attention.backends.rocm_aiter_fa")
rocm_attn = vllm_module("vllm.v1.attention.backends.rocm_attn")
aiter_ops = vllm_module("vllm._aiter_ops")

import kvgen  # noqa: E402
from kvgen.oracle.address import plane_address  # noqa: E402
from kvgen.runtime import KVLayoutError, MemoryObj  # noqa: E402
from kvgen.spec.library import load_specs  # noqa: E402
from kvgen.spec.model import Spec  # noqa: E402

LIBRARY = builtin_library()
#: block_size 32 (a multiple of 16, as customize_spec asks), head_size 64 (a supported size): x 8 gives
#: K [B, H, 8, 32, 8] and V [B, H, 4, 64, 8], x 16 K [B, H, 4, 32, 16] and V [B, H, 2, 64, 16].
L, B, N, H, HS = 2, 5, 32, 2, 64
SLOTS = [1, 7, 8, 40, 63, 64, 100, 159]  # both sides of tile edges (8 and 16), four blocks
AGAIN = [33, 2, 130, 16, 9, 95, 64, 150]
T = len(SLOTS)
#: (vLLM's cache dtype, x = 16 // its element size, the spec).
DTYPES = [(torch.bfloat16, 8, "sglang_mha_vectorized_5d"), (torch.float16, 8, "sglang_mha_vectorized_5d"),
          (torch.uint8, 16, "sglang_mha_vectorized_5d_fp8")]
#: Under LHBNC each side is a plane of whole blocks; under LBHNC (which vLLM also lists for SHUFFLE)
#: the sides alternate block by block, and vLLM's writer places them by the block stride.
CASES = [(*d, layout) for d in DTYPES for layout in ("LHBNC", "LBHNC")]
IDS = [f"{str(d[0]).removeprefix('torch.')}-{d[3]}" for d in CASES]


@pytest.fixture(autouse=True)
def shuffle_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's SHUFFLE switch (VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT, read only where AITER runs) on, and
    Triton's interpreter for the writer kernel compiled below."""
    monkeypatch.setattr(aiter_ops.rocm_aiter_ops, "is_shuffle_kv_cache_enabled", staticmethod(lambda: True))
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@functools.cache
def vllm_writer() -> Any:
    """reshape_and_cache_shuffle_triton and its kernel, compiled from rocm_aiter_fa.py's ROCm-only block."""
    import triton
    import triton.language as tl

    origin = importlib.util.find_spec("vllm.v1.attention.backends.rocm_aiter_fa").origin
    tree = ast.parse(Path(origin).read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and "is_rocm" in ast.unparse(n.test))
    wanted = ("reshape_and_cache_shuffle_kernel", "reshape_and_cache_shuffle_triton")
    nodes = [n for n in block.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert [n.name for n in nodes] == list(wanted)
    scope = {"torch": torch, "triton": triton, "tl": tl, "is_quantized_kv_cache": aiter_fa.is_quantized_kv_cache}
    exec(compile(ast.Module(nodes, type_ignores=[]), origin, "exec"), scope)  # noqa: S102 - vLLM's code
    return scope["reshape_and_cache_shuffle_triton"]


def allocate(dtype: torch.dtype, layout: str, backend: Any = None) -> tuple[dict[str, torch.Tensor], Any]:
    """vLLM's layer name -> view dict (zeros) and its KVCacheConfig, the spec made by the backend."""
    spec = (backend or aiter_fa.AiterFlashAttentionBackend).customize_spec(
        iface.FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=HS, dtype=dtype))
    group = iface.KVCacheGroupSpec([f"attn.{i}" for i in range(L)], spec)
    cache = SimpleNamespace(get_resolved_kv_cache_layout=lambda: vllm_layouts.KVCacheLayout[layout],
                            prefix_cache_retention_interval=None, num_gpu_blocks_override=B)
    vllm_config = SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=None), cache_config=cache)
    config = planning.get_kv_cache_config_from_groups(vllm_config, [group], 1 << 30)
    config.kv_cache_layout = layout
    kv = worker.allocate_kv_cache(config, torch.device("cpu"), vllm_layouts.KVCacheLayout[layout])
    for view in kv.values():
        view.zero_()
    return kv, config


def sides(view: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) [B, N, H, hs] as the backend splits a layer's view (_split_kv_cache)."""
    impl = SimpleNamespace(num_kv_heads=H, head_size=HS)
    return aiter_fa.AiterFlashAttentionImpl._split_kv_cache(impl, view)


def bits(layer: int, kv: int, tokens: list[int], dtype: torch.dtype) -> torch.Tensor:
    """[tokens, H, HS] bit patterns of the storage dtype (harness.tile_codes)."""
    return tile_codes(layer, kv, tokens, H, HS, dtype)


def written(dtype: torch.dtype, layout: str, slots: list[int], codes: list[int] | None = None) -> dict[str, Any]:
    """A cache vLLM's writer filled at `slots` with the inputs of tokens `codes` (default: the slots)."""
    kv, _ = allocate(dtype, layout)
    for layer in range(L):
        key, value = (bits(layer, side, codes or slots, dtype).view(dtype) for side in (0, 1))
        k, v = sides(kv[f"attn.{layer}"])
        vllm_writer()(key, value, k, v, torch.tensor(slots), "auto", torch.ones(1), torch.ones(1))
    return kv


def shuffle_offset(side: torch.Tensor, kv: int, x: int, slot: int, h: int, d: int) -> int:
    """The element offset (from the side's storage offset) of value d of (slot, head): rocm_aiter_fa.py,
    reshape_and_cache_shuffle_kernel (k_dst_offset / dst_k_shuffle_offset, v_dst_offset /
    dst_v_shuffle_offset), the block stride taken from the side, as the launcher passes it."""
    block, n = divmod(slot, N)
    base = block * side.stride(0) + h * HS * N
    return base + (d // x * N * x + n * x + d % x if kv == 0 else n // x * HS * x + d * x + n % x)


def page_values(kv_caches: dict[str, Any], dtype: torch.dtype, x: int, slots: list[int]) -> list[torch.Tensor]:
    """Per layer and side, the [T, H, HS] bit patterns at `slots`, read at vLLM's shuffle offsets."""
    store = torch.int16 if dtype != torch.uint8 else torch.uint8
    out = []
    for layer in range(L):
        for kv, side in enumerate(sides(kv_caches[f"attn.{layer}"])):
            flat = side.view(store).as_strided((side.untyped_storage().nbytes() // side.element_size(),), (1,), 0)
            at = torch.tensor([[[side.storage_offset() + shuffle_offset(side, kv, x, s, h, d) for d in range(HS)]
                                for h in range(H)] for s in slots])
            out.append(flat[at])
    return out


@pytest.mark.parametrize(("dtype", "x", "spec", "layout"), CASES, ids=IDS)
def test_vllms_writer_puts_each_value_at_the_shuffle_offsets(dtype: torch.dtype, x: int, spec: str,
                                                             layout: str) -> None:
    """vLLM's writer kernel places every value at the offsets its source states, and nothing else."""
    kv = written(dtype, layout, SLOTS)
    values = page_values(kv, dtype, x, SLOTS)
    for layer in range(L):
        for side in (0, 1):
            assert torch.equal(values[2 * layer + side], bits(layer, side, SLOTS, dtype))
        assert int(kv[f"attn.{layer}"].count_nonzero()) == 2 * T * H * HS


def misplaced(spec: Spec, kvcaches: Any, dtype: torch.dtype) -> int:
    """How many values of the cache vLLM's writer filled at SLOTS the spec's address arithmetic does
    not find (a value it addresses outside the tensors counts too)."""
    ext = {"L": L, "B": B, "N": N, "H": H, "C": HS, "C.k": HS, "C.v": HS}
    wrong = 0
    for plane in spec.moved_planes():
        for layer in range(L):
            want = bits(layer, plane.index, SLOTS, dtype)
            got = kvcaches[plane.index][layer].view(want.dtype)
            for t, slot in enumerate(SLOTS):
                for h in range(H):
                    for c in range(HS):
                        _, index, _ = plane_address(spec, plane, {"l": layer, "slot": slot, "h": h, "c": c}, ext, 2)
                        inside = all(0 <= i < n for i, n in zip(index, got.shape, strict=True))
                        wrong += not inside or int(got[index] != want[t, h, c])
    return wrong


@pytest.mark.parametrize(("dtype", "x", "spec", "layout"), CASES, ids=IDS)
def test_from_vllm_binds_the_shuffle_cache_and_the_spec_finds_every_value(dtype: torch.dtype, x: int, spec: str,
                                                                         layout: str) -> None:
    kv, config = allocate(dtype, layout)
    filled = written(dtype, layout, SLOTS)
    for name in kv:
        kv[name].copy_(filled[name])
    (group,) = kvgen.from_vllm(kv, config, "SHUFFLE")
    assert (group.detection.layout, group.layer_names) == (spec, tuple(f"attn.{i}" for i in range(L)))
    k0 = group.kvcaches[0][0]
    assert k0.untyped_storage().data_ptr() == kv["attn.0"].untyped_storage().data_ptr()  # views, no copy
    assert tuple(k0.shape) == (B, H, HS // x, N, x) and tuple(group.kvcaches[1][0].shape) == (B, H, N // x, HS, x)
    assert misplaced(LIBRARY[spec], group.kvcaches, dtype) == 0


def mutated(layout: str, parts: tuple[str, str], tmp_path: Path) -> Spec:
    """The built-in spec with its parts' dims replaced by `parts` (K's, V's), loaded from a copy."""
    text, done = [], 0
    for line in Path(LIBRARY[layout].source).read_text().splitlines():
        if line.startswith(("  k: {dims:", "  v: {dims:")):
            line = f"  {line.strip()[0]}: {{dims: {parts[done]}, dtypes: [{line.split('dtypes: [')[1]}"
            done += 1
        text.append(line)
    path = tmp_path / f"{layout}.yaml"
    path.write_text("\n".join(text) + "\n")
    return load_specs([path])[0][0]


@pytest.mark.parametrize("parts", [("[B, H, N/8, C, N%8]", "[B, H, C/8, N, C%8]"),
                                   ("[B, H, C%8, N, C/8]", "[B, H, N/8, C, N%8]"),
                                   ("[B, H, C/8, N, C%8]", "[B, H, N%8, C, N/8]")],
                         ids=["k-v-swapped", "k-tile-place-swapped", "v-tile-place-swapped"])
def test_a_wrong_spec_misses_what_vllm_writes(parts: tuple[str, str], tmp_path: Path) -> None:
    kv, config = allocate(torch.bfloat16, "LHBNC")
    filled = written(torch.bfloat16, "LHBNC", SLOTS)
    for name in kv:
        kv[name].copy_(filled[name])
    (group,) = kvgen.from_vllm(kv, config, "SHUFFLE")
    assert misplaced(mutated("sglang_mha_vectorized_5d", parts, tmp_path), group.kvcaches, torch.bfloat16) > 0


@pytest.mark.parametrize("backend", [None, "torch"], ids=["default", "torch"])
@pytest.mark.parametrize(("dtype", "x", "spec", "layout"), CASES, ids=IDS)
def test_the_shuffle_cache_moves_both_ways(dtype: torch.dtype, x: int, spec: str, layout: str,
                                           backend: str | None) -> None:
    """Stored from SLOTS, each layer's object holds K's then V's rows in token order; loaded at AGAIN
    into a fresh cache, every byte is what vLLM's writer puts there, read back at vLLM's offsets."""
    source, source_config = allocate(dtype, layout)
    filled = written(dtype, layout, SLOTS)
    for name in source:
        source[name].copy_(filled[name])
    (out,) = kvgen.from_vllm(source, source_config, "SHUFFLE", backend=backend)
    obj = MemoryObj(torch.zeros(tuple(out.connector.get_shape(T)), dtype=torch.uint8))
    out.connector.from_gpu(obj, 0, T, kvcaches=out.kvcaches, slot_mapping=torch.tensor(SLOTS))
    region = T * H * HS * torch.empty(0, dtype=dtype).element_size()  # a multiple of 16 bytes
    for layer in range(L):
        for side in (0, 1):
            want = bits(layer, side, SLOTS, dtype)
            stored = obj.tensor[layer, side * region:(side + 1) * region].view(want.dtype)
            assert torch.equal(stored.reshape(T, H, HS), want)
    fresh, fresh_config = allocate(dtype, layout)
    (back,) = kvgen.from_vllm(fresh, fresh_config, "SHUFFLE", backend=backend)
    back.connector.to_gpu(obj, 0, T, kvcaches=back.kvcaches, slot_mapping=torch.tensor(AGAIN))
    want_cache = written(dtype, layout, AGAIN, SLOTS)
    for name in fresh:
        assert torch.equal(fresh[name].view(torch.uint8), want_cache[name].view(torch.uint8))  # every byte
    for got, want in zip(page_values(fresh, dtype, x, AGAIN), page_values(source, dtype, x, SLOTS), strict=True):
        assert torch.equal(got, want)


def test_the_same_kv_cache_spec_is_not_shuffle_without_the_word() -> None:
    """ROCM_ATTN publishes the same KVCacheSpec (two head slots of H * hs values) with other cells
    (PagedAttention.split_kv_cache's), so the views never decide: without layout="SHUFFLE" the
    packed cells are refused, and the word refuses a cache that is no SHUFFLE cache."""
    kv, config = allocate(torch.bfloat16, "LHBNC")
    other = allocate(torch.bfloat16, "LHBNC", rocm_attn.RocmAttentionBackend)[1]
    assert other.kv_cache_groups[0].kv_cache_spec == config.kv_cache_groups[0].kv_cache_spec
    with pytest.raises(KVLayoutError, match="packs its cells"):
        kvgen.from_vllm(kv, config)
    plain = iface.FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=HS, dtype=torch.bfloat16)
    config.kv_cache_groups[0] = iface.KVCacheGroupSpec(list(config.kv_cache_groups[0].layer_names), plain)
    with pytest.raises(KVLayoutError, match="is not ROCm AITER's SHUFFLE cache"):
        kvgen.from_vllm(kv, config, "SHUFFLE")


def test_under_lbhnc_each_sides_pages_are_apart_element_by_element() -> None:
    """K's and V's pages interleave in one allocation, each tiled otherwise ([H, C/x, N, x] and
    [H, N/x, C, x]); the binding's memory check sees that they share no element, and still refuses a
    V whose pages are K's own."""
    kv, config = allocate(torch.bfloat16, "LBHNC")
    (group,) = kvgen.from_vllm(kv, config, "SHUFFLE")
    k, v = group.kvcaches[0][0], group.kvcaches[1][0]
    assert k.stride(0) == v.stride(0) == 2 * N * H * HS  # one K page, then one V page, per block
    assert v.data_ptr() - k.data_ptr() == N * H * HS * k.element_size()
    aliased = k.as_strided(v.shape, v.stride())  # V's tiling over K's pages
    with pytest.raises(KVLayoutError, match=r"kvcaches\[0\]\[0\] and kvcaches\[1\]\[0\] are the same memory"):
        group.connector.bind([[k, group.kvcaches[0][1]], [aliased, group.kvcaches[1][1]]])


def test_a_shuffle_cache_whose_pages_overlap_is_refused() -> None:
    kv, config = allocate(torch.bfloat16, "LBHNC")
    view = kv["attn.0"]
    kv["attn.0"] = view.as_strided(view.shape, (view.stride(0), view.stride(1) // 2, *view.stride()[2:]))
    with pytest.raises(KVLayoutError, match="overlap its pages"):
        kvgen.from_vllm(kv, config, "SHUFFLE")
