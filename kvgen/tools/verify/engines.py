"""`kvgen verify`'s engine checks: the hand-written facts (kvgen.oracle.facts*) against an
engine's own code, where that engine imports in this Python, or one line saying they were
skipped and why (an engine may pin another torch: SGLang 0.5.23 runs in .venv-sglang, made by
`scripts/dev engines`).

SGLang: pools built with SGLang's own classes on CPU, elements written with the pool's own
`set_kv_buffer`; each fact's shape must be the live buffer's and its address of each written
element must hold that element. The HiCache host pools' transfers are GPU kernels, so their
facts are checked by shape only (tests/test_engine_sglang.py moves data through them).

vLLM: caches built with vLLM's own FullAttentionSpec / MLAAttentionSpec, KVCacheTensor planning
(get_kv_cache_config_from_groups) and create_kv_cache_views (through allocate_kv_cache) for
every KVCacheLayout; vLLM's write kernel is CUDA-only, so values are written through its logical
[B, H, N, C] view (C: K's head_size values, then V's). Each fact's KVCacheLayout table entry must
be vLLM's, its memory order the one vLLM's compute_layout_strides gives, its shape the live view's
in that order, and its address of each element must hold that element. The canonical offload
pages (facts.host: vllm_canonical_lbnhc / _lbhnc, vllm_offload_mla) against the CPU rows vLLM's
own CopyRuns (derive_canonical_mappings, one TP rank) make from such a cache.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Callable
from math import prod
from types import SimpleNamespace
from typing import Any

from kvgen.oracle.facts import vllm as facts_vllm

SGLANG = "0.5.23"
WHERE = "`scripts/dev engines` runs them in .venv-sglang"
VLLM = "0.33.0"
VLLM_WHERE = "`scripts/dev test` installs vllm==0.33.0 unless KVGEN_NO_ENGINES=1"


class Skipped(Exception):
    """Why an engine's checks cannot run in this Python."""


def _sglang_modules() -> tuple[Any, Any]:
    if importlib.util.find_spec("sglang") is None:
        raise Skipped(f"sglang is not installed in this Python; {WHERE}")
    version = importlib.metadata.version("sglang")
    if version != SGLANG:
        raise Skipped(f"sglang {version} is installed, these facts describe {SGLANG}")
    try:
        # sglang: optional; its checks skip without it
        from sglang.srt.mem_cache import memory_pool
        from sglang.srt.mem_cache.pool_host import mha
    except Exception as exc:  # noqa: BLE001 - any failure of SGLang's import chain means: not here
        raise Skipped(f"sglang does not import here ({type(exc).__name__}: {exc}); {WHERE}") from None
    return memory_pool, mha


class _Layer:
    def __init__(self, layer_id: int):
        self.layer_id = layer_id  # all set_kv_buffer reads of SGLang's RadixAttention


def sglang_disagreements() -> tuple[list[str], int]:
    """(what disagrees, how many facts were checked) for SGLang's pools; Skipped when SGLang
    cannot run here."""
    # torch: only where the engine imports
    import torch

    from kvgen.oracle.facts.layouts import FACTS, EngineGeometry
    from kvgen.oracle.facts.planes import PARTS_FACTS

    mp, host_mod = _sglang_modules()
    L, H, PAGE, C, SIZE = 3, 4, 16, 8, 48  # H != PAGE: a swap of heads and slots shows
    rows = SIZE + PAGE
    slots = torch.tensor([3, 17, 40, 63])

    def code(layer: int, kv: int, slot: int, h: int, c: int) -> float:
        return float((((layer * 2 + kv) * rows + slot) * H + h) * C + c)

    def values(layer: int, kv: int, heads: int, width: int) -> torch.Tensor:
        return torch.tensor([[[code(layer, kv, s, h, c) for c in range(width)] for h in range(heads)]
                             for s in slots.tolist()])

    def mha(hnd: bool) -> Any:
        saved = os.environ.get("SGLANG_USE_HND_KVCACHE")
        if hnd:
            os.environ["SGLANG_USE_HND_KVCACHE"] = "1"  # how a server asks for the HND pool
        else:
            os.environ.pop("SGLANG_USE_HND_KVCACHE", None)
        try:
            return mp.MHATokenToKVPool(size=SIZE, page_size=PAGE, dtype=torch.float32, head_num=H, head_dim=C,
                                       layer_num=L, device="cpu", enable_memory_saver=False,
                                       enable_alt_stream=False)
        finally:
            if saved is None:
                os.environ.pop("SGLANG_USE_HND_KVCACHE", None)
            else:
                os.environ["SGLANG_USE_HND_KVCACHE"] = saved

    wrong: list[str] = []

    def holds(name: str, tree: Any, g: EngineGeometry, kvs: int, heads: int) -> None:
        fact, leaf = FACTS[name], tree
        while isinstance(leaf, (list, tuple)):
            leaf = leaf[0]
        if tuple(leaf.shape) != fact.shape(g):
            wrong.append(f"{name}: SGLang's buffer is {list(leaf.shape)}, the fact says {list(fact.shape(g))}")
            return
        if kvs == 0:
            return  # shape only
        for layer in range(L):
            for kv in range(kvs):
                for s in slots.tolist():
                    for h in range(heads):
                        path, index = fact.address(g, layer, kv, s, h, 0)
                        node = tree
                        try:
                            for i in path:
                                node = node[i]
                            got = node[index[:-1]][index[-1]:index[-1] + leaf.shape[-1]]
                        except IndexError:
                            got = None  # the fact's address lies outside SGLang's buffer
                        want = torch.tensor([code(layer, kv, s, h, c) for c in range(C)])
                        if got is None or not torch.equal(got, want):
                            wrong.append(f"{name}: layer {layer}, {'KV'[kv]}, slot {s}, head {h} is not where "
                                         f"the fact says {index}")
                            return

    g = EngineGeometry(L=L, B=rows // PAGE, N=PAGE, H=H, C=C)
    for hnd, name in ((False, "sglang_mha"), (True, "sglang_mha_hnd")):
        pool = mha(hnd)
        for layer in range(L):
            pool.set_kv_buffer(_Layer(layer), slots, values(layer, 0, H, C), values(layer, 1, H, C))
        holds(name, [list(pool.k_buffer), list(pool.v_buffer)], g, 2, H)
    mla = mp.MLATokenToKVPool(size=SIZE, page_size=PAGE, dtype=torch.float32, kv_lora_rank=C - 2,
                              qk_rope_head_dim=2, layer_num=L, device="cpu", enable_memory_saver=False)
    mla.dcp_replicated = True  # a single rank: set_kv_buffer asks no parallel context
    for layer in range(L):
        mla.set_kv_buffer(_Layer(layer), slots, values(layer, 0, 1, C), None)
    holds("sglang_mla", list(mla.kv_buffer), EngineGeometry(L=L, B=rows // PAGE, N=PAGE, H=1, C=C), 1, 1)
    info = mha(False).get_device_pool_infos()[0].buffer_info
    hosts = [(f"hicache_{w}", w, 1) for w in ("layer_first", "page_first", "page_first_direct", "page_head",
                                               "page_unified")]
    for name, layout, groups in [*hosts, ("hicache_page_unified_per_head", "page_unified", H),
                                 ("hicache_page_unified_grouped", "page_unified", 2)]:
        host = host_mod.MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                             device_capacity_tokens=SIZE, start_layer=0, end_layer=L,
                                             head_group_num=groups)
        g = EngineGeometry(L=L, B=host.size // PAGE, N=PAGE, H=H, C=C)
        if name in PARTS_FACTS:  # a tiled pool (its fact: two heads per group): its shape
            want = PARTS_FACTS[name].parts[0].shape(g)
            if tuple(host.kv_buffer.shape) != want:
                wrong.append(f"{name}: SGLang's buffer is {list(host.kv_buffer.shape)}, the fact says {list(want)}")
            continue
        holds(name, host.kv_buffer, g, 0, H)
    return wrong, 10


def _vllm_modules() -> tuple[Any, Any, Any, Any, Any]:
    if importlib.util.find_spec("vllm") is None:
        raise Skipped(f"vllm is not installed in this Python; {VLLM_WHERE}")
    version = importlib.metadata.version("vllm")
    if version != VLLM:
        raise Skipped(f"vllm {version} is installed, these facts describe {VLLM}")
    try:
        # vllm: optional; its checks skip without it
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading import canonical_mapping
        from vllm.v1 import kv_cache_interface, kv_cache_layout
        from vllm.v1.core import kv_cache_planning
        from vllm.v1.worker import utils
    except Exception as exc:  # noqa: BLE001 - any failure of vLLM's import chain means: not here
        raise Skipped(f"vllm does not import here ({type(exc).__name__}: {exc}); {VLLM_WHERE}") from None
    return kv_cache_interface, kv_cache_layout, kv_cache_planning, utils, canonical_mapping


def vllm_disagreements() -> tuple[list[str], int]:
    """(what disagrees, how many facts were checked) for vLLM's caches, every KVCacheLayout with
    and without MLA, and the canonical offload pages (facts.host) against the CopyRuns of vLLM's
    derive_canonical_mappings; Skipped when vLLM cannot run here."""
    # torch: only where the engine imports
    import torch

    from kvgen.oracle.facts.layouts import FACTS, EngineGeometry

    iface, layouts, planning, worker, canonical = _vllm_modules()
    L, B, N, H, C = 2, 5, 4, 3, 6  # no two extents equal: a swap of any two axes shows
    names = [f"layer.{i}" for i in range(L)]
    wrong: list[str] = []

    def live(layout: Any, spec: Any) -> tuple[dict[str, torch.Tensor], Any]:
        """vLLM's per-layer views of one group of L layers, coded through the logical view, and its
        KVCacheConfig."""
        cache = SimpleNamespace(get_resolved_kv_cache_layout=lambda: layout, prefix_cache_retention_interval=None,
                                num_gpu_blocks_override=B)  # the VllmConfig fields the planner reads
        config = SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=None), cache_config=cache)
        kv_config = planning.get_kv_cache_config_from_groups(config, [iface.KVCacheGroupSpec(names, spec)], 1 << 30)
        views = worker.allocate_kv_cache(kv_config, torch.device("cpu"), layout)
        for layer, name in enumerate(names):  # through vLLM's logical [B, H, N, C] view
            view = views[name]
            view.copy_(torch.arange(view.numel(), dtype=view.dtype).reshape(view.shape) + 1 + layer * view.numel())
        return views, kv_config

    def holds(name: str, tensors: list[torch.Tensor], views: list[torch.Tensor], g: EngineGeometry, kvs: int) -> None:
        """Every element of vLLM's logical views is where the fact says in `tensors` (by path)."""
        fact = FACTS[name]
        if tuple(tensors[0].shape) != fact.shape(g):
            wrong.append(f"{name}: vLLM's tensor in memory order is {list(tensors[0].shape)}, "
                         f"the fact says {list(fact.shape(g))}")
            return
        for layer in range(L):
            for kv in range(kvs):
                for slot in range(B * N):
                    for h in range(g.H):
                        path, index = fact.address(g, layer, kv, slot, h, 0)
                        logical = views[layer][slot // N, h, slot % N, kv * C:(kv + 1) * C]
                        try:
                            got = tensors[path[0] if path else 0][index[:-1]][index[-1]:index[-1] + C]
                        except IndexError:
                            got = None  # the fact's address lies outside vLLM's tensor
                        if got is None or not torch.equal(got, logical):
                            wrong.append(f"{name}: layer {layer}, {'KV'[kv]}, slot {slot}, head {h} is not where "
                                         f"the fact says {index}")
                            return

    def check(name: str, layout: Any, spec: Any, heads: int, kvs: int) -> None:
        strides = iface.compute_layout_strides(spec, B, L, layout)
        physical = [strides[i] for i in layout.value]  # vLLM's byte strides, in the fact's memory order
        if physical != sorted(physical, reverse=True):
            wrong.append(f"{name}: vLLM's strides {list(strides)} are not in the order {layout.value} the fact says")
            return
        # MLA's one head slot: the logical order is the memory order, up to that size-1 axis
        order = (0, 1, 2, 3) if FACTS[name].mla else facts_vllm.layer_view_order(layout.name)
        kv, _ = live(layout, spec)
        views = [kv[n] for n in names]
        holds(name, [v.permute(*order) for v in views], views, EngineGeometry(L=L, B=B, N=N, H=heads, C=C), kvs)

    def offload(name: str, layout: Any, spec: Any, heads: int, kvs: int) -> None:
        """The canonical CPU rows of all B blocks, made by applying vLLM's CopyRuns of one TP rank
        to each layer's worker page (the bytes from the layer view's block b on), the layers' pages
        one after another in a row."""
        kv, kv_config = live(layout, spec)
        parallel = SimpleNamespace(tensor_parallel_size=1, prefill_context_parallel_size=1, world_size=1,
                                   decode_context_parallel_size=1, cp_kv_cache_interleave_size=1, rank=0)
        vllm_config = SimpleNamespace(parallel_config=parallel,
                                      model_config=SimpleNamespace(get_total_num_kv_heads=lambda: heads))
        maps = canonical.derive_canonical_mappings(vllm_config, kv_config, kv)
        page = maps[names[0]].canonical_page_size_bytes
        rows = torch.zeros(B, L * page, dtype=torch.int8)
        for b in range(B):
            for layer, n in enumerate(names):
                raw = torch.tensor([], dtype=torch.int8).set_(kv[n].untyped_storage())
                base = (kv[n].storage_offset() + b * kv[n].stride(0)) * kv[n].element_size()
                for run in maps[n].runs:
                    for i in range(run.num_fragments):
                        src, dst = base + run.local_offset + i * run.local_stride, \
                            layer * page + run.canonical_offset + i * run.canonical_stride
                        rows[b, dst:dst + run.fragment_size] = raw[src:src + run.fragment_size]
        g = EngineGeometry(L=L, B=B, N=N, H=heads, C=C)
        flat = rows.view(torch.float32)
        if flat.numel() != prod(FACTS[name].shape(g)):
            wrong.append(f"{name}: vLLM's canonical rows are {list(rows.shape)} bytes, the fact says "
                         f"{list(FACTS[name].shape(g))} float32")
            return
        holds(name, [flat.reshape(FACTS[name].shape(g))], [kv[n] for n in names], g, kvs)

    members = list(layouts.KVCacheLayout)
    if {m.name: m.value for m in members} != facts_vllm.KV_CACHE_LAYOUTS:
        wrong.append(f"KVCacheLayout: vLLM's members are {[(m.name, m.value) for m in members]}, the facts say "
                     f"{sorted(facts_vllm.KV_CACHE_LAYOUTS.items())}")
    full = iface.FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=C, dtype=torch.float32)
    mla = iface.MLAAttentionSpec(block_size=N, num_kv_heads=1, head_size=C, dtype=torch.float32)
    for member in members:
        if member.name in facts_vllm.SPEC_OF:  # else reported above
            check(facts_vllm.SPEC_OF[member.name], member, full, H, 2)
            check(facts_vllm.MLA_SPEC, member, mla, 1, 1)
    for name, layout, spec, heads, kvs in (("vllm_canonical_lbnhc", "LBNHC", full, H, 2),
                                           ("vllm_canonical_lbhnc", "LBHNC", full, H, 2),
                                           ("vllm_offload_mla", "LBNHC", mla, 1, 1)):
        offload(name, layouts.KVCacheLayout[layout], spec, heads, kvs)
    return wrong, 1 + 2 * len(members) + 3


#: engine -> (release the facts describe, what is checked, the check).
ENGINES: dict[str, tuple[str, str, Callable[[], tuple[list[str], int]]]] = {
    "SGLang": (SGLANG, "pool facts agree with the engine's live pools", sglang_disagreements),
    "vLLM": (VLLM, "cache facts agree with the engine's live caches", vllm_disagreements),
}


def run() -> int:
    """Print each engine's result (or why it was skipped); the number of disagreements."""
    failures = 0
    for engine, (release, what, check) in ENGINES.items():
        try:
            wrong, checked = check()
        except Skipped as why:
            print(f"{engine} {release} engine checks skipped: {why}")
            continue
        for line in wrong:
            print(f"kvgen verify: {engine} {release}: {line}", file=sys.stderr)
        print(f"{checked - len(wrong)} of {checked} {engine} {release} {what}")
        failures += len(wrong)
    return failures
