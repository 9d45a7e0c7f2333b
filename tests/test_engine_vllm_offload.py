"""vLLM 0.33's canonical offload page (vllm/v1/kv_offload/base.py CanonicalPageMapping / CopyRun),
built by vLLM's own derive_canonical_mappings on CPU, as the oracle for kvgen's transfers into it.

For each KVCacheLayout a cache is made by vLLM's functions and filled through its logical
[B, H, N, C] view with values that encode (layer, block, head, slot, content). vLLM's CopyRuns,
applied to each layer's worker page (the page bytes vLLM's offloading worker reads: the layer
view's block `b` onwards), give the canonical CPU rows (the layers' canonical pages one after
another, shared_offload_region.py); kvgen's transfer from the same cache must write the same bytes,
and its transfer back must rebuild the cache. vLLM certifies its packed-page mapping for the NHD and
HND stride orders; for LHBNC and BHLNC (a layer's page is not one run) it falls back to an opaque
per-rank page, so those layouts move into the canonical page of their in-block order, the page vLLM
certifies for the same values in LBHNC.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from harness import vllm_module

cm = vllm_module("vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping")

iface = vllm_module("vllm.v1.kv_cache_interface")
planning = vllm_module("vllm.v1.core.kv_cache_planning")
worker = vllm_module("vllm.v1.worker.utils")
vllm_layouts = vllm_module("vllm.v1.kv_cache_layout")

from kvgen import generated  # noqa: E402
from kvgen.oracle.facts import vllm as facts_vllm  # noqa: E402
from kvgen.tp import HeadRanges  # noqa: E402

#: No two extents equal, so a swap of heads and slots, or K and V, changes the bytes.
L, B, N, H, C = 2, 5, 4, 3, 6
#: vLLM's KVCacheLayouts as kvgen's facts name them (parametrizing needs no vLLM import);
#: test_the_layouts_are_vllms holds these three to vLLM's enum.
LAYOUTS = list(facts_vllm.KV_CACHE_LAYOUTS)
#: Layouts whose pages are whole runs (L and B outermost).
COMPACT = ["LBHNC", "LBNHC", "BLHNC", "BLNHC"]
#: The canonical page of each layout's in-block order (N before H: v1-nhd; H before N: v1-hnd).
FAMILY = {name: "LBNHC" if facts_vllm.layer_view_order(name).index(2) < facts_vllm.layer_view_order(name).index(1)
          else "LBHNC" for name in LAYOUTS}
CANONICAL = {"LBNHC": "vllm_canonical_lbnhc", "LBHNC": "vllm_canonical_lbhnc"}
#: GPU blocks offloaded, in CPU row order.
BLOCKS = [3, 0, 4]


def engine_cache(layout: str, spec: Any, num_blocks: int = B) -> tuple[dict[str, torch.Tensor], Any, list[str]]:
    cache = SimpleNamespace(get_resolved_kv_cache_layout=lambda: vllm_layouts.KVCacheLayout[layout],
                            prefix_cache_retention_interval=None, num_gpu_blocks_override=num_blocks)
    vllm_config = SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=None), cache_config=cache)
    names = [f"attn.{i}" for i in range(L)]
    config = planning.get_kv_cache_config_from_groups(vllm_config, [iface.KVCacheGroupSpec(names, spec)], 1 << 30)
    return worker.allocate_kv_cache(config, torch.device("cpu"), vllm_layouts.KVCacheLayout[layout]), config, names


def full(heads: int = H, **kw: Any) -> Any:
    return iface.FullAttentionSpec(block_size=N, num_kv_heads=heads, head_size=C, dtype=torch.float32, **kw)


def mla() -> Any:
    return iface.MLAAttentionSpec(block_size=N, num_kv_heads=1, head_size=C, dtype=torch.float32)


def fill(kv: dict[str, torch.Tensor], names: list[str], first_head: int = 0, heads_total: int | None = None) -> None:
    """Value of (layer, block, global head, slot, content), written through vLLM's logical view."""
    for layer, name in enumerate(names):
        b, h, n, c = kv[name].shape
        total = heads_total or h
        idx = torch.arange(b * h * n * c).reshape(b, h, n, c)
        blk, head = idx // (h * n * c), (idx // (n * c)) % h + first_head
        kv[name].copy_(((((layer * b + blk) * total + head) * n + (idx // c) % n) * c + idx % c + 1).float())


def mappings(kv: dict[str, torch.Tensor], config: Any, heads_total: int, tp: int = 1, rank: int = 0) -> dict[str, Any]:
    """vLLM's derive_canonical_mappings for one rank of a TP group (the VllmConfig fields it reads)."""
    parallel = SimpleNamespace(tensor_parallel_size=tp, prefill_context_parallel_size=1, world_size=tp,
                               decode_context_parallel_size=1, cp_kv_cache_interleave_size=1, rank=rank)
    model = SimpleNamespace(get_total_num_kv_heads=lambda: heads_total)
    return cm.derive_canonical_mappings(SimpleNamespace(parallel_config=parallel, model_config=model), config, kv)


def worker_page(view: torch.Tensor, block: int, size: int) -> torch.Tensor:
    """The page bytes vLLM's offloading worker reads for `block` of this layer (worker.py
    register_kv_caches: from the view's block 0, `block` block strides on)."""
    raw = torch.tensor([], dtype=torch.int8).set_(view.untyped_storage())
    start = (view.storage_offset() + block * view.stride(0)) * view.element_size()
    return raw[start:start + size]


def vllm_rows(kv: dict[str, torch.Tensor], names: list[str], maps: dict[str, Any], rows: torch.Tensor) -> None:
    """Apply vLLM's CopyRuns of each layer: worker page of BLOCKS[r] -> canonical page of row r."""
    for r, block in enumerate(BLOCKS):
        offset = 0
        for name in names:
            mapping = maps[name]
            page = worker_page(kv[name], block, mapping.local_page_size_bytes)
            for run in mapping.runs:
                for i in range(run.num_fragments):
                    src, dst = run.local_offset + i * run.local_stride, offset + run.canonical_offset + i * \
                        run.canonical_stride
                    rows[r, dst:dst + run.fragment_size] = page[src:src + run.fragment_size]
            offset += mapping.canonical_page_size_bytes


def slots(blocks: list[int]) -> torch.Tensor:
    return torch.tensor([b * N + n for b in blocks for n in range(N)])


def memory_order(kv: dict[str, torch.Tensor], names: list[str], layout: str, is_mla: bool) -> list[torch.Tensor]:
    order = (0, 1, 2, 3) if is_mla else facts_vllm.layer_view_order(layout)
    return [kv[n].permute(*order) for n in names]


def kvgen_rows(layout: str, kv: dict[str, torch.Tensor], names: list[str], host: str, shape: tuple[int, ...],
               is_mla: bool, **heads: Any) -> torch.Tensor:
    rows = torch.zeros(shape)
    generated.transfer(facts_vllm.SPEC_OF.get(layout, "") if not is_mla else facts_vllm.MLA_SPEC, host)().copy(
        memory_order(kv, names, layout, is_mla), slots(BLOCKS), rows, slots(list(range(len(BLOCKS)))), **heads)
    return rows


def load_back(layout: str, spec: Any, rows: torch.Tensor, host: str, is_mla: bool) -> None:
    """The canonical rows back into a fresh vLLM cache: the offloaded blocks as they were, nothing else."""
    kv, _, names = engine_cache(layout, spec)
    fill(kv, names)
    want = {n: kv[n].clone() for n in names}
    fresh, _, _ = engine_cache(layout, spec)
    generated.transfer(host, facts_vllm.MLA_SPEC if is_mla else facts_vllm.SPEC_OF[layout])().copy(
        rows, slots(list(range(len(BLOCKS)))), memory_order(fresh, names, layout, is_mla), slots(BLOCKS))
    others = [b for b in range(B) if b not in BLOCKS]
    for n in names:
        assert torch.equal(fresh[n][BLOCKS], want[n][BLOCKS])
        assert not fresh[n][others].any()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_moves_into_vllms_canonical_page_byte_exactly(layout: str) -> None:
    family = FAMILY[layout]
    ref_kv, ref_config, names = engine_cache(family, full())
    fill(ref_kv, names)
    ref_maps = mappings(ref_kv, ref_config, H)
    assert all(ref_maps[n].parallelism_agnostic for n in names)  # vLLM certifies the family's page
    page = ref_maps[names[0]].canonical_page_size_bytes
    want = torch.zeros(len(BLOCKS), L * page, dtype=torch.int8)
    vllm_rows(ref_kv, names, ref_maps, want)
    kv, config, _ = engine_cache(layout, full())
    fill(kv, names)
    own = mappings(kv, config, H)
    if vllm_layouts.KVCacheLayout[layout].is_block_compact:  # L and B outermost: a layer's page is one run
        assert all(own[n].parallelism_agnostic for n in names)
        mine = torch.zeros_like(want)
        vllm_rows(kv, names, own, mine)
        assert torch.equal(mine, want)  # the layout's own CopyRuns give its family's page
    else:
        assert not any(own[n].parallelism_agnostic for n in names)  # vLLM's opaque fallback: no canonical page
    host = CANONICAL[family]
    shape = (len(BLOCKS), L, N, H, 2 * C) if family == "LBNHC" else (len(BLOCKS), L, H, N, 2 * C)
    rows = kvgen_rows(layout, kv, names, host, shape, False)
    assert torch.equal(rows.view(torch.int8).reshape(len(BLOCKS), -1), want)
    load_back(layout, full(), rows, host, False)


@pytest.mark.parametrize("layout", COMPACT)
def test_padded_pages_move_into_vllms_canonical_page_byte_exactly(layout: str) -> None:
    """page_size_padded widens the block stride; the canonical page is the unpadded page's bytes."""
    spec = full(page_size_padded=H * N * 2 * C * 4 + 64)
    kv, config, names = engine_cache(layout, spec)
    fill(kv, names)
    maps = mappings(kv, config, H)
    assert all(maps[n].parallelism_agnostic for n in names)
    want = torch.zeros(len(BLOCKS), L * maps[names[0]].canonical_page_size_bytes, dtype=torch.int8)
    vllm_rows(kv, names, maps, want)
    family = FAMILY[layout]
    shape = (len(BLOCKS), L, N, H, 2 * C) if family == "LBNHC" else (len(BLOCKS), L, H, N, 2 * C)
    rows = kvgen_rows(layout, kv, names, CANONICAL[family], shape, False)
    assert torch.equal(rows.view(torch.int8).reshape(len(BLOCKS), -1), want)
    load_back(layout, spec, rows, CANONICAL[family], False)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mla_latent_moves_into_vllms_canonical_page_byte_exactly(layout: str) -> None:
    kv, config, names = engine_cache(layout, mla())
    fill(kv, names)
    maps = mappings(kv, config, 1)
    page = maps[names[0]].canonical_page_size_bytes
    want = torch.zeros(len(BLOCKS), L * page, dtype=torch.int8)
    vllm_rows(kv, names, maps, want)
    rows = kvgen_rows(layout, kv, names, "vllm_offload_mla", (len(BLOCKS), L, N, C), True)
    assert torch.equal(rows.view(torch.int8).reshape(len(BLOCKS), -1), want)
    load_back(layout, mla(), rows, "vllm_offload_mla", True)


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_tensor_parallel_ranks_tile_the_canonical_page_at_their_global_heads(layout: str) -> None:
    """Two TP ranks of H heads each: vLLM's runs put rank r's heads at global heads r*H..; kvgen's
    transfer with dst_heads does the same, so the two ranks' writes give one canonical page."""
    tp, total = 2, 2 * H
    want = kvgen = None
    for rank in range(tp):
        kv, config, names = engine_cache(layout, full())
        fill(kv, names, first_head=rank * H, heads_total=total)
        maps = mappings(kv, config, total, tp, rank)
        page = maps[names[0]].canonical_page_size_bytes
        if want is None:
            want = torch.zeros(len(BLOCKS), L * page, dtype=torch.int8)
            shape = (len(BLOCKS), L, N, total, 2 * C) if layout == "LBNHC" else (len(BLOCKS), L, total, N, 2 * C)
            kvgen = torch.zeros(shape)
        vllm_rows(kv, names, maps, want)
        generated.transfer(facts_vllm.SPEC_OF[layout], CANONICAL[layout])().copy(
            memory_order(kv, names, layout, False), slots(BLOCKS), kvgen, slots(list(range(len(BLOCKS)))),
            heads=HeadRanges((0, H), (rank * H, (rank + 1) * H)))
    assert torch.equal(kvgen.view(torch.int8).reshape(len(BLOCKS), -1), want)
    assert want.ne(0).view(len(BLOCKS), -1).any(dim=1).all()




@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC", "LBHNC"])
def test_a_canonical_spec_mutated_to_the_neighbouring_page_fails(layout: str) -> None:
    """With as many heads as slots both canonical pages have one shape and only the bytes tell them
    apart: the canonical spec with its N and H swapped (kvgen's reference reads the spec) must not
    give vLLM's bytes, and the spec as built must."""
    import dataclasses

    from kvgen.oracle.reference import transfers
    from kvgen.spec.library import load_library

    library = load_library()
    kv, config, names = engine_cache(layout, full(heads=N))
    fill(kv, names)
    maps = mappings(kv, config, N)
    want = torch.zeros(len(BLOCKS), L * maps[names[0]].canonical_page_size_bytes, dtype=torch.int8)
    vllm_rows(kv, names, maps, want)
    host = library[CANONICAL[FAMILY[layout]]]
    i, j = (next(k for k, d in enumerate(host.dims) if d.axes == (a,)) for a in ("N", "H"))
    swapped = list(host.dims)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    ext = {"L": L, "KV": 2, "B": B, "N": N, "H": N, "C": C}
    for spec, right in ((host, True), (dataclasses.replace(host, dims=tuple(swapped)), False)):
        rows = torch.zeros(len(BLOCKS), L, N, N, 2 * C)
        transfers.transfer(
            transfers.TransferSide(library[facts_vllm.SPEC_OF[layout]], ext,
                                            memory_order(kv, names, layout, False), slots(BLOCKS).tolist()),
            transfers.TransferSide(spec, {**ext, "B": len(BLOCKS)}, rows,
                                            slots(list(range(len(BLOCKS)))).tolist()))
        assert torch.equal(rows.view(torch.int8).reshape(len(BLOCKS), -1), want) is right


def test_the_layouts_are_vllms() -> None:
    members = list(vllm_layouts.KVCacheLayout)
    assert LAYOUTS == [m.name for m in members]
    assert COMPACT == [m.name for m in members if m.is_block_compact]
    assert FAMILY == {m.name: "LBNHC" if m.layer_view_order.index(2) < m.layer_view_order.index(1) else "LBHNC"
                      for m in members}
