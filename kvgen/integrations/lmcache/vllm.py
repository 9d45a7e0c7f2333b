"""LMCache's vLLM connectors, moved by kvgen: V2 and V3 (whole chunks, KV_2LTD or
KV_MLA_FMT), the paged layerwise connector (KV_T2D or per-layer KV_MLA_FMT), and their
XPU twins. Same names, constructors, attributes, methods, keyword arguments and yield
counts as in lmcache 0.5.6; the layout is detected from the live cache, never assumed.

vLLM's keyword arguments: `kvcaches`, `slot_mapping` (one slot per token of the whole
sequence), `vllm_cached_tokens` on loads (tokens the engine already holds are left alone,
as LMCache's skip_prefix_n_tokens does), `sync` for layerwise. `offset` (sent with stores)
only shapes LMCache's token mask; vLLM's mapping covers the whole sequence, so it is not a
slot offset here, exactly as in LMCache.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvgen.errors import KVLayoutError
from kvgen.integrations.lmcache._compat import register_virtual_subclass
from kvgen.integrations.lmcache.base import LayerwiseAdapter, WholeAdapter


class _VLLM:
    ENGINE = "vllm"

    def _hints(self) -> dict[str, Any]:
        """LMCache's layout_hints (kv_layout: vLLM's KVCacheLayout name, or NHD / HND) and
        metadata, passed on as they are. No order is assumed for a cache handed over as it
        lies: vLLM's CPU attention keeps heads before slots, so a contiguous cache with as
        many heads as slots is refused until kv_layout names it (detection itself knows that
        a *permuted* pre-0.33 view is vLLM's slots-before-heads logical order)."""
        return super()._hints()  # type: ignore[misc]

    def _store_extra(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        return {}

    def _load_extra(self, kwargs: Mapping[str, Any], mapping: Any, starts: Sequence[int], ends: Sequence[int]
                    ) -> tuple[dict[str, Any], Any]:
        """vllm_cached_tokens -> the first tokens of each chunk that the load leaves alone:
        one skip_prefix_n_tokens when every chunk skips the same, else those tokens' slots
        masked (-1) in a copy of the mapping."""
        cached = _cached_tokens(kwargs.get("vllm_cached_tokens"))
        skips = [min(e - s, max(0, cached - s)) for s, e in zip(starts, ends, strict=False)]
        if not any(skips):
            return {}, mapping
        if len(set(skips)) == 1:
            return {"skip_prefix_n_tokens": skips[0]}, mapping
        masked = mapping.clone()
        masked[:min(cached, masked.shape[0])] = -1
        return {}, masked


def _cached_tokens(value: Any) -> int:
    """vllm_cached_tokens as a count: None is 0 (LMCache's default); an int (or an integer
    0-d tensor) >= 0 is taken as it is; anything else is refused, never rounded or parsed."""
    if value is None:
        return 0
    try:
        count = operator.index(value) if not isinstance(value, bool) else -1
    except TypeError:
        count = -1
    if count < 0:
        raise KVLayoutError(f"vllm_cached_tokens must be a whole number >= 0, got {value!r}")
    return count


def _from_kv_shape(metadata: Any) -> tuple[int, int, int, int]:
    """(num_layers, chunk_size, num_kv_heads, head_size) from metadata.kv_shape."""
    num_layers, _, chunk_size, num_kv_heads, head_size = (int(x) for x in metadata.kv_shape)
    return num_layers, chunk_size, num_kv_heads, head_size


class VLLMPagedMemGPUConnectorV2(_VLLM, WholeAdapter):
    """vLLM paged cache <-> whole-chunk objects ([2, L, T, H*C] KV_2LTD, or [1, L, T, C]
    KV_MLA_FMT with use_mla), any layout kvgen describes."""

    def __init__(self, hidden_dim_size: int, num_layers: int, use_gpu: bool = False, **kwargs: Any):
        self._setup(hidden_dim_size, num_layers, use_gpu, kwargs)
        #: LMCache's intermediate device buffer; kvgen stages through its own (use_gpu).
        self.gpu_buffer: torch.Tensor | None = None

    @classmethod
    def from_metadata(cls, metadata: Any, use_gpu: bool = False, device: Any = None,
                      layout_hints: Mapping[str, Any] | None = None) -> VLLMPagedMemGPUConnectorV2:
        num_layers, chunk_size, num_kv_heads, head_size = _from_kv_shape(metadata)
        return cls(hidden_dim_size=num_kv_heads * head_size, num_layers=num_layers, use_gpu=use_gpu,
                   chunk_size=chunk_size, dtype=metadata.kv_dtype, device=device, use_mla=metadata.use_mla,
                   layout_hints=layout_hints, kvgen_hints={"num_kv_heads": num_kv_heads, "head_size": head_size})


class VLLMPagedMemGPUConnectorV3(_VLLM, WholeAdapter):
    """LMCache's metadata-driven V3 connector for one KV-cache group (layer groups with
    their own geometry are refused)."""

    def __init__(self, metadata: Any, device: Any, use_gpu: bool = False,
                 layout_hints: Mapping[str, Any] | None = None):
        num_layers, _, num_kv_heads, head_size = _from_kv_shape(metadata)
        manager = getattr(metadata, "kv_layer_groups_manager", None)
        groups = getattr(manager, "kernel_groups", None) if manager is not None else None
        if groups is not None and len(groups) > 1:
            raise KVLayoutError(f"{type(self).__name__}: the cache has {len(groups)} layer groups; kvgen's "
                                "LMCache connectors move caches whose layers share one geometry")
        self._setup(num_kv_heads * head_size, num_layers, use_gpu,
                    {"chunk_size": getattr(metadata, "chunk_size", None), "dtype": metadata.kv_dtype, "device": device,
                     "use_mla": metadata.use_mla, "layout_hints": layout_hints,
                     "kvgen_hints": {"num_kv_heads": num_kv_heads, "head_size": head_size}})
        self.metadata = metadata
        self.init = False
        self.group_kv_cache_pointers_on_gpu: list[torch.Tensor] | None = None
        self.group_tmp_buffer: list[torch.Tensor] | None = None

    @classmethod
    def from_metadata(cls, metadata: Any, use_gpu: bool = False, device: Any = None,
                      layout_hints: Mapping[str, Any] | None = None) -> VLLMPagedMemGPUConnectorV3:
        return cls(metadata, device, use_gpu, layout_hints=layout_hints)

    def _bind(self, kwargs: Mapping[str, Any]) -> tuple[Any, Any]:
        bound = super()._bind(kwargs)
        self.init = True
        return bound


class VLLMPagedMemLayerwiseGPUConnector(_VLLM, LayerwiseAdapter):
    """vLLM paged cache <-> per-layer objects ([T, 2, H*C] KV_T2D, or [T, C] KV_MLA_FMT),
    layer by layer through generators."""

    def __init__(self, hidden_dim_size: int, num_layers: int, use_gpu: bool = False, **kwargs: Any):
        self._setup(hidden_dim_size, num_layers, use_gpu, kwargs)
        #: None until the first transfer with use_gpu (LMCache's semantics).
        self.gpu_buffer_allocator: Any = None
        self.element_size = torch.empty((), dtype=self.dtype).element_size() if self.dtype is not None else None

    @classmethod
    def from_metadata(cls, metadata: Any, use_gpu: bool = False, device: Any = None,
                      layout_hints: Mapping[str, Any] | None = None) -> VLLMPagedMemLayerwiseGPUConnector:
        num_layers, chunk_size, num_kv_heads, head_size = _from_kv_shape(metadata)
        return cls(hidden_dim_size=num_kv_heads * head_size, num_layers=num_layers, use_gpu=use_gpu,
                   chunk_size=chunk_size, dtype=metadata.kv_dtype, device=device, use_mla=metadata.use_mla,
                   layout_hints=layout_hints, kvgen_hints={"num_kv_heads": num_kv_heads, "head_size": head_size})


class VLLMPagedMemXPUConnectorV2(VLLMPagedMemGPUConnectorV2):
    """The XPU twin of VLLMPagedMemGPUConnectorV2 (one implementation serves every device)."""


class VLLMPagedMemXPUConnectorV3(VLLMPagedMemGPUConnectorV3):
    """The XPU twin of VLLMPagedMemGPUConnectorV3 (LMCache's takes no layout_hints)."""

    def __init__(self, metadata: Any, device: Any, use_gpu: bool = False):
        super().__init__(metadata, device, use_gpu)

    @classmethod
    def from_metadata(cls, metadata: Any, use_gpu: bool = False, device: Any = None,
                      layout_hints: Mapping[str, Any] | None = None) -> VLLMPagedMemXPUConnectorV3:
        conn = cls(metadata, device, use_gpu)
        conn.layout_hints.update(layout_hints or {})
        return conn


class VLLMPagedMemLayerwiseXPUConnector(VLLMPagedMemLayerwiseGPUConnector):
    """The XPU twin of VLLMPagedMemLayerwiseGPUConnector."""


for _cls, _module in ((VLLMPagedMemGPUConnectorV2, "gpu_connectors"), (VLLMPagedMemGPUConnectorV3, "gpu_connectors"),
                      (VLLMPagedMemLayerwiseGPUConnector, "gpu_connectors"),
                      (VLLMPagedMemXPUConnectorV2, "xpu_connectors"), (VLLMPagedMemXPUConnectorV3, "xpu_connectors"),
                      (VLLMPagedMemLayerwiseXPUConnector, "xpu_connectors")):
    register_virtual_subclass(_cls, f"lmcache.v1.gpu_connector.{_module}", _cls.__name__)
