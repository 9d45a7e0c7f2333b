"""LMCache's TensorRT-LLM connector, moved by kvgen's trtllm_pool connector.

TensorRT-LLM registers one pool for all layers, [B, L, 2, H*N*C] (HND inside a block);
`register_kv_caches` views it as the [B, L, KV, H, N, C] the spec describes and checks it
by detection. Transfers name whole blocks (`block_ids`, the request's block list):
chunk i of a request uses blocks [i * blocks_per_chunk, (i + 1) * blocks_per_chunk), and
a chunk whose blocks are not all listed is skipped, as in LMCache.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

import kvgen.generated
from kvgen.errors import KVLayoutError
from kvgen.integrations.detect import Detection, detect
from kvgen.integrations.lmcache._compat import register_virtual_subclass
from kvgen.integrations.lmcache.base import Adapter, call_with, check_objects
from kvgen.runtime.connector import _positions, token_count  # the runtime's readings of integers


class TRTLLMGPUConnector(Adapter):
    """TensorRT-LLM's cross-layer pool <-> whole-chunk KV_2LTD objects, by block ids."""

    ENGINE = "trtllm"

    def __init__(self, num_kv_heads: int, head_dim: int, hidden_dim_size: int, num_layers: int, chunk_size: int,
                 dtype: torch.dtype, device: Any):
        self._setup(hidden_dim_size, num_layers, False,
                    {"chunk_size": chunk_size, "dtype": dtype, "device": device,
                     "kvgen_hints": {"num_kv_heads": num_kv_heads, "head_size": head_dim}})
        self.num_kv_heads = int(num_kv_heads)
        self.head_dim = int(head_dim)
        self.kv_cache_tensor: torch.Tensor | None = None
        self.tokens_per_block: int | None = None
        self.blocks_per_chunk: int | None = None
        self._connector: Any = None

    @classmethod
    def from_metadata(cls, metadata: Any, device: Any = None, use_gpu: bool = False,
                      layout_hints: Mapping[str, Any] | None = None) -> TRTLLMGPUConnector:
        """LMCache's order (metadata, device); use_gpu and layout_hints are accepted for
        symmetry with the other connectors (the pool needs no staging hints)."""
        num_layers, _, chunk_size, num_kv_heads, head_dim = (int(x) for x in metadata.kv_shape)
        return cls(num_kv_heads=num_kv_heads, head_dim=head_dim, hidden_dim_size=num_kv_heads * head_dim,
                   num_layers=num_layers, chunk_size=chunk_size, dtype=metadata.kv_dtype, device=device)

    def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None:
        """Register the [B, L, 2, H*N*C] pool (once per worker; a new tensor replaces it)."""
        if not isinstance(kv_cache_tensor, torch.Tensor) or kv_cache_tensor.dim() != 4:
            got = list(kv_cache_tensor.shape) if isinstance(kv_cache_tensor, torch.Tensor) else kv_cache_tensor
            raise ValueError(f"TRT-LLM kv_cache_tensor must be 4-D [NB, NL, 2, flat], got {got}")
        flat = kv_cache_tensor.shape[3]
        per_token = self.num_kv_heads * self.head_dim
        if flat % per_token:
            raise ValueError(f"flat dim {flat} not divisible by num_kv_heads * head_dim ({per_token})")
        tokens_per_block = flat // per_token
        if self.chunk_size is None or self.chunk_size % tokens_per_block:
            raise KVLayoutError(f"chunk_size {self.chunk_size} must be a multiple of the pool's block size "
                                f"{tokens_per_block}")
        view = kv_cache_tensor.unflatten(3, (self.num_kv_heads, tokens_per_block, self.head_dim))
        found: Detection = detect(view, engine="trtllm", kv_layout="HND", num_layers=self.num_layers,
                                  num_kv_heads=self.num_kv_heads, head_size=self.head_dim,
                                  block_size=tokens_per_block)
        self._connector = kvgen.generated.get(found.layout, "kv_2ltd")(self.device)
        self.detection = found
        self.tokens_per_block = tokens_per_block
        self.blocks_per_chunk = self.chunk_size // tokens_per_block
        self.kv_cache_tensor = self.kvcaches = found.view(view)

    def _chunk_slots(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor | None:
        """Token slots of the chunk at `start`, or None when its blocks are not all listed."""
        assert self.blocks_per_chunk is not None and self.tokens_per_block is not None
        first = (start // self.chunk_size) * self.blocks_per_chunk  # type: ignore[operator]
        blocks = list(block_ids[first:first + self.blocks_per_chunk])
        if len(blocks) < self.blocks_per_chunk:
            return None
        n = self.tokens_per_block
        if end - start > len(blocks) * n:
            raise KVLayoutError(f"a chunk of {end - start} tokens needs more than its {len(blocks)} blocks of {n}")
        ids = torch.tensor(blocks, dtype=torch.long)
        return (ids[:, None] * n + torch.arange(n)).flatten()[:end - start]

    def _block_ids(self, given: Any) -> list[int]:
        """The request's block list, every entry an integer block of the pool: a float is not
        truncated, a negative id skips nothing, an id past the pool (or one that would wrap
        when multiplied into a slot) never reaches the copy."""
        ids = _positions("block_ids", given)
        pool = int(self.kv_cache_tensor.shape[0])  # type: ignore[union-attr]
        for i, b in enumerate(ids):
            if not 0 <= b < pool:
                raise KVLayoutError(f"block_ids[{i}] = {b} is not a block of the pool (0 to {pool - 1})")
        return ids

    def _transfer(self, memory_objs: Sequence[Any], starts: Sequence[int], ends: Sequence[int],
                  kwargs: Mapping[str, Any], storing: bool) -> None:
        if self.kv_cache_tensor is None:
            raise RuntimeError("register_kv_caches must be called before a transfer")
        block_ids = self._block_ids(kwargs.get("block_ids", []))
        objs, slots, lo, hi, at = [], [], [], [], 0
        for obj, start, end in zip(memory_objs, starts, ends, strict=False):
            if isinstance(obj, list) or getattr(obj, "tensor", None) is None:
                continue
            chunk = self._chunk_slots(block_ids, start, end)
            if chunk is None:
                continue
            objs.append(obj)
            slots.append(chunk)
            lo.append(at)
            hi.append(at + chunk.numel())
            at += chunk.numel()
        if not objs:
            return
        mapping = torch.cat(slots)
        if storing:
            with self._stream(self.store_stream):
                call_with(self._connector.batched_from_gpu, check_objects(objs), lo, hi,
                          kvcaches=self.kv_cache_tensor, slot_mapping=mapping)
        else:
            with self._stream(self.load_stream):
                call_with(self._connector.batched_to_gpu, check_objects(objs), lo, hi,
                          kvcaches=self.kv_cache_tensor, slot_mapping=mapping)

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        self._transfer([memory_obj], [start], [end], kwargs, storing=False)

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        self._transfer([memory_obj], [start], [end], kwargs, storing=True)

    def batched_from_gpu(self, memory_objs: Any, starts: Sequence[int], ends: Sequence[int], **kwargs: Any) -> None:
        self._transfer(memory_objs, starts, ends, kwargs, storing=True)

    def batched_to_gpu(self, memory_objs: Any = None, starts: Sequence[int] | None = None,
                       ends: Sequence[int] | None = None, **kwargs: Any) -> None:
        if memory_objs is None or starts is None or ends is None:
            return
        self._transfer(memory_objs, starts, ends, kwargs, storing=False)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, token_count(num_tokens), self.hidden_dim_size])


register_virtual_subclass(TRTLLMGPUConnector, "lmcache.v1.gpu_connector.gpu_connectors", "TRTLLMGPUConnector")
