"""Connectors for per-layer objects (KV_T2D, KV_2TD, per-layer MLA), moved by generators
that let the caller overlap each layer's transfer with the forward pass (LMCache's contract)."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from functools import partial
from typing import Any

import torch

from kvgen.runtime import calls
from kvgen.runtime.aliasing import check_storage, within_storage
from kvgen.runtime.binding import LAYERS_MOVED, check_layer_leaves, layer_leaves, leaves
from kvgen.runtime.connector import _MISSING, Call, ConnectorBase
from kvgen.runtime.devices import Backend, on_stream
from kvgen.runtime.errors import KVLayoutError
from kvgen.runtime.layout import Geometry, describe
from kvgen.runtime.memory import relabel
from kvgen.runtime.slots import Chunk
from kvgen.runtime.words import Words


class LayerwiseConnector(ConnectorBase):
    """Per-layer objects (KV_T2D, KV_2TD, per-layer MLA), moved by generators that let the
    caller overlap each layer's transfer with the forward pass (LMCache's contract)."""

    layerwise = True

    def from_gpu(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(f"{type(self).__module__} moves per-layer objects: use the generator "
                        "batched_from_gpu(memory_objs[layer][chunk], starts, ends, ...) instead of from_gpu. "
                        + calls.STORE_PROTOCOL)

    def to_gpu(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(f"{type(self).__module__} moves per-layer objects: use the generator "
                        "batched_to_gpu(starts, ends, ...) and send() each layer's objects instead of to_gpu. "
                        + calls.LOAD_PROTOCOL)

    def batched_from_gpu(self, memory_objs: Sequence[Sequence[Any]], starts: Sequence[int], ends: Sequence[int],
                         *extra: Any, kvcaches: Any = _MISSING, slot_mapping: Any = _MISSING, sync: bool = True,
                         offset: int = 0, **unknown: Any) -> Generator[None, None, None]:
        """Store layer by layer: a generator that yields once per layer after its copy is
        queued, then once after the final synchronization (L + 1 yields). Every object is
        checked before the first layer moves. Call signature errors raise here, input
        errors at the first next()."""
        if extra:
            calls.refuse_whole_call("batched_from_gpu", 3, calls.STORE_PROTOCOL)
        calls.refuse_unknown("batched_from_gpu", unknown, calls.LAYERWISE_STORE, calls.STORE_PROTOCOL)
        calls.refuse_missing("batched_from_gpu", [n for n, v in (("kvcaches", kvcaches), ("slot_mapping", slot_mapping))
                                                  if v is _MISSING], calls.STORE_PROTOCOL)
        return self._store_layers(memory_objs, partial(self._begin, kvcaches, slot_mapping, starts, ends, offset, 0),
                                  sync)

    def batched_to_gpu(self, starts: Sequence[int], ends: Sequence[int], *extra: Any, kvcaches: Any = _MISSING,
                       slot_mapping: Any = _MISSING, sync: bool = True, offset: int = 0,
                       skip_prefix_n_tokens: int = 0, **unknown: Any) -> Generator[None, Sequence[Any], None]:
        """Load layer by layer: a generator; prime it with next(), send() each layer's objects
        (one per chunk), then next() once more (L + 2 yields). Each layer's objects are
        checked when they arrive, before any of that layer is written."""
        if extra:
            calls.refuse_whole_call("batched_to_gpu", 2, calls.LOAD_PROTOCOL)
        calls.refuse_unknown("batched_to_gpu", unknown, calls.LAYERWISE_LOAD, calls.LOAD_PROTOCOL)
        calls.refuse_missing("batched_to_gpu", [n for n, v in (("kvcaches", kvcaches), ("slot_mapping", slot_mapping))
                                                if v is _MISSING], calls.LOAD_PROTOCOL)
        begin = partial(self._begin, kvcaches, slot_mapping, starts, ends, offset, skip_prefix_n_tokens)
        return self._load_layers(begin, starts, sync, offset, skip_prefix_n_tokens)

    def _layer_tensors(self, memory_objs: Any, call: Call) -> list[list[torch.Tensor]]:
        """A store's objects as tensors, [layer][chunk], each checked (shape, dtype, device, memory)."""
        g, chunks = call.g, call.chunks
        if (not isinstance(memory_objs, Sequence) or len(memory_objs) != g.L
                or any(not isinstance(objs, Sequence) or len(objs) != len(chunks) for objs in memory_objs)):
            shape = [len(o) if isinstance(o, Sequence) else type(o).__name__ for o in memory_objs] \
                if isinstance(memory_objs, Sequence) else type(memory_objs).__name__
            raise KVLayoutError(f"expected memory_objs[{g.L} layers][{len(chunks)} chunks] of "
                                f"{self._expected(g, None)} objects, got {describe(memory_objs)} "
                                f"(objects per layer: {shape})")
        tensors = [[self._check_object(o, g, ck.num_tokens, storing=True) for o, ck in zip(objs, chunks, strict=True)]
                   for objs in memory_objs]
        flat = [t for row in tensors for t in row]
        self._check_staging(flat)
        per = len(chunks)
        self._check_apart(call, flat, lambda k: f"for layer {k // per}, chunk {k % per}")
        return tensors

    def _move_layer(self, layer: int, tensors: Sequence[torch.Tensor], call: Call, store: bool) -> None:
        """One layer of every chunk: the connector's mover where the objects are on the cache's
        device (in place, no wrapper per layer), else through the staging copy."""
        direct = not self.use_gpu
        staged = self._staged_store if store else self._staged_load
        for tensor, ck in zip(tensors, call.chunks, strict=True):
            if direct and tensor.device == call.g.device:
                self._move(store, tensor, call, ck, layer)
            else:
                staged(tensor, call, ck, "store" if store else "load", layer)

    def _store_layers(self, memory_objs: Sequence[Sequence[Any]], begin: Callable[[], Call],
                      sync: bool) -> Generator[None, None, None]:
        call = begin()
        g = call.g
        tensors = self._layer_tensors(memory_objs, call)
        backend = self._backend_for(g.device)
        stream = self._stream(g.device, "store")
        cache, per_layer = leaves(call.kvcaches), layer_leaves(call.kvcaches, self.layout.lists, g.L)
        for layer in range(g.L):
            if layer:  # what may have changed while the caller ran between two steps
                check_layer_leaves(cache, per_layer[layer], call.binding, partial("layer {}".format, layer))
                _check_layer_objects(tensors[layer], layer)
            if stream is None:  # a device without streams (the CPU): nothing to order
                self._move_layer(layer, tensors[layer], call, True)
            else:
                with on_stream(backend, stream):
                    self._move_layer(layer, tensors[layer], call, True)
            yield
        self._finish(backend, stream, sync)
        for objs in memory_objs:
            for obj in objs:
                obj.metadata.fmt = relabel(obj.metadata.fmt, self.format)
        yield

    def _load_layers(self, begin: Callable[[], Call], starts: Sequence[int], sync: bool, offset: int,
                     skip: int) -> Generator[None, Sequence[Any], None]:
        call = begin()
        g, chunks = call.g, call.chunks
        self._check_unique_slots(call)
        backend = self._backend_for(g.device)
        stream = self._stream(g.device, "load")
        cache, per_layer = leaves(call.kvcaches), layer_leaves(call.kvcaches, self.layout.lists, g.L)
        objs = yield
        for layer in range(g.L):
            check_layer_leaves(cache, per_layer[layer], call.binding, partial("layer {}".format, layer))
            if not isinstance(objs, Sequence) or len(objs) != len(chunks):
                raise KVLayoutError(f"layer {layer}: send() a list of one memory object per chunk "
                                    f"({len(chunks)}), got {describe(objs)}")
            tensors = [self._check_object(o, g, ck.num_tokens, storing=False)
                       for o, ck in zip(objs, chunks, strict=True)]
            self._check_staging(tensors)
            self._check_apart(call, tensors, partial("for layer {}, chunk {}".format, layer))
            if stream is None:
                self._move_layer(layer, tensors, call, False)
            else:
                with on_stream(backend, stream):
                    self._move_layer(layer, tensors, call, False)
                if sync:
                    backend.wait_stream(backend.current_stream(), stream)
            objs = yield
        self._finish(backend, stream, sync)
        if objs is not None:  # every layer is loaded; objects sent now would be dropped unseen
            raise KVLayoutError(f"send() after the last layer: all {g.L} layers are loaded; finish the load with "
                                "next(), not send()")
        yield

    @staticmethod
    def _finish(backend: Backend, stream: Any, sync: bool) -> None:
        if sync:
            backend.synchronize(stream)
        else:
            backend.wait_stream(backend.current_stream(), stream)

    def _store_layer(self, layer: int, tensor: torch.Tensor, kvcaches: Any, g: Geometry, ck: Chunk,
                     w: Words) -> None:
        raise NotImplementedError

    def _load_layer(self, layer: int, tensor: torch.Tensor, kvcaches: Any, g: Geometry, ck: Chunk,
                    w: Words) -> None:
        raise NotImplementedError


def _check_layer_objects(tensors: Sequence[torch.Tensor], layer: int) -> None:
    """A store's objects of `layer`, checked again when it comes: the caller ran since the first
    layer moved and may have freed or resized one."""
    for chunk, tensor in enumerate(tensors):
        if not within_storage(tensor):
            check_storage(tensor, f"layer {layer}: memory object for chunk {chunk}", LAYERS_MOVED)
