"""SGLang 0.5.23's MHATokenToKVPool under kv_cache_layout "vectorized_5d" (ROCm AITER's SHUFFLE tiles) as
the oracle: specs/sglang/mha_vectorized_5d.yaml (bf16 and fp16, tiles of 8) and mha_vectorized_5d_fp8.yaml
(fp8, stored as uint8, tiles of 16).

The pool is SGLang's own class, built on CPU as SGLang builds it on ROCm with AITER
(SGLANG_AITER_KV_CACHE_LAYOUT=vectorized_5d; memory_pool.py reads that word only where `_use_aiter`,
which the tests set), and written through its own write path (`set_kv_buffer` runs the Triton writer
reshape_and_cache_shuffle_5d, here in Triton's interpreter). Its raw bytes must lie where the spec's
split axes (kvgen.oracle.address) say, and nowhere else; kvgen.from_sglang binds the pool, stores the
tokens into a kv_planes object (K's and V's rows, in token order) and loads them into an empty pool at
other slots, where every byte must be what SGLang writes at those slots itself and SGLang's reader
(gather_shuffle_5d_to_linear) must read what it read at the old ones. Every input's bits code its
layer, side, token, head and position, so a value moved from another tile or place, or K taken for V,
changes bytes the comparisons see: a spec with K and V swapped, or a tile and its place swapped, fails.

Runs in .venv-sglang (`scripts/dev engines`, or /work/main/.venv-sglang/bin/python -m pytest);
elsewhere it skips, saying why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import builtin_library, sglang_absent, tile_codes, tiled_connector

try:
    from sglang.srt.mem_cache import memory_pool as mp
except Exception as exc:  # noqa: BLE001 - any failure of SGLang's import chain
    sglang_absent(exc, "memory pools")

import kvgen  # noqa: E402
from kvgen.oracle.address import plane_address  # noqa: E402
from kvgen.runtime import KVLayoutError, MemoryObj, kernels, native  # noqa: E402
from kvgen.spec.library import load_specs  # noqa: E402
from kvgen.spec.model import Spec  # noqa: E402

LIBRARY = builtin_library()
#: head_dim and page_size 64: K and V [pages, H, 8, 64, 8] in bf16 (4 tiles of 16 in fp8), so with tiles of
#: 8 a spec with K and V, or a tile and its place, swapped still reads within the buffers.
L, H, HEAD, PAGE, SIZE = 2, 3, 64, 64, 192  # 4 pages with the padding one
SLOTS = [1, 7, 8, 70, 95, 128, 200, 255]  # both sides of tile edges (8 and 16) in every page
AGAIN = [40, 2, 130, 16, 9, 191, 64, 250]
T = len(SLOTS)
#: (the pool's dtype, its storage dtype, x = 16 // the storage itemsize, the spec).
DTYPES = [(torch.bfloat16, torch.bfloat16, 8, "sglang_mha_vectorized_5d"),
          (torch.float16, torch.float16, 8, "sglang_mha_vectorized_5d"),
          (torch.float8_e4m3fn, torch.uint8, 16, "sglang_mha_vectorized_5d_fp8")]
IDS = ["bf16", "fp16", "fp8"]


@pytest.fixture(autouse=True)
def aiter_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's ROCm AITER settings for the pool (`_use_aiter` is False off ROCm) and Triton's
    interpreter for its writer, imported (and its kernels made) under it on first use."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SGLANG_AITER_KV_CACHE_LAYOUT", "vectorized_5d")
    monkeypatch.setattr(mp, "_use_aiter", True)


class Layer:
    """What set_kv_buffer reads of SGLang's RadixAttention: the layer id."""

    def __init__(self, layer_id: int):
        self.layer_id = layer_id


def pool(dtype: torch.dtype) -> Any:
    out = mp.MHATokenToKVPool(size=SIZE, page_size=PAGE, dtype=dtype, head_num=H, head_dim=HEAD, layer_num=L,
                              device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    assert out.kv_cache_layout == "vectorized_5d"
    return out


def bits(layer: int, kv: int, tokens: list[int], store: torch.dtype) -> torch.Tensor:
    """[tokens, H, HEAD] bit patterns of the storage dtype (harness.tile_codes)."""
    return tile_codes(layer, kv, tokens, H, HEAD, store)


def written(dtype: torch.dtype, store: torch.dtype, slots: list[int], codes: list[int] | None = None) -> Any:
    """A pool SGLang's own write path filled at `slots` with the inputs of tokens `codes` (default: the
    slots themselves), each layer's K and V."""
    out = pool(dtype)
    for layer in range(L):
        k, v = (bits(layer, kv, codes or slots, store).view(dtype) for kv in (0, 1))
        out.set_kv_buffer(Layer(layer), torch.tensor(slots), k, v)
    return out


def raw(p: Any) -> list[torch.Tensor]:
    return [b.view(torch.uint8) for b in (*p.k_buffer, *p.v_buffer)]


def misplaced(spec: Spec, p: Any, store: torch.dtype) -> int:
    """How many values of the pool SGLang wrote at SLOTS are not where `spec` addresses them, plus the
    nonzero elements no value accounts for (the writer put something where the spec has nothing)."""
    ext = {"L": L, "B": SIZE // PAGE + 1, "N": PAGE, "H": H, "C": HEAD, "C.k": HEAD, "C.v": HEAD}
    wrong, seen = 0, 0
    for plane, buffers in zip(spec.moved_planes(), (p.k_buffer, p.v_buffer), strict=True):
        for layer in range(L):
            want = bits(layer, plane.index, SLOTS, store)
            got = buffers[layer].view(want.dtype)
            for t, slot in enumerate(SLOTS):
                for h in range(H):
                    for c in range(HEAD):
                        _, index, _ = plane_address(spec, plane, {"l": layer, "slot": slot, "h": h, "c": c}, ext, 2)
                        wrong += int(got[index] != want[t, h, c])
            seen += int(got.count_nonzero())
    return wrong + seen - 2 * L * T * H * HEAD


@pytest.mark.parametrize(("dtype", "store", "x", "layout"), DTYPES, ids=IDS)
def test_the_spec_addresses_what_sglangs_pool_writes(dtype: torch.dtype, store: torch.dtype, x: int,
                                                     layout: str) -> None:
    """Every value set_kv_buffer wrote lies where the spec's split axes (C/x with C%x for K, N/x with
    N%x for V) say, and the writer wrote nothing else; the pool's buffers are the spec's tiles."""
    p = written(dtype, store, SLOTS)
    assert (p.store_dtype, p._kv_vector_x) == (store, x)
    assert tuple(p.k_buffer[0].shape) == (SIZE // PAGE + 1, H, HEAD // x, PAGE, x)
    assert tuple(p.v_buffer[0].shape) == (SIZE // PAGE + 1, H, PAGE // x, HEAD, x)
    assert misplaced(LIBRARY[layout], p, store) == 0


def mutated(layout: str, parts: tuple[str, str], tmp_path: Path) -> Spec:
    """The built-in spec with its parts' dims replaced by `parts` (K's, V's), loaded from a copy."""
    source = Path(LIBRARY[layout].source).read_text()
    text, done = [], 0
    for line in source.splitlines():
        if line.startswith(("  k: {dims:", "  v: {dims:")):
            line = f"  {line.strip()[0]}: {{dims: {parts[done]}, dtypes: [{line.split('dtypes: [')[1]}"
            done += 1
        text.append(line)
    path = tmp_path / f"{layout}.yaml"
    path.write_text("\n".join(text) + "\n")
    return load_specs([path])[0][0]


@pytest.mark.parametrize(("parts", "what"), [
    (("[B, H, N/8, C, N%8]", "[B, H, C/8, N, C%8]"), "K and V swapped"),
    (("[B, H, C%8, N, C/8]", "[B, H, N/8, C, N%8]"), "K's tile and place swapped"),
    (("[B, H, C/8, N, C%8]", "[B, H, N%8, C, N/8]"), "V's tile and place swapped"),
])
def test_a_wrong_spec_misplaces_what_sglang_writes(parts: tuple[str, str], what: str, tmp_path: Path) -> None:
    """The check above can fail: specs whose K and V, or a tile and its place, are swapped address
    the values elsewhere, within the buffers (all of them [pages, H, 8, 64, 8])."""
    spec = mutated("sglang_mha_vectorized_5d", parts, tmp_path)
    assert misplaced(spec, written(torch.bfloat16, torch.bfloat16, SLOTS), torch.bfloat16) > 0, what


def gathered(p: Any, slots: list[int]) -> list[torch.Tensor]:
    """What SGLang's own reader (gather_shuffle_5d_to_linear, the inverse of its writer) reads at `slots`:
    per layer K's and V's [T, H, HEAD] rows, as bytes."""
    from sglang.kernels.ops.kvcache.shuffle_5d_cache import launch_gather_shuffle_5d_to_linear

    out = []
    for layer in range(L):
        k, v = launch_gather_shuffle_5d_to_linear(p.k_buffer[layer], p.v_buffer[layer], torch.tensor(slots))
        out += [k.view(torch.uint8), v.view(torch.uint8)]
    return out


def moved(dtype: torch.dtype, store: torch.dtype, edit: tuple[str, str] | None = None,
          backend: str | None = None) -> tuple[Any, Any, MemoryObj]:
    """(the pool SGLang wrote at SLOTS, an empty pool the connector filled at AGAIN, the kv_planes object
    between them): the connectors kvgen.from_sglang gives (on `backend`), or with `edit` the spec's
    rendered with it."""
    source, fresh = written(dtype, store, SLOTS), pool(dtype)
    out, back = kvgen.from_sglang(source, backend=backend), kvgen.from_sglang(fresh, backend=backend)
    assert (out.layout, out.obj, out.layer_ids) == (back.layout, "kv_planes", tuple(range(L)))
    c_out = c_back = tiled_connector(out.layout, "kv_planes", edit)(device="cpu", backend=backend) if edit else None
    c_out, c_back = (c_out or out.connector), (c_back or back.connector)
    obj = MemoryObj(torch.zeros(tuple(c_out.get_shape(T, out.kvcaches)), dtype=torch.uint8))
    c_out.from_gpu(obj, 0, T, kvcaches=out.kvcaches, slot_mapping=torch.tensor(SLOTS))
    c_back.to_gpu(obj, 0, T, kvcaches=back.kvcaches, slot_mapping=torch.tensor(AGAIN))
    return source, fresh, obj


def has_compiler(backend: str | None) -> None:
    if backend == "native" and native.compiler() is None:
        pytest.skip("no C compiler here")
    why = kernels.unavailable(torch.device("cpu")) if backend == "triton" else None
    if why:
        pytest.skip(why)


@pytest.mark.parametrize("backend", [None, "torch", "native", "triton"])
@pytest.mark.parametrize(("dtype", "store", "x", "layout"), DTYPES, ids=IDS)
def test_the_pool_moves_both_ways_and_sglang_reads_the_same(dtype: torch.dtype, store: torch.dtype, x: int,
                                                            layout: str, backend: str | None) -> None:
    """kvgen.from_sglang binds the pool to its spec; the object holds each layer's K rows then V rows of
    the tokens in order; loaded at AGAIN, every byte of the empty pool is what SGLang's writer puts
    there, and SGLang's reader reads at AGAIN what it read at SLOTS (by default, on the torch path, on
    the compiled kernel and on the Triton kernels, in Triton's interpreter here)."""
    has_compiler(backend)
    launches = kernels.stats["launches"]
    source, fresh, obj = moved(dtype, store, backend=backend)
    assert (kernels.stats["launches"] > launches) == (backend == "triton")
    assert kvgen.from_sglang(source).layout == layout
    region = T * H * HEAD * store.itemsize  # a multiple of 16 bytes: V's region starts right after K's
    for layer in range(L):
        for kv in (0, 1):
            stored = obj.tensor[layer, kv * region:(kv + 1) * region].view(bits(0, 0, [0], store).dtype)
            assert torch.equal(stored.reshape(T, H, HEAD), bits(layer, kv, SLOTS, store))
    for got, want in zip(raw(fresh), raw(written(dtype, store, AGAIN, SLOTS)), strict=True):
        assert torch.equal(got, want)  # every byte, moved and not
    for got, want in zip(gathered(fresh, AGAIN), gathered(source, SLOTS), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize(("edit", "backend"), [
    (("(ck.off // 8), :, (ck.off % 8)", "(ck.off % 8), :, (ck.off // 8)"), "torch"),  # the torch path's index
    (("slot_split=('N/8', 'N%8')", "slot_split=('N%8', 'N/8')"), "native"),  # the compiled kernel's PROGRAM
], ids=["torch", "native"])
def test_a_token_placed_by_a_swapped_tile_is_what_sglang_reads_wrong(edit: tuple[str, str], backend: str) -> None:
    """The same move through a connector that splits V's token offset the other way round (n % 8 as
    the tile, n // 8 as the place; bf16, where both have 8 entries), on the torch path or in the
    compiled kernel's PROGRAM: SGLang's reader sees other V rows, K's still right."""
    has_compiler(backend)
    source, fresh, _ = moved(torch.bfloat16, torch.bfloat16, edit, backend)
    got, want = gathered(fresh, AGAIN), gathered(source, SLOTS)
    assert [torch.equal(g, w) for g, w in zip(got, want, strict=True)] == [True, False] * L


def test_a_float32_pool_is_refused_in_sglangs_words() -> None:
    """SGLang builds a float32 vectorized_5d pool (x 4); AITER's kernels read bf16, fp16 and fp8 and kvgen
    has no spec for it."""
    with pytest.raises(KVLayoutError, match="kv_cache_layout 'vectorized_5d': its buffers are float32"):
        kvgen.from_sglang(pool(torch.float32))
