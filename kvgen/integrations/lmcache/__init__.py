"""kvgen's connectors as drop-in replacements for LMCache's (`pip install kvgen[lmcache]`).

Every connector class of lmcache 0.5.6's `gpu_connectors.py` and `xpu_connectors.py` that
moves a layout kvgen describes, under the same name, with the same constructor,
`from_metadata`, attributes, methods, keyword arguments and generator yield counts.
The layout is detected from the live cache (`kvgen.detect`), never assumed; the copies
are the generated ones. With LMCache installed the classes subclass its
GPUConnectorInterface and count as instances of their LMCache namesakes (so LMCache's own
isinstance checks accept them). See docs/lmcache.md.

    from kvgen.integrations.lmcache import create_gpu_connector   # for CreateGPUConnector
"""

from kvgen.integrations.detect import CacheShape, Detection, detect
from kvgen.integrations.lmcache._compat import LMCACHE_AVAILABLE, LMCACHE_IMPORT_ERROR, GPUConnectorInterface
from kvgen.integrations.lmcache.base import LayerBufferAllocator
from kvgen.integrations.lmcache.factory import create_gpu_connector
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

#: LMCache's name for the factory, for a one-line import swap.
CreateGPUConnector = create_gpu_connector

__all__ = [
    "LMCACHE_AVAILABLE", "LMCACHE_IMPORT_ERROR", "CacheShape", "CreateGPUConnector", "Detection",
    "GPUConnectorInterface", "LayerBufferAllocator", "SGLangGPUConnector", "SGLangLayerwiseGPUConnector",
    "SGLangLayerwiseXPUConnector", "SGLangXPUConnector", "TRTLLMGPUConnector", "VLLMPagedMemGPUConnectorV2",
    "VLLMPagedMemGPUConnectorV3", "VLLMPagedMemLayerwiseGPUConnector", "VLLMPagedMemLayerwiseXPUConnector",
    "VLLMPagedMemXPUConnectorV2", "VLLMPagedMemXPUConnectorV3", "create_gpu_connector", "detect",
]
