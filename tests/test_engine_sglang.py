"""SGLang 0.5.23's own pools as the oracle: caches built with SGLang's classes on CPU, K and V
written with the pool's own write path (`set_kv_buffer`), stored by kvgen into objects whose
every element is checked against its coordinates, loaded by kvgen into a fresh pool at other
slots, and read back with the pool's own read path (`get_key_buffer`, `get_value_buffer`,
`get_kv_buffer`) against a pool SGLang itself wrote at those slots. Where SGLang's write path is
a CUDA kernel (the DSA indexer's `store_quantized`, the HiCache host transfers in sgl_kernel),
the test writes SGLang's documented element positions instead and says so.

SGLang pins torch 2.14.1 and needs torchvision: `scripts/dev engines` sets up .venv-sglang and
runs this file there; elsewhere it skips, saying why.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import sglang_absent

try:
    from sglang.srt.mem_cache import memory_pool as mp
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.runtime_context import get_parallel
except Exception as exc:  # noqa: BLE001 - any failure of SGLang's import chain
    sglang_absent(exc, "memory pools")

import kvgen  # noqa: E402
from kvgen import generated  # noqa: E402
from kvgen.errors import KVLayoutError  # noqa: E402
from kvgen.runtime import MemoryObj  # noqa: E402
from kvgen.spec.library import load_library  # noqa: E402
from kvgen.tools.cli import main  # noqa: E402

L, H, PAGE, C, CV, SIZE = 3, 4, 16, 8, 6, 48  # H != PAGE and C != CV: a swap or a wrong width fails
ROWS = SIZE + PAGE  # SGLang's rows: size + page_size (slot 0's page absorbs padded writes)
SLOTS = torch.tensor([17, 3, 40, 16, 31, 63, 50, 5])
AGAIN = torch.tensor([60, 1, 33, 20, 7, 45, 28, 12])  # where the load puts them
T = len(SLOTS)


def test_the_installed_sglang_is_the_release_these_tests_describe() -> None:
    assert importlib.metadata.version("sglang") == "0.5.23"


def code(layer: int, kv: int, slot: int, h: int, c: int) -> float:
    """The value of (layer, K or V, slot, head, content): each coordinate is recoverable."""
    return float((((layer * 2 + kv) * ROWS + slot) * H + h) * 16 + c)


def rows(layer: int, kv: int, slots: torch.Tensor, heads: int, width: int) -> torch.Tensor:
    return torch.tensor([[[code(layer, kv, s, h, c) for c in range(width)] for h in range(heads)]
                         for s in slots.tolist()])


class Layer:
    """What set_kv_buffer reads of SGLang's RadixAttention: the layer id."""

    def __init__(self, layer_id: int):
        self.layer_id = layer_id


@contextmanager
def one_rank() -> Iterator[None]:
    """SGLang's MLA and DSA pools ask the parallel context; a single-GPU server publishes this."""
    with get_parallel().override(attn_dcp_size=1, dcp_enabled=False):
        yield


# -- MHA: nhd, hnd, a V head size other than K's ------------------------------------------------

def mha(layout: str, monkeypatch: pytest.MonkeyPatch, v_head_dim: int | None = None) -> Any:
    if layout == "hnd":
        monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", "1")  # how a server asks for the HND pool
    else:
        monkeypatch.delenv("SGLANG_USE_HND_KVCACHE", raising=False)
    pool = mp.MHATokenToKVPool(size=SIZE, page_size=PAGE, dtype=torch.float32, head_num=H, head_dim=C,
                               v_head_dim=v_head_dim, layer_num=L, device="cpu", enable_memory_saver=False,
                               enable_alt_stream=False)
    assert pool.kv_cache_layout == layout
    return pool


def write_mha(pool: Any, slots: torch.Tensor, layer_ids: list[int], values_of: torch.Tensor | None = None) -> None:
    src = SLOTS if values_of is None else values_of
    for i, layer in enumerate(layer_ids):
        width = pool.get_v_head_dim()  # SGLang's own answer, for the hybrid pool too
        pool.set_kv_buffer(Layer(layer), slots, rows(i, 0, src, H, pool.head_dim), rows(i, 1, src, H, width))


def store(bound: Any) -> MemoryObj:
    dtype = bound.connector.get_dtype()
    obj = MemoryObj(torch.full(tuple(bound.connector.get_shape(T, bound.kvcaches)), 255 if dtype == torch.uint8
                               else -1.0, dtype=dtype))
    bound.connector.from_gpu(obj, 0, T, kvcaches=bound.kvcaches, slot_mapping=SLOTS)
    return obj


def kv_2ltd_expected(slots: torch.Tensor = SLOTS) -> torch.Tensor:
    return torch.stack([torch.stack([rows(layer, kv, slots, H, C).reshape(len(slots), H * C) for layer in range(L)])
                        for kv in range(2)])


#: Slots that a reading with heads and slots swapped still finds inside the cache: a mutant then
#: moves wrong elements without an error, as detection's misreading did.
LOW = torch.tensor([3, 5, 12, 0, 9, 15, 7, 1])


def mutant_store(conn: Any, cache: Any) -> torch.Tensor:
    obj = MemoryObj(torch.full(tuple(conn.get_shape(T, cache)), -1.0).to(conn.get_dtype(cache)))
    conn.from_gpu(obj, 0, T, kvcaches=cache, slot_mapping=LOW)
    return obj.tensor


def copy(obj: MemoryObj) -> MemoryObj:
    return MemoryObj(obj.tensor.clone(), obj.metadata.fmt)


def load(bound: Any, obj: MemoryObj) -> None:
    bound.connector.to_gpu(copy(obj), 0, T, kvcaches=bound.kvcaches, slot_mapping=AGAIN)


def same_reads(pool: Any, oracle: Any, layer_ids: list[int]) -> bool:
    """Whether SGLang's own getters read the same K and V from both pools, every layer."""
    for layer in layer_ids:
        k, v = pool.get_kv_buffer(layer)
        ok, ov = oracle.get_kv_buffer(layer)
        if not (torch.equal(pool.get_key_buffer(layer), oracle.get_key_buffer(layer)) and
                torch.equal(pool.get_value_buffer(layer), oracle.get_value_buffer(layer)) and
                torch.equal(k, ok) and torch.equal(v, ov)):
            return False
    return True


MHA_CASES = [("nhd", None, "sglang_mha", "kv_2ltd"), ("hnd", None, "sglang_mha_hnd", "kv_2ltd"),
             ("nhd", CV, "sglang_mha_v_head", "kv_planes")]


@pytest.mark.parametrize(("layout", "v_head_dim", "spec", "obj"), MHA_CASES, ids=["nhd", "hnd", "v_head"])
def test_mha_pools_move_right_both_ways(layout: str, v_head_dim: int | None, spec: str, obj: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    pool = mha(layout, monkeypatch, v_head_dim)
    write_mha(pool, SLOTS, list(range(L)))
    bound = kvgen.from_sglang(pool)
    assert (bound.layout, bound.obj, bound.layer_ids) == (spec, obj, tuple(range(L)))
    stored = store(bound)
    if obj == "kv_2ltd":  # [2, L, T, H * C]: every element where its coordinates say
        assert torch.equal(stored.tensor, kv_2ltd_expected())
    else:  # kv_planes: per layer a dense [T, H, C] region of K, then (16-byte aligned) one of V
        k_bytes = T * H * C * 4
        for layer in range(L):
            row = stored.tensor[layer]
            assert torch.equal(row[:k_bytes].view(torch.float32).reshape(T, H, C), rows(layer, 0, SLOTS, H, C))
            v = row[k_bytes:k_bytes + T * H * CV * 4].view(torch.float32).reshape(T, H, CV)
            assert torch.equal(v, rows(layer, 1, SLOTS, H, CV))

    fresh, oracle = mha(layout, monkeypatch, v_head_dim), mha(layout, monkeypatch, v_head_dim)
    load(kvgen.from_sglang(fresh), stored)
    write_mha(oracle, AGAIN, list(range(L)))  # SGLang writes what the load should have written
    assert same_reads(fresh, oracle, list(range(L)))
    assert not same_reads(fresh, mha(layout, monkeypatch, v_head_dim), list(range(L)))  # the load wrote


def test_the_hnd_pool_is_refused_without_its_word_and_moves_right_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The regression of issue 19: detection read this pool as [B, N, H, C] with N and H swapped."""
    pool = mha("hnd", monkeypatch)
    write_mha(pool, SLOTS, list(range(L)))
    cache = [list(pool.k_buffer), list(pool.v_buffer)]
    with pytest.raises(KVLayoutError, match="kv_cache_layout"):
        kvgen.detect(cache, engine="sglang")
    found = kvgen.detect(cache, engine="sglang", kv_layout=pool.kv_cache_layout)
    assert (found.layout, found.extents["H"], found.extents["N"]) == ("sglang_mha_hnd", H, PAGE)
    nhd = kvgen.detect([list(mha("nhd", monkeypatch).k_buffer), list(mha("nhd", monkeypatch).v_buffer)],
                       engine="sglang", kv_layout="nhd")
    assert nhd.layout == "sglang_mha"


# -- a spec mutated to its neighbour (NHD <-> HND) fails the same checks ------------------------

MUTANTS = {"sglang_mha_hnd": ("dims: [B, H, N, C]", "dims: [B, N, H, C]"),
           "hicache_page_head": ("dims: [KV, B, H, N, L, C]", "dims: [KV, B, N, H, L, C]"),
           "hicache_page_unified": ("dims: [B, 1, L, KV, N, H, C]", "dims: [B, 1, L, KV, H, N, C]"),
           # a head's group and its place in the group swapped: the same shape for two groups of two heads
           "hicache_page_unified_grouped": ("dims: [B, H/g, L, KV, N, H%g, C]", "dims: [B, H%g, L, KV, N, H/g, C]")}


@pytest.fixture(scope="module")
def mutants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A package holding each spec above with its heads and slots swapped, as `mutant_<name>`."""
    root = tmp_path_factory.mktemp("mutants")
    specs = root / "specs"
    specs.mkdir()
    for name, (old, new) in MUTANTS.items():
        text = Path(load_library()[name].source).read_text("utf-8")
        assert old in text
        text = text.replace(old, new).replace(f"name: {name}", f"name: mutant_{name}")
        text = "\n".join(line for line in text.splitlines() if not line.startswith("aliases:"))
        (specs / f"{name}.yaml").write_text(text + "\n")
    assert main(["build", "--specs", str(specs), "--out", str(root / "sglang_mutants")]) == 0
    sys.path.insert(0, str(root))
    try:
        yield importlib.import_module("sglang_mutants")
    finally:
        sys.path.remove(str(root))
        for name in [m for m in sys.modules if m.startswith("sglang_mutants")]:
            del sys.modules[name]


def test_a_mutated_hnd_spec_fails_against_the_pool(mutants: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = mha("hnd", monkeypatch)
    everything = torch.arange(ROWS)
    write_mha(pool, everything, list(range(L)), values_of=everything)
    cache = [list(pool.k_buffer), list(pool.v_buffer)]
    assert torch.equal(mutant_store(generated.get("sglang_mha_hnd", "kv_2ltd")(), cache), kv_2ltd_expected(LOW))
    assert not torch.equal(mutant_store(mutants.get("mutant_sglang_mha_hnd", "kv_2ltd")(), cache),
                           kv_2ltd_expected(LOW))


# -- MLA, DSA, the hybrid pool's attention layers -----------------------------------------------

RANK, ROPE = 8, 4


def mla() -> Any:
    return mp.MLATokenToKVPool(size=SIZE, page_size=PAGE, dtype=torch.float32, kv_lora_rank=RANK,
                               qk_rope_head_dim=ROPE, layer_num=L, device="cpu", enable_memory_saver=False)


def write_latent(pool: Any, slots: torch.Tensor) -> None:
    with one_rank():
        for layer in range(L):
            pool.set_kv_buffer(Layer(layer), slots, rows(layer, 0, SLOTS, 1, RANK + ROPE), None)


def test_mla_pool_moves_right_both_ways() -> None:
    pool = mla()
    write_latent(pool, SLOTS)
    bound = kvgen.from_sglang(pool)
    assert (bound.layout, bound.obj) == ("sglang_mla", "kv_mla")
    stored = store(bound)  # [1, L, T, C]
    want = torch.stack([rows(layer, 0, SLOTS, 1, RANK + ROPE)[:, 0] for layer in range(L)])[None]
    assert torch.equal(stored.tensor, want)
    fresh, oracle = mla(), mla()
    load(kvgen.from_sglang(fresh), stored)
    write_latent(oracle, AGAIN)
    assert same_reads(fresh, oracle, list(range(L)))


DSA_PAGE, INDEX_DIM = 64, 128  # SGLang's DSA pool requires 64-token pages and 128-wide index keys


def dsa() -> Any:
    with one_rank():
        return mp.DSATokenToKVPool(size=DSA_PAGE, page_size=DSA_PAGE, kv_lora_rank=RANK, dtype=torch.float32,
                                   qk_rope_head_dim=ROPE, layer_num=L, device="cpu", index_head_dim=INDEX_DIM,
                                   enable_memory_saver=False, kv_cache_dim=RANK + ROPE)


def index_key(layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes of one token's 128 fp8 index values and of its fp32 scale, coded by layer and slot."""
    values = torch.tensor([(layer * 131 + slot * 7 + i) % 251 for i in range(INDEX_DIM)], dtype=torch.uint8)
    return values, torch.tensor([float(layer * 1000 + slot)]).view(torch.uint8)


def write_index(pool: Any, slots: torch.Tensor) -> None:
    """SGLang's store_quantized is a GPU kernel; this writes its documented places instead
    (index_key_cache.py: a page holds every token's key bytes, then every token's scale bytes)."""
    for layer, buf in enumerate(pool.index_k_with_scale_buffer):
        for src, dst in zip(SLOTS.tolist(), slots.tolist(), strict=True):
            values, scale = index_key(layer, src)
            page, off = divmod(dst, DSA_PAGE)
            buf[page, off * INDEX_DIM:(off + 1) * INDEX_DIM] = values
            buf[page, DSA_PAGE * INDEX_DIM + off * 4:DSA_PAGE * INDEX_DIM + off * 4 + 4] = scale


def test_dsa_pool_latent_and_index_keys_move_right_both_ways() -> None:
    pool = dsa()
    write_latent(pool, SLOTS)
    write_index(pool, SLOTS)
    latent, index = kvgen.from_sglang(pool), kvgen.from_sglang(pool, part="indexer")
    assert (latent.layout, index.layout) == ("sglang_mla", "vllm_dsa_indexer")
    fresh, oracle = dsa(), dsa()
    load(kvgen.from_sglang(fresh), store(latent))
    bound = kvgen.from_sglang(fresh, part="indexer")
    stored = store(index)  # kv_planes: per layer every token's 128 value bytes, then its scale bytes
    for layer in range(L):
        values = torch.stack([index_key(layer, s)[0] for s in SLOTS.tolist()])
        scales = torch.stack([index_key(layer, s)[1] for s in SLOTS.tolist()])
        row = stored.tensor[layer]
        assert torch.equal(row[:T * INDEX_DIM].reshape(T, INDEX_DIM), values)
        assert torch.equal(row[T * INDEX_DIM:T * INDEX_DIM + T * 4].reshape(T, 4), scales)
    bound.connector.to_gpu(copy(stored), 0, T, kvcaches=bound.kvcaches, slot_mapping=AGAIN)
    write_latent(oracle, AGAIN)
    write_index(oracle, AGAIN)
    assert same_reads(fresh, oracle, list(range(L)))
    for layer in range(L):
        assert torch.equal(fresh.index_key_cache.get_buffer(layer), oracle.index_key_cache.get_buffer(layer))


def hybrid() -> Any:
    return mp.HybridLinearKVPool(size=SIZE, dtype=torch.float32, page_size=PAGE, head_num=H, head_dim=C,
                                 full_attention_layer_ids=[1, 3, 4], device="cpu", mamba_pool=None)


def test_hybrid_linear_pools_attention_layers_move_right_both_ways() -> None:
    pool = hybrid()
    write_mha(pool, SLOTS, [1, 3, 4])
    bound = kvgen.from_sglang(pool)
    assert (bound.pool, bound.layout, bound.layer_ids) == ("HybridLinearKVPool", "sglang_mha", (1, 3, 4))
    stored = store(bound)
    assert torch.equal(stored.tensor, kv_2ltd_expected())  # entry i of the layer lists is model layer layer_ids[i]
    fresh, oracle = hybrid(), hybrid()
    load(kvgen.from_sglang(fresh), stored)
    write_mha(oracle, AGAIN, [1, 3, 4])
    assert same_reads(fresh, oracle, [1, 3, 4])


def test_pools_kvgen_does_not_know_are_refused_by_class_and_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    class MiniMaxSparseKVPool:  # SGLang's MiniMax NVFP4 pool: no kvgen spec
        kv_cache_layout = "nhd"

    with pytest.raises(KVLayoutError, match="MiniMaxSparseKVPool with kv_cache_layout 'nhd'.*no spec for this pool"):
        kvgen.from_sglang(MiniMaxSparseKVPool())
    pool = mha("hnd", monkeypatch, CV)  # HND with a V head size of its own: no spec
    with pytest.raises(KVLayoutError, match="MHATokenToKVPool with kv_cache_layout 'hnd'"):
        kvgen.from_sglang(pool)


# -- HiCache host pools --------------------------------------------------------------------------

#: SGLang 0.5.23's MHATokenToKVPoolHost.init_kv_buffer dims per layout (names for its tuple; G the head
#: group of page_unified's PageUnifiedLayout.page_dims, H there a head's place in its group).
HOST_DIMS = {"layer_first": ("KV", "L", "S", "H", "C"), "page_first": ("KV", "S", "L", "H", "C"),
             "page_first_direct": ("KV", "B", "L", "N", "H", "C"), "page_head": ("KV", "B", "H", "N", "L", "C"),
             "page_unified": ("B", "G", "L", "KV", "N", "H", "C")}
MLA_HOST_DIMS = {"layer_first": ("L", "S", "1", "C"), "page_first": ("S", "L", "1", "C"),
                 "page_first_direct": ("B", "L", "N", "1", "C"), "page_unified": ("B", "L", "N", "C")}


def host(layout: str, mla_pool: bool = False, head_groups: int = 1) -> Any:
    device = mla() if mla_pool else mp.MHATokenToKVPool(
        size=SIZE, page_size=PAGE, dtype=torch.float32, head_num=H, head_dim=C, layer_num=L, device="cpu",
        enable_memory_saver=False, enable_alt_stream=False)
    info = device.get_device_pool_infos()[0].buffer_info
    cls, extra = ((MLATokenToKVPoolHost, {"target_layer_num": L}) if mla_pool
                  else (MHATokenToKVPoolHost, {"head_group_num": head_groups}))
    return cls(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu", device_capacity_tokens=SIZE,
               start_layer=0, end_layer=L, **extra)


def write_host(pool: Any, names: tuple[str, ...], slots: torch.Tensor, values_of: torch.Tensor = SLOTS,
               head_groups: int = 1) -> None:
    """SGLang's host transfers are sgl_kernel CUDA ops; this writes the places init_kv_buffer's
    dims document (S a host slot, B its page, N its offset in the page; head h in group G = h // (H / G)
    at place h % (H / G))."""
    heads, width = (H, C) if "KV" in names else (1, RANK + ROPE)
    per_group = H // head_groups
    for kv in range(2 if "KV" in names else 1):
        for layer in range(L):
            for src, dst in zip(values_of.tolist(), slots.tolist(), strict=True):
                for h in range(heads):
                    at = {"KV": kv, "L": layer, "S": dst, "B": dst // PAGE, "N": dst % PAGE, "1": 0,
                          "G": h // per_group, "H": h % per_group if "G" in names else h}
                    index = tuple(at[n] for n in names[:-1])
                    pool.kv_buffer[index] = torch.tensor([code(layer, kv, src, h, c) for c in range(width)])


def host_pages(pool: Any) -> list[torch.Tensor]:
    """SGLang's own reading of each host page: get_data_page, which 0.5.23 does not serve for
    page_unified (it raises); there, the byte runs PageUnifiedLayout.chunk_span names for L3 chunks:
    every head group's whole layer range, and each single layer of it."""
    if pool.layout != "page_unified":
        return [pool.get_data_page(index, flat=False) for index in range(0, pool.size, PAGE)]
    with pytest.raises(ValueError, match="Unsupported layout"):
        pool.get_data_page(0, flat=False)
    spec = pool.page_unified_layout
    ranges = [(0, spec.layer_num)] + [(layer, layer + 1) for layer in range(spec.layer_num)]
    out = []
    for page in pool.kv_buffer:
        raw = page.reshape(-1).view(torch.uint8)
        assert raw.numel() == spec.bytes_per_page
        for group in range(spec.head_group_num):
            for span in ranges:
                offset, length = spec.chunk_span(span, group)
                out.append(raw[offset:offset + length])
    return out


#: The host round trips: (SGLang layout word, an MLA pool, head_group_num) by the spec each binds.
HOST_CASES = {**{f"hicache_{w}": (w, False, 1) for w in HOST_DIMS},
              "hicache_page_unified_per_head": ("page_unified", False, H),
              "hicache_page_unified_grouped": ("page_unified", False, 2),
              **{f"hicache_mla_{w}": (w, True, 1) for w in MLA_HOST_DIMS}}


def as_kv_2ltd(stored: torch.Tensor) -> torch.Tensor:
    """A kv_planes object of one plane [L, KV T H C] (its bytes) read as kv_2ltd's [2, L, T, H * C]."""
    return stored.view(torch.float32).reshape(L, 2, T, H * C).transpose(0, 1)


@pytest.mark.parametrize("spec", list(HOST_CASES))
def test_hicache_host_pools_built_by_sglang_move_right_both_ways(spec: str, mutants: Any) -> None:
    word, is_mla, groups = HOST_CASES[spec]
    names = (MLA_HOST_DIMS if is_mla else HOST_DIMS)[word]
    obj = "kv_mla" if is_mla else "kv_planes" if spec == "hicache_page_unified_grouped" else "kv_2ltd"
    pool = host(word, is_mla, groups)
    write_host(pool, names, SLOTS, head_groups=groups)
    bound = kvgen.from_sglang(pool)  # the pool's class, `layout` and head_group_num choose the spec
    assert (bound.pool, bound.layout, bound.obj, bound.layer_ids) == (type(pool).__name__, spec, obj, tuple(range(L)))
    assert bound.kvcaches is pool.kv_buffer  # SGLang's own tensor, no copy
    out = store(bound)
    want = (torch.stack([rows(layer, 0, SLOTS, 1, RANK + ROPE)[:, 0] for layer in range(L)])[None] if is_mla
            else kv_2ltd_expected())
    assert torch.equal(as_kv_2ltd(out.tensor) if obj == "kv_planes" else out.tensor, want)
    fresh, oracle = host(word, is_mla, groups), host(word, is_mla, groups)
    load(kvgen.from_sglang(fresh), out)
    write_host(oracle, names, AGAIN, head_groups=groups)
    pages, want_pages = host_pages(fresh), host_pages(oracle)  # SGLang's own page reader (what L3 reads)
    assert len(pages) == len(want_pages) and all(map(torch.equal, pages, want_pages))
    assert not all(map(torch.equal, pages, host_pages(host(word, is_mla, groups))))  # the load wrote
    if spec in MUTANTS:  # the neighbouring reading (N and H, or a head's group and place, swapped) fails
        everything = torch.arange(4 * PAGE)
        write_host(pool, names, everything, values_of=everything, head_groups=groups)
        read = as_kv_2ltd if obj == "kv_planes" else (lambda t: t)
        assert torch.equal(read(mutant_store(bound.connector, pool.kv_buffer)), kv_2ltd_expected(LOW))
        assert not torch.equal(read(mutant_store(mutants.get(f"mutant_{spec}", obj)(), pool.kv_buffer)),
                               kv_2ltd_expected(LOW))


@pytest.mark.parametrize("groups", [1, 2, H], ids=["one_group", "two_groups", "one_head_per_group"])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_sglangs_device_pool_and_its_page_unified_host_pool_transfer_both_ways(
        layout: str, groups: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """What HiCache's write-back and load-back kernels (CUDA) do, by kvgen's transfers: K and V that
    SGLang's set_kv_buffer wrote reach the page_unified host pool (one head group, two, or one head
    per group) where page_dims says, and come back to a fresh device pool where SGLang's getters read them."""
    device_name = "sglang_mha" if layout == "nhd" else "sglang_mha_hnd"
    host_name = {1: "hicache_page_unified", H: "hicache_page_unified_per_head"}.get(groups,
                                                                                  "hicache_page_unified_grouped")
    pool = mha(layout, monkeypatch)
    write_mha(pool, SLOTS, list(range(L)))
    cache = [list(pool.k_buffer), list(pool.v_buffer)]
    target, oracle = host("page_unified", head_groups=groups), host("page_unified", head_groups=groups)
    assert kvgen.from_sglang(target).layout == host_name
    generated.transfer(device_name, host_name)().copy(cache, SLOTS, target.kv_buffer, AGAIN)
    write_host(oracle, HOST_DIMS["page_unified"], AGAIN, head_groups=groups)
    assert all(map(torch.equal, host_pages(target), host_pages(oracle)))
    back, want = mha(layout, monkeypatch), mha(layout, monkeypatch)
    generated.transfer(host_name, device_name)().copy(
        target.kv_buffer, AGAIN, [list(back.k_buffer), list(back.v_buffer)], SLOTS)
    write_mha(want, SLOTS, list(range(L)))
    assert same_reads(back, want, list(range(L)))
    assert not same_reads(back, mha(layout, monkeypatch), list(range(L)))


def test_sglangs_mla_pool_and_its_page_unified_host_pool_transfer_both_ways() -> None:
    pool = mla()
    write_latent(pool, SLOTS)
    target, oracle = host("page_unified", mla_pool=True), host("page_unified", mla_pool=True)
    generated.transfer("sglang_mla", "hicache_mla_page_unified")().copy(list(pool.kv_buffer), SLOTS,
                                                                       target.kv_buffer, AGAIN)
    write_host(oracle, MLA_HOST_DIMS["page_unified"], AGAIN)
    assert all(map(torch.equal, host_pages(target), host_pages(oracle)))
    back, want = mla(), mla()
    generated.transfer("hicache_mla_page_unified", "sglang_mla")().copy(target.kv_buffer, AGAIN,
                                                                       list(back.kv_buffer), SLOTS)
    write_latent(want, SLOTS)
    assert same_reads(back, want, list(range(L)))
    assert not same_reads(back, mla(), list(range(L)))


def test_a_page_unified_pool_of_one_head_per_group_is_told_by_head_group_num_not_its_shape() -> None:
    """head_group_num = head_num (HiCache's head_group 1): [pages, H, L, 2, N, 1, C], bound to
    hicache_page_unified_per_head (its round trip: the host test above), its pages read by SGLang's
    chunk_span as every head group's L3 chunks; the one-group spec refuses these pages."""
    pool = host("page_unified", head_groups=H)
    assert tuple(pool.kv_buffer.shape) == (pool.page_num, H, L, 2, PAGE, 1, C)
    assert kvgen.from_sglang(pool).layout == "hicache_page_unified_per_head"
    assert len(host_pages(pool)) == pool.page_num * H * (L + 1)  # per page: each group's layers, whole and one by one
    one_group = generated.get("hicache_page_unified", "kv_2ltd")()
    out = MemoryObj(torch.zeros(tuple(one_group.get_shape(T, host("page_unified").kv_buffer))))
    with pytest.raises(KVLayoutError, match=r"dim 1 is a singleton \(1\) in this layout, got extent 4"):
        one_group.from_gpu(out, 0, T, kvcaches=pool.kv_buffer, slot_mapping=SLOTS)


@pytest.mark.parametrize("groups", [1, 2, H])
def test_the_grouped_page_unified_spec_reads_the_heads_per_group_from_the_pool(groups: int) -> None:
    """hicache_page_unified_grouped splits H by a factor read from the tensor: one generated
    connector moves a pool of any head_group_num, each where SGLang's chunk_span reads it back."""
    pool = host("page_unified", head_groups=groups)
    write_host(pool, HOST_DIMS["page_unified"], SLOTS, head_groups=groups)
    conn = generated.get("hicache_page_unified_grouped", "kv_planes")()
    out = MemoryObj(torch.full(tuple(conn.get_shape(T, pool.kv_buffer)), 255, dtype=torch.uint8))
    conn.from_gpu(out, 0, T, kvcaches=pool.kv_buffer, slot_mapping=SLOTS)
    assert torch.equal(as_kv_2ltd(out.tensor), kv_2ltd_expected())
    fresh, oracle = host("page_unified", head_groups=groups), host("page_unified", head_groups=groups)
    conn.to_gpu(copy(out), 0, T, kvcaches=fresh.kv_buffer, slot_mapping=AGAIN)
    write_host(oracle, HOST_DIMS["page_unified"], AGAIN, head_groups=groups)
    assert all(map(torch.equal, host_pages(fresh), host_pages(oracle)))


def test_a_page_unified_pool_of_several_head_groups_is_told_by_head_group_num_and_refused_by_one_group() -> None:
    """A pool cut into two head groups of two heads ([pages, 2, L, 2, N, H / 2, C]) binds to
    hicache_page_unified_grouped (its round trip: the host test above); the one-group and per-head
    specs refuse it, nothing written."""
    pool = host("page_unified", head_groups=2)
    assert tuple(pool.kv_buffer.shape) == (pool.page_num, 2, L, 2, PAGE, H // 2, C)
    assert kvgen.from_sglang(pool).layout == "hicache_page_unified_grouped"
    write_host(pool, HOST_DIMS["page_unified"], SLOTS, head_groups=2)
    before = pool.kv_buffer.clone()
    conn = generated.get("hicache_page_unified", "kv_2ltd")()
    out = MemoryObj(torch.full(tuple(conn.get_shape(T, host("page_unified").kv_buffer)), -1.0))
    with pytest.raises(KVLayoutError, match=r"hicache_page_unified: kvcaches must be \[B 1 L KV=2 N H C\]: "
                                            r"dim 1 is a singleton \(1\) in this layout, got extent 2"):
        conn.from_gpu(out, 0, T, kvcaches=pool.kv_buffer, slot_mapping=SLOTS)
    assert bool((out.tensor == -1.0).all())
    with pytest.raises(KVLayoutError, match="dim 1 is a singleton"):
        conn.to_gpu(copy(out), 0, T, kvcaches=pool.kv_buffer, slot_mapping=AGAIN)
    per_head = generated.get("hicache_page_unified_per_head", "kv_2ltd")()
    with pytest.raises(KVLayoutError, match=r"dim 5 is a singleton \(1\) in this layout, got extent 2"):
        per_head.from_gpu(out, 0, T, kvcaches=pool.kv_buffer, slot_mapping=SLOTS)
    assert bool((out.tensor == -1.0).all()) and torch.equal(pool.kv_buffer, before)


def untouched(pool: Any, match: str) -> None:
    """from_sglang refuses the host pool, naming `match`, and writes nothing into its kv_buffer."""
    before = pool.kv_buffer.clone()
    with pytest.raises(KVLayoutError, match=match):
        kvgen.from_sglang(pool)
    assert torch.equal(pool.kv_buffer, before)


def test_host_layouts_and_shapes_kvgen_has_no_spec_for_are_refused_in_sglangs_words() -> None:
    prefix = "kvgen has no connector for SGLang's {} with layout {!r}: "
    for is_mla, attr, value, why in ((False, "head_num", H + 1, "its kv_buffer is "),
                                     (False, "v_head_dim", CV, f"its V head size {CV} is not its K head size {C}"),
                                     (False, "layout", "page_fancy", "no kvgen spec describes this layout"),
                                     (True, "kv_cache_dim", RANK + ROPE + 1, "its kv_buffer is "),
                                     (True, "dsa_kv_cache_store_fp8", True, "its latent rows are packed fp8"),
                                     (True, "layout", "page_head", "no kvgen spec describes this layout")):
        pool = host("page_first", is_mla)
        write_host(pool, MLA_HOST_DIMS["page_first"] if is_mla else HOST_DIMS["page_first"], SLOTS)
        setattr(pool, attr, value)
        cls = type(pool).__name__
        untouched(pool, re.escape(prefix.format(cls, pool.layout) + why))

    class MHATokenToKVPoolMXFP8Host:  # a subclass of SGLang's that keeps scales beside kv_buffer: no kvgen spec
        layout = "layer_first"
        kv_buffer = torch.ones(2)

    untouched(MHATokenToKVPoolMXFP8Host(), re.escape(prefix.format("MHATokenToKVPoolMXFP8Host", "layer_first") +
                                                     "kvgen has no spec for this pool class"))


# -- the hand-written facts (kvgen.oracle.facts*) against SGLang's live pools ---------------------

def test_kvgen_verify_checks_the_hand_written_facts_against_sglangs_live_pools(
        capsys: pytest.CaptureFixture[str]) -> None:
    from kvgen.tools.verify import engines as verify_engines

    wrong, checked = verify_engines.sglang_disagreements()
    assert (wrong, checked) == ([], 10)
    assert verify_engines.run() == 0
    assert "10 of 10 SGLang 0.5.23 pool facts agree with the engine's live pools" in capsys.readouterr().out


def test_a_wrong_fact_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvgen.oracle.facts import layouts as facts
    from kvgen.oracle.facts import planes as planes_facts
    from kvgen.tools.verify import engines as verify_engines

    hnd = facts.FACTS["sglang_mha_hnd"]

    def nhd_shape(g: Any) -> tuple[int, ...]:  # the NHD reading of the HND pool: shape and address
        return (g.B, g.N, g.H, g.C)

    def nhd_address(g: Any, layer: int, kv: int, slot: int, h: int, c: int) -> Any:
        return (kv, layer), (slot // g.N, slot % g.N, h, c)

    for shape in (nhd_shape, hnd.shape):  # a wrong shape, then a right shape with the wrong address
        monkeypatch.setitem(facts.FACTS, "sglang_mha_hnd",
                            facts.Fact(hnd.name, hnd.kind, hnd.container, shape, nhd_address, hnd.fixed))
        wrong, _ = verify_engines.sglang_disagreements()
        assert len(wrong) == 1 and wrong[0].startswith("sglang_mha_hnd:")
    monkeypatch.setitem(facts.FACTS, "sglang_mha_hnd", hnd)
    grouped = planes_facts.PARTS_FACTS["hicache_page_unified_grouped"]  # read as one head per group
    per_head = dataclasses.replace(grouped.parts[0], shape=lambda g: (g.B, g.H, g.L, 2, g.N, 1, g.C))
    monkeypatch.setitem(planes_facts.PARTS_FACTS, grouped.name, dataclasses.replace(grouped, parts=(per_head,)))
    wrong, _ = verify_engines.sglang_disagreements()
    assert len(wrong) == 1
    assert wrong[0].startswith("hicache_page_unified_grouped: SGLang's buffer is [7, 2, 3, 2, 16, 2, 8]")
