"""LMCache 0.5.6's real cache engine on the CPU with kvgen's drop-in connectors as its GPU
connector: store, wipe the cache, retrieve, and compare bit for bit. Run as a script by
tests/test_lmcache_engine.py (LMCache leaves threads running, so the process ends itself
with os._exit); prints one line per case, `ok CASE` or `FAIL CASE: why`, then `done`, or
`skip: why` when LMCache's engine does not import here.

Every value of a cache encodes its place (layer, K/V, slot, head, content), so a K/V swap,
a transposition or a token in the wrong slot shows as a difference."""

from __future__ import annotations

import gc
import itertools
import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch

logging.disable(logging.ERROR)
# No usage telemetry from a test: with it on, LMCache probes the CPU in a py-cpuinfo subprocess
# (half a second) and reports at every engine it builds.
os.environ["LMCACHE_TRACK_USAGE"] = "false"

try:
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
except Exception as exc:  # lmcache, or one of its engine's imports, is missing
    print(f"skip: LMCache's engine does not import: {type(exc).__name__}: {exc}", flush=True)
    os._exit(0)

import kvgen.integrations.lmcache as kl  # noqa: E402

L, H, C, N, B = 2, 2, 8, 16, 80  # layers, heads, content per head, slots per block, blocks
CHUNK = 256
_ids = itertools.count()


def coded(shape: tuple[int, ...], layer: int, plane: int) -> torch.Tensor:
    """float32 values that are their own coordinates: layer, plane, then the flat index
    (exact in float32 below 2**24)."""
    n = torch.Size(shape).numel()
    return (torch.arange(n, dtype=torch.float32) + (layer * 2 + plane) * n).reshape(shape)


def engine(conn: Any, mla: bool = False, layerwise: bool = False) -> Any:
    meta = LMCacheMetadata(model_name="kvgen-test", world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.float32, use_mla=mla,
                           kv_shape=(L, 1 if mla else 2, CHUNK, 1 if mla else H, C))
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.05,
                                               use_layerwise=layerwise, save_unfull_chunk=False)
    built = LMCacheEngineBuilder.get_or_create(f"kvgen-{next(_ids)}", config, meta, conn(meta),
                                               lambda t, i: None, lambda o, i: o)
    built.post_init()
    return built


def vllm_cache() -> list[torch.Tensor]:
    return [torch.stack([coded((B, N, H, C), layer, kv) for kv in range(2)]) for layer in range(L)]


def mla_cache() -> list[torch.Tensor]:
    return [coded((B, N, C), layer, 0) for layer in range(L)]


def sglang_cache() -> list[list[torch.Tensor]]:
    return [[coded((B * N, H, C), layer, kv) for layer in range(L)] for kv in range(2)]


def vllm033_cache(layout: str) -> list[torch.Tensor]:
    """vLLM 0.33's per-layer logical [B, H, N, (K V) C] views of one KVCacheLayout, made by vLLM's own
    planning, allocate_kv_cache and create_kv_cache_views, coded through those views (vLLM's write
    kernel is CUDA-only)."""
    from types import SimpleNamespace

    from vllm.v1 import kv_cache_interface as iface
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    member = KVCacheLayout[layout]
    cache = SimpleNamespace(get_resolved_kv_cache_layout=lambda: member, prefix_cache_retention_interval=None,
                            num_gpu_blocks_override=B)  # the VllmConfig fields the planner reads
    config = SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=None), cache_config=cache)
    names = [f"attn.{i}" for i in range(L)]
    spec = iface.FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=C, dtype=torch.float32)
    kv_config = get_kv_cache_config_from_groups(config, [iface.KVCacheGroupSpec(names, spec)], 1 << 30)
    kv = allocate_kv_cache(kv_config, torch.device("cpu"), member)
    views = [kv[name] for name in names]
    for layer, view in enumerate(views):
        view.copy_(coded(tuple(view.shape), layer, 0))
    return views


def token_rows(cache: Any, slots: torch.Tensor, kind: str) -> list[torch.Tensor]:
    """Each leaf's values at `slots`, in token order."""
    if kind == "vllm033":
        return [leaf[slots // N, :, slots % N] for leaf in cache]
    if kind == "vllm":
        return [leaf[:, slots // N, slots % N] for leaf in cache]
    if kind == "mla":
        return [leaf[slots // N, slots % N] for leaf in cache]
    return [leaf[slots] for side in cache for leaf in side]


def leaves(cache: Any) -> list[torch.Tensor]:
    return [leaf for side in cache for leaf in side] if isinstance(cache[0], list) else list(cache)


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b, strict=True))


def run(eng: Any, cache: Any, kind: str, n_store: int, n_load: int, cached: int = 0,
        layerwise: bool = False) -> str | None:
    """Store the first n_store tokens, zero the cache, retrieve n_load tokens; the hit must be
    the whole chunks stored, restored exactly, and every other slot left zero."""
    tokens = torch.arange(1000, 1000 + max(n_store, n_load))
    mapping = torch.randperm(B * N, generator=torch.Generator().manual_seed(n_store + n_load))[:tokens.numel()]
    want = token_rows(cache, mapping, kind)
    store_kw: dict[str, Any] = {"kvcaches": cache, "slot_mapping": mapping[:n_store]}
    if kind == "sglang":
        store_kw["offset"] = 0
    if layerwise:
        for _ in eng.store_layer(tokens[:n_store], sync=True, **store_kw):
            pass
    else:
        eng.store(tokens[:n_store], **store_kw)
    for leaf in leaves(cache):
        leaf.zero_()
    load_kw: dict[str, Any] = {"kvcaches": cache, "slot_mapping": mapping[:n_load]}
    if cached:
        load_kw["vllm_cached_tokens"] = cached
    if layerwise:
        got_mask = list(eng.retrieve_layer(tokens[:n_load], sync=True, **load_kw))[-1]  # the last yield: the mask
    else:
        got_mask = eng.retrieve(tokens[:n_load], **load_kw)
    hit = min(n_store, n_load) // CHUNK * CHUNK
    if got_mask is None or int(got_mask.sum()) != hit:
        return f"retrieved {None if got_mask is None else int(got_mask.sum())} tokens, expected {hit}"
    got = token_rows(cache, mapping, kind)
    restored = [g[..., cached:hit, :, :] if kind == "vllm" else g[cached:hit] for g in got]
    expected = [w[..., cached:hit, :, :] if kind == "vllm" else w[cached:hit] for w in want]
    if not same(restored, expected):
        return "retrieved values differ from the stored ones"
    total = sum(int(leaf.count_nonzero()) for leaf in leaves(cache))
    written = sum(int(r.count_nonzero()) for r in restored)
    if total != written:
        return f"{total - written} values written outside the retrieved tokens"
    return None


def drop_in(cls: Any, **hints: Any) -> Callable[[Any], Any]:
    """The drop-in class as LMCache builds it from its metadata, with LMCache's layout_hints."""
    return lambda meta: cls.from_metadata(meta, device="cpu", layout_hints=hints)


#: The [2, B, N, H, C] and [B, N, C] caches below are vLLM's before 0.33 (from 0.33 every layer is a
#: [B, H, N, (K V) C] view): the release is named, since with vllm 0.33 installed it is the default.
BEFORE_033 = {"engine_version": "0.32.0"}

CASES: dict[str, Callable[[], str | None]] = {
    "store-retrieve": lambda: run(engine(drop_in(kl.VLLMPagedMemGPUConnectorV2, **BEFORE_033)),
                                  vllm_cache(), "vllm", 512, 512),
    "prefix-hit": lambda: run(engine(drop_in(kl.VLLMPagedMemGPUConnectorV2, **BEFORE_033)),
                              vllm_cache(), "vllm", 512, 900),
    "vllm-cached-tokens": lambda: run(engine(drop_in(kl.VLLMPagedMemGPUConnectorV2, **BEFORE_033)),
                                      vllm_cache(), "vllm", 768, 768, cached=300),
    "layerwise": lambda: run(engine(drop_in(kl.VLLMPagedMemLayerwiseGPUConnector, **BEFORE_033),
                                    layerwise=True), vllm_cache(), "vllm", 512, 512, layerwise=True),
    "mla": lambda: run(engine(drop_in(kl.VLLMPagedMemGPUConnectorV2, **BEFORE_033), mla=True),
                       mla_cache(), "mla", 512, 512),
    "sglang": lambda: run(engine(lambda m: kl.SGLangGPUConnector.from_metadata(m, device="cpu")),
                          sglang_cache(), "sglang", 512, 512),
}


def vllm033_case(layout: str) -> Callable[[], str | None]:
    """vLLM 0.33's views of `layout` through the drop-in, the layout named by LMCache's layout_hints."""
    return lambda: run(engine(drop_in(kl.VLLMPagedMemGPUConnectorV2, kv_layout=layout)), vllm033_cache(layout),
                       "vllm033", 512, 512)


CASES.update({f"vllm033-{layout}": vllm033_case(layout)
              for layout in ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")})


def main(names: list[str]) -> None:
    # Each engine LMCache builds runs gc.collect(), which walks every object alive (torch's and, once
    # the first engine imports it, vLLM's: about 0.7 s each time); the objects of the imports are
    # kept for good, so moving them out of the collector's reach changes nothing but that time.
    try:
        import vllm.v1.core.kv_cache_utils  # noqa: F401  (what LMCache's token database imports on first use)
    except ImportError:
        pass  # without vLLM, LMCache hashes tokens its own way
    gc.freeze()
    for name in names or list(CASES):
        try:
            why = CASES[name]()
        except Exception:
            why = traceback.format_exc().strip().replace("\n", " | ")
        print(f"ok {name}" if why is None else f"FAIL {name}: {why}", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    finally:
        os._exit(0)  # LMCache's engines leave non-daemon threads behind
