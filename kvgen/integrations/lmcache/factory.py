"""`create_gpu_connector`: LMCache's CreateGPUConnector with kvgen's connectors, so a
deployment swaps one call."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvgen.errors import KVLayoutError
from kvgen.integrations.lmcache._compat import lmcache_module
from kvgen.integrations.lmcache.sglang import (
    SGLangGPUConnector,
    SGLangLayerwiseGPUConnector,
    SGLangLayerwiseXPUConnector,
    SGLangXPUConnector,
)
from kvgen.integrations.lmcache.trtllm import TRTLLMGPUConnector
from kvgen.integrations.lmcache.vllm import (
    VLLMPagedMemGPUConnectorV2,
    VLLMPagedMemGPUConnectorV3,
    VLLMPagedMemLayerwiseGPUConnector,
    VLLMPagedMemLayerwiseXPUConnector,
    VLLMPagedMemXPUConnectorV2,
    VLLMPagedMemXPUConnectorV3,
)


def device_type() -> str:
    """The accelerator this process runs on, as LMCache picks it: cuda, then xpu, else cpu."""
    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    return "cpu"


#: vLLM features LMCache implements only on some devices; it refuses them elsewhere, and so
#: does kvgen, so a configuration behaves the same with either factory.
_DEVICE_SCOPED = ("enable_blending", "use_gpu_connector_v3")
_FEATURE_DEVICES = ("cuda", "xpu")


def _refuse_unsupported(config: Any, kind: str) -> None:
    for flag in _DEVICE_SCOPED:
        if kind not in _FEATURE_DEVICES and bool(getattr(config, flag, False)):
            raise KVLayoutError(f"config.{flag}=True is only supported on {'/'.join(_FEATURE_DEVICES)}; the active "
                                f"device is '{kind}'. Set {flag}=False or run on a supported accelerator build.")


def _engine(engine: Any) -> str:
    return str(getattr(engine, "value", engine)).lower()


def _device(metadata: Any) -> torch.device:
    """The worker's device, made current (LMCache's local_worker_id on the active accelerator)."""
    kind = device_type()
    local = int(getattr(metadata, "local_worker_id", 0) or 0)
    if kind == "cpu":
        return torch.device("cpu")
    getattr(torch, kind).set_device(local)
    return torch.device(kind, local)


def _sglang_class(layerwise: bool, xpu: bool) -> Any:
    if layerwise:
        return SGLangLayerwiseXPUConnector if xpu else SGLangLayerwiseGPUConnector
    return SGLangXPUConnector if xpu else SGLangGPUConnector


def _vllm_class(config: Any, layerwise: bool, xpu: bool) -> Any:
    if layerwise:
        return VLLMPagedMemLayerwiseXPUConnector if xpu else VLLMPagedMemLayerwiseGPUConnector
    if bool(getattr(config, "use_gpu_connector_v3", False)):
        return VLLMPagedMemXPUConnectorV3 if xpu else VLLMPagedMemGPUConnectorV3
    return VLLMPagedMemXPUConnectorV2 if xpu else VLLMPagedMemGPUConnectorV2


def create_gpu_connector(config: Any, metadata: Any, engine: Any,
                         layout_hints: Mapping[str, Any] | None = None) -> Any:
    """The kvgen connector LMCache's CreateGPUConnector would pick for `config`, `metadata`
    and `engine` (LMCache's EngineType or its value: 'vllm', 'sglang', 'trtllm', 'mock').

    CacheBlend (`enable_blending`) needs LMCache's blender inside its buffer connector;
    that one, and the mock connector, are LMCache's own (KVLayoutError without LMCache)."""
    name = _engine(engine)
    if not hasattr(metadata, "kv_shape"):
        raise KVLayoutError(f"metadata must be LMCache's LMCacheMetadata (with kv_shape, kv_dtype, use_mla), "
                            f"got {type(metadata).__name__ if metadata is not None else None}")
    device = _device(metadata)
    use_gpu = not bool(getattr(config, "enable_pd", False))
    xpu = device.type == "xpu"
    layerwise = bool(getattr(config, "use_layerwise", False))

    if name == "sglang":
        return _sglang_class(layerwise, xpu).from_metadata(metadata, use_gpu, device, layout_hints=layout_hints)
    if name == "vllm":
        _refuse_unsupported(config, device.type)
        if layerwise and bool(getattr(config, "enable_blending", False)):
            return _lmcache_own(config, metadata, engine, layout_hints, "CacheBlend's buffer connector")
        return _vllm_class(config, layerwise, xpu).from_metadata(metadata, use_gpu, device, layout_hints=layout_hints)
    if name == "trtllm":
        return TRTLLMGPUConnector.from_metadata(metadata, device=device)
    if name == "mock":
        return _lmcache_own(config, metadata, engine, layout_hints, "the mock connector")
    raise KVLayoutError(f"no kvgen connector for engine {name!r}; engines: vllm, sglang, trtllm (and mock "
                        "through LMCache)")


def _lmcache_own(config: Any, metadata: Any, engine: Any, layout_hints: Mapping[str, Any] | None,
                 what: str) -> Any:
    found = lmcache_module("lmcache.v1.gpu_connector")
    if found is None:
        raise KVLayoutError(f"{what} is LMCache's own connector; install lmcache to use it")
    return found.CreateGPUConnector(config, metadata, engine, layout_hints=layout_hints)
