"""Connectors for whole-chunk objects (KV_2LTD, KV_MLA_FMT): every layer of a chunk in one object."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvgen.runtime import calls
from kvgen.runtime.calls import MISSING
from kvgen.runtime.connector import Call, ConnectorBase
from kvgen.runtime.errors import KVLayoutError
from kvgen.runtime.layout import Geometry, describe
from kvgen.runtime.memory import relabel
from kvgen.runtime.slots import Chunk
from kvgen.runtime.words import Words


class ChunkConnector(ConnectorBase):
    """Whole-chunk objects (KV_2LTD, KV_MLA_FMT): every layer of a chunk in one object."""

    layerwise = False

    def from_gpu(self, memory_obj: Any, start: int, end: int, *, kvcaches: Any = MISSING, slot_mapping: Any = MISSING,
                 offset: int = 0, **unknown: Any) -> None:
        """Copy tokens [start, end) from the paged cache into `memory_obj`."""
        calls.check_keywords("from_gpu", unknown, calls.WHOLE_STORE, kvcaches=kvcaches, slot_mapping=slot_mapping)
        self.batched_from_gpu([memory_obj], [start], [end], kvcaches=kvcaches, slot_mapping=slot_mapping,
                              offset=offset)

    def to_gpu(self, memory_obj: Any, start: int, end: int, *, kvcaches: Any = MISSING, slot_mapping: Any = MISSING,
               offset: int = 0, skip_prefix_n_tokens: int = 0, **unknown: Any) -> None:
        """Copy `memory_obj` into the paged cache at the slots of tokens [start, end)."""
        calls.check_keywords("to_gpu", unknown, calls.WHOLE_LOAD, kvcaches=kvcaches, slot_mapping=slot_mapping)
        self.batched_to_gpu([memory_obj], [start], [end], kvcaches=kvcaches, slot_mapping=slot_mapping,
                            offset=offset, skip_prefix_n_tokens=skip_prefix_n_tokens)

    def batched_from_gpu(self, memory_objs: Sequence[Any], starts: Sequence[int], ends: Sequence[int], *,
                         kvcaches: Any = MISSING, slot_mapping: Any = MISSING, offset: int = 0,
                         **unknown: Any) -> None:
        """Copy each chunk's tokens from the paged cache into its memory object."""
        calls.check_keywords("batched_from_gpu", unknown, calls.WHOLE_STORE, kvcaches=kvcaches,
                             slot_mapping=slot_mapping)
        call = self._begin(kvcaches, slot_mapping, starts, ends, offset, 0)
        tensors = self._check_chunk_objects(call, memory_objs, storing=True)
        for obj, tensor, ck in zip(memory_objs, tensors, call.chunks, strict=True):
            self._staged_store(tensor, call, ck, "whole")
            obj.metadata.fmt = relabel(obj.metadata.fmt, self.format)
        backend = self._backend_for(call.g.device)
        backend.synchronize(backend.current_stream())

    def batched_to_gpu(self, memory_objs: Sequence[Any], starts: Sequence[int], ends: Sequence[int], *,
                       kvcaches: Any = MISSING, slot_mapping: Any = MISSING, offset: int = 0,
                       skip_prefix_n_tokens: int = 0, **unknown: Any) -> None:
        """Copy each memory object into the paged cache at its chunk's slots."""
        calls.check_keywords("batched_to_gpu", unknown, calls.WHOLE_LOAD, kvcaches=kvcaches,
                             slot_mapping=slot_mapping)
        call = self._begin(kvcaches, slot_mapping, starts, ends, offset, skip_prefix_n_tokens)
        tensors = self._check_chunk_objects(call, memory_objs, storing=False)
        self._check_unique_slots(call)
        for tensor, ck in zip(tensors, call.chunks, strict=True):
            self._staged_load(tensor, call, ck, "whole")
        backend = self._backend_for(call.g.device)
        backend.synchronize(backend.current_stream())

    def _check_chunk_objects(self, call: Call, memory_objs: Sequence[Any], *, storing: bool) -> list[torch.Tensor]:
        """Every object of the batch, checked before the first write."""
        chunks = call.chunks
        if not isinstance(memory_objs, Sequence) or len(memory_objs) != len(chunks):
            raise KVLayoutError(f"expected a list of {len(chunks)} memory objects (one per chunk), "
                                f"got {describe(memory_objs)}")
        tensors = [self._check_object(o, call.g, ck.num_tokens, storing=storing)
                   for o, ck in zip(memory_objs, chunks, strict=True)]
        self._check_staging(tensors)
        self._check_apart(call, tensors, lambda k: f"for chunk {k}")
        return tensors

    def _store(self, tensor: torch.Tensor, kvcaches: Any, g: Geometry, ck: Chunk, w: Words) -> None:
        raise NotImplementedError

    def _load(self, tensor: torch.Tensor, kvcaches: Any, g: Geometry, ck: Chunk, w: Words) -> None:
        raise NotImplementedError
