"""LMCache's SGLang connectors, moved by kvgen: whole chunks and layerwise, with their XPU
twins. Same constructors, attributes, methods, keyword arguments and yield counts as in
lmcache 0.5.6, plus `from_metadata` like the vLLM connectors.

SGLang's keyword arguments: `kvcaches` ([K layers, V layers] of [B*N, H, C], or a list of
[B*N, 1, C] for MLA), `slot_mapping` and `offset`. A store passes the mapping of the whole
sequence (`offset` then only shapes LMCache's token mask); a load passes the mapping from
`offset` on, so token i's slot is `slot_mapping[i - offset]`. kvgen honours `offset` on
every load, layerwise ones included (LMCache's layerwise load ignores it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvgen.integrations.lmcache._compat import register_virtual_subclass
from kvgen.integrations.lmcache.base import LayerwiseAdapter, WholeAdapter


class _SGLang:
    ENGINE = "sglang"

    def _store_extra(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        return {}

    def _load_extra(self, kwargs: Mapping[str, Any], mapping: Any, starts: Sequence[int], ends: Sequence[int]
                    ) -> tuple[dict[str, Any], Any]:
        return {"offset": int(kwargs.get("offset", 0) or 0)}, mapping

    @classmethod
    def from_metadata(cls, metadata: Any, use_gpu: bool = False, device: Any = None,
                      layout_hints: Mapping[str, Any] | None = None) -> Any:
        num_layers, _, chunk_size, num_kv_heads, head_size = (int(x) for x in metadata.kv_shape)
        return cls(num_kv_heads * head_size, num_layers, use_gpu=use_gpu, chunk_size=chunk_size,
                   dtype=metadata.kv_dtype, device=device, use_mla=metadata.use_mla, layout_hints=layout_hints,
                   kvgen_hints={"num_kv_heads": num_kv_heads, "head_size": head_size})


class SGLangGPUConnector(_SGLang, WholeAdapter):
    """SGLang's token pools <-> whole-chunk objects (KV_2LTD, or KV_MLA_FMT with use_mla)."""

    def __init__(self, hidden_dim_size: int, num_layers: int, use_gpu: bool = False, **kwargs: Any):
        self._setup(hidden_dim_size, num_layers, use_gpu, kwargs)
        self.num_kv_cache = num_layers if self.use_mla else num_layers * 2
        self.page_buffer_size = 0
        self.gpu_buffer: torch.Tensor | None = None

    def _bind(self, kwargs: Mapping[str, Any]) -> tuple[Any, Any]:
        bound = super()._bind(kwargs)
        assert self.detection is not None
        self.page_buffer_size = self.detection.extents["S"]
        return bound


class SGLangLayerwiseGPUConnector(_SGLang, LayerwiseAdapter):
    """SGLang's token pools <-> per-layer objects (KV_T2D), layer by layer."""

    def __init__(self, hidden_dim_size: int, num_layers: int, use_gpu: bool = False, **kwargs: Any):
        self._setup(hidden_dim_size, num_layers, use_gpu, kwargs)
        self.num_kv_cache = num_layers if self.use_mla else num_layers * 2
        self.page_buffer_size = 0
        self.gpu_buffer: torch.Tensor | None = None
        self.gpu_buffer_allocator: Any = None
        self.element_size = torch.empty((), dtype=self.dtype).element_size() if self.dtype is not None else None


class SGLangXPUConnector(SGLangGPUConnector):
    """The XPU twin of SGLangGPUConnector."""


class SGLangLayerwiseXPUConnector(SGLangLayerwiseGPUConnector):
    """The XPU twin of SGLangLayerwiseGPUConnector."""


for _cls, _module in ((SGLangGPUConnector, "gpu_connectors"), (SGLangLayerwiseGPUConnector, "gpu_connectors"),
                      (SGLangXPUConnector, "xpu_connectors"), (SGLangLayerwiseXPUConnector, "xpu_connectors")):
    register_virtual_subclass(_cls, f"lmcache.v1.gpu_connector.{_module}", _cls.__name__)
