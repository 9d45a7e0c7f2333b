"""What every generated connector shares: binding a cache, checking inputs, chunk and
layer loops, staging between devices, streams and format labels.

A generated module subclasses one of these and supplies only the copies themselves
(`_store`/`_load`, or `_store_layer`/`_load_layer`) and the object shape. Every check
runs before the first element is written, so a refused call leaves cache and object
exactly as they were (a layerwise load checks each layer's objects as they arrive).

A connector may be shared by threads: what a call works with (the cache's binding, its
chunks, the frozen cache tree) is computed per call and immutable; the only shared state is
a cache of bindings, backends and streams (filled under a lock) and the staging buffers,
which are per thread. See docs/connectors.md.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Generator, Sequence
from functools import partial
from typing import Any, ClassVar

import torch

from kvgen.runtime import calls
from kvgen.runtime.aliasing import check_cache_memory, check_objects_apart, check_unique_slots
from kvgen.runtime.binding import Binding, leaf_names, leaves, snapshot
from kvgen.runtime.devices import Backend, backend_for, check_device, on_stream
from kvgen.runtime.errors import KVLayoutError
from kvgen.runtime.layout import Geometry, ObjectLayout, PagedLayout, broadcast_dims, describe, read_geometry
from kvgen.runtime.memory import Format, format_name, relabel
from kvgen.runtime.slots import Chunk, plan_chunk
from kvgen.runtime.words import Words, widest, words

#: A generated copy: (object tensor, kvcaches, geometry, chunk, copy words).
Copy = Callable[[torch.Tensor, Any, Geometry, Chunk, Words], None]

#: Widest copy word per device type. 16-byte words are complex128, which Intel GPUs
#: without native FP64 may not index, so other devices stop at 8-byte integers.
MAX_WORD = {"cpu": 16, "cuda": 16}

#: Bindings kept per connector (a few caches in turn, e.g. one per engine or thread).
_BINDINGS_KEPT = 8

_MISSING: Any = object()


class Call:
    """What one transfer works with, fixed when it starts: the binding, the frozen cache
    tree the copies index, the slot mapping on the cache's device and the chunks."""

    __slots__ = ("binding", "kvcaches", "mapping", "chunks")

    def __init__(self, binding: Binding, kvcaches: Any, mapping: torch.Tensor, chunks: list[Chunk]):
        self.binding, self.kvcaches, self.mapping, self.chunks = binding, kvcaches, mapping, chunks

    @property
    def g(self) -> Geometry:
        return self.binding.geometry


class _Base:
    layout: ClassVar[PagedLayout]
    memory: ClassVar[ObjectLayout]
    strategy: ClassVar[str]
    layerwise: ClassVar[bool]
    #: Whether the generated copies may move C as wider integer words (both sides end in C).
    widen: ClassVar[bool] = False

    def __init__(self, device: torch.device | str | None = None, *, use_gpu: bool = False,
                 staging_bytes: int | None = None, backend: Backend | None = None):
        """`device`: where the cache lives (default: read from the first cache bound); a
        device that is not present here is refused now. `use_gpu`: gather into a reusable
        staging tensor on the cache's device (one per thread), then make one copy to the
        host; `staging_bytes` caps that tensor (default: sized on demand). `backend`: a
        device backend to use instead of the device's own (tests pass a recording fake)."""
        self.device = check_device(device) if device is not None else None
        self.use_gpu = use_gpu
        self.staging_bytes = staging_bytes
        self._backend = backend
        self._lock = threading.Lock()
        self._bindings: dict[Any, Binding] = {}
        self._last: Binding | None = None
        self._backends: dict[torch.device, Backend] = {}
        self._streams: dict[tuple[torch.device, str], Any] = {}
        self._local = threading.local()
        self.format = Format(self.memory.format, self.memory.code)

    # -- binding ---------------------------------------------------------------------

    def bind(self, kvcaches: Any) -> Geometry:
        """Check `kvcaches` against the layout; later calls with an unchanged cache reuse the
        result. Returns the cache's geometry."""
        return self._bind(kvcaches)[0].geometry

    def _bind(self, kvcaches: Any) -> tuple[Binding, Any]:
        """(binding, frozen tree) of `kvcaches`; any changed leaf, length or stride makes a
        new binding, which checks the whole cache again."""
        tree, key = snapshot(kvcaches)
        binding = self._bindings.get(key) if key is not None else None
        if binding is None:
            binding = self._new_binding(kvcaches, tree, key)
        self._last = binding
        g = binding.geometry
        if self.device is not None and not _same_device(g.device, self.device):
            raise KVLayoutError(f"{self.layout.name}: kvcaches must be {self.layout.arrow(g.extents())} on "
                                f"{self.device} (the connector's device), got {describe(kvcaches)} on {g.device}")
        return binding, tree

    def _new_binding(self, kvcaches: Any, tree: Any, key: Any) -> Binding:
        geometry = read_geometry(self.layout, kvcaches)  # the one place a cache's geometry is read
        if key is None:  # the geometry check accepted what is no tree of tensors
            raise KVLayoutError(f"{self.layout.name}: kvcaches must be lists or tuples of tensors, got "
                                f"{describe(kvcaches)}")
        tensors, names = leaves(tree), tuple(leaf_names(tree))
        try:
            memory = check_cache_memory(tensors, names)
        except KVLayoutError as error:
            raise KVLayoutError(f"{self.layout.name}: {error}") from None
        width = widest(tensors, geometry.C, MAX_WORD.get(geometry.device.type, 8)) if self.widen \
            else tensors[0].element_size()
        if snapshot(kvcaches)[1] != key:
            raise KVLayoutError(f"{self.layout.name}: kvcaches changed while it was being checked (another thread "
                                "is changing it); nothing was moved")
        binding = Binding(key, geometry, width, memory, names)
        with self._lock:
            if len(self._bindings) >= _BINDINGS_KEPT:
                self._bindings.pop(next(iter(self._bindings)))
            self._bindings[key] = binding
        return binding

    @property
    def geometry(self) -> Geometry:
        """The geometry of the cache bound last (with several caches, use bind(cache))."""
        last = self._last
        if last is None:
            raise RuntimeError(f"{type(self).__module__}: no cache bound yet; pass kvcaches to a "
                               "transfer or call bind(kvcaches) first")
        return last.geometry

    def get_shape(self, num_tokens: int, kvcaches: Any = None) -> torch.Size:
        """Shape of the memory object (of one layer's object, when layerwise) for a chunk of
        `kvcaches` (default: the cache bound last)."""
        g = self.geometry if kvcaches is None else self.bind(kvcaches)
        return torch.Size(self._shape(g, num_tokens))

    @property
    def backend(self) -> Backend:
        """The backend of the cache bound last."""
        return self._backend_for(self.geometry.device)

    def _backend_for(self, device: torch.device) -> Backend:
        if self._backend is not None:
            return self._backend
        backend = self._backends.get(device)
        if backend is None:
            with self._lock:
                backend = self._backends.setdefault(device, backend_for(device))
        return backend

    def _stream(self, device: torch.device, role: str) -> Any:
        stream = self._streams.get((device, role))
        if stream is None:
            backend = self._backend_for(device)
            with self._lock:
                if (device, role) not in self._streams:
                    self._streams[(device, role)] = backend.new_stream()
                stream = self._streams[(device, role)]
        return stream

    # -- checks (all before any write) ------------------------------------------------

    def _begin(self, kvcaches: Any, slot_mapping: Any, starts: Sequence[int], ends: Sequence[int],
               offset: int, skip: int) -> Call:
        binding, tree = self._bind(kvcaches)
        mapping, chunks = self._chunks(binding.geometry, slot_mapping, starts, ends, offset, skip)
        return Call(binding, tree, mapping, chunks)

    def _expected(self, g: Geometry, num_tokens: int | None) -> str:
        """`kv_2ltd [KV=2 L=32 T=256 (H=8 C=128)] bfloat16`; T left open when None."""
        ext = g.extents() if num_tokens is None else {**g.extents(), "T": num_tokens}
        return f"{self.memory.name} {self.memory.arrow(ext)} {str(g.dtype).removeprefix('torch.')}"

    def _check_object(self, obj: Any, g: Geometry, num_tokens: int, *, storing: bool) -> torch.Tensor:
        expected = self._expected(g, num_tokens)
        tensor = getattr(obj, "tensor", None)
        metadata = getattr(obj, "metadata", None)
        if not isinstance(tensor, torch.Tensor) or not hasattr(metadata, "fmt"):
            raise KVLayoutError(f"expected a memory object with .tensor ({expected}) and .metadata.fmt, "
                                f"got {describe(obj)}"
                                + (f" with .tensor {describe(tensor)}" if hasattr(obj, "tensor") else ""))
        shape = self._shape(g, num_tokens)
        if tuple(tensor.shape) != shape or tensor.dtype != g.dtype:
            raise KVLayoutError(f"memory object must be {expected} "
                                f"(shape {list(shape)}), got {describe(tensor)}")
        if tensor.device.type == "meta":
            raise KVLayoutError(f"memory object {expected} must have storage, got a tensor on {tensor.device}")
        if broadcast_dims(tensor):
            raise KVLayoutError(f"memory object {expected} has dims {broadcast_dims(tensor)} with stride 0 "
                                "(an expanded view): distinct tokens would share memory; pass a tensor with "
                                "its own storage")
        try:
            current = format_name(metadata.fmt)
        except TypeError:
            raise KVLayoutError(f"memory object format label must be None or have a .name "
                                f"(expected {self.memory.format}), got {metadata.fmt!r}") from None
        if storing:
            if current != self.memory.format and current not in self.memory.accepts:
                allowed = ", ".join([self.memory.format, *self.memory.accepts])
                raise KVLayoutError(f"cannot store {self.memory.format} into an object labelled "
                                    f"{current}; allowed labels before a store: {allowed}")
        elif current != self.memory.format:
            raise KVLayoutError(f"cannot load an object labelled {current}: this connector reads "
                                f"{self.memory.format} ({expected})")
        return tensor

    @staticmethod
    def _check_apart(call: Call, tensors: Sequence[torch.Tensor], name: Callable[[int], str]) -> None:
        """Objects may share memory neither with themselves, each other nor the cache."""
        check_objects_apart(tensors, name, call.binding.memory, call.binding.names)

    @staticmethod
    def _check_unique_slots(call: Call, starts: Sequence[int], skip: int, offset: int) -> None:
        """A load writes each slot from one token at most."""
        windows = [(s + skip, s + ck.num_tokens) for s, ck in zip(starts, call.chunks, strict=True)]
        check_unique_slots(call.mapping, windows, offset)

    def _slot_mapping(self, slot_mapping: Any, g: Geometry) -> torch.Tensor:
        """The slot mapping as a 1-D signed integer tensor on the cache's device."""
        if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1:
            raise KVLayoutError(f"slot_mapping must be a 1-D integer tensor (one slot per token, < 0 to "
                                f"skip), got {describe(slot_mapping)}")
        dtype = slot_mapping.dtype
        if dtype.is_floating_point or dtype.is_complex or dtype in (torch.bool, torch.uint8):
            raise KVLayoutError(f"slot_mapping must hold signed integers (int64, int32, ...), got "
                                f"{describe(slot_mapping)}")
        if slot_mapping.device.type == "meta":
            raise KVLayoutError(f"slot_mapping must be on the cpu or on {g.device}, got {describe(slot_mapping)}")
        if slot_mapping.device != g.device:
            slot_mapping = slot_mapping.to(g.device)
        return slot_mapping

    def _chunks(self, g: Geometry, slot_mapping: Any, starts: Sequence[int], ends: Sequence[int],
                offset: int, skip: int) -> tuple[torch.Tensor, list[Chunk]]:
        starts, ends = _positions("starts", starts), _positions("ends", ends)
        if len(starts) != len(ends):
            raise KVLayoutError(f"expected one end per start, got {len(starts)} starts {list(starts)} but "
                                f"{len(ends)} ends {list(ends)}")
        offset, skip = _integer("offset", offset), _integer("skip_prefix_n_tokens", skip)
        mapping = self._slot_mapping(slot_mapping, g)
        return mapping, [plan_chunk(mapping, s, e, num_slots=g.S, block_size=g.N, offset=offset, skip=skip)
                         for s, e in zip(starts, ends, strict=True)]

    # -- moving one object's tensor ---------------------------------------------------

    def _staging_for(self, tensor: torch.Tensor, g: Geometry, role: str) -> torch.Tensor:
        """Where a copy works: the object itself when it lives with the cache; else (and
        always with use_gpu) a tensor on the cache's device, copied to or from the object
        in one step. With use_gpu that tensor is a reusable staging buffer of this thread,
        one per role (whole, store or load stream), so no two threads or streams share one."""
        if not self.use_gpu:
            if tensor.device == g.device:
                return tensor
            return torch.empty(tensor.shape, dtype=tensor.dtype, device=g.device)
        need = tensor.numel() * tensor.element_size()
        buffers: dict[tuple[torch.device, str], torch.Tensor] = self._local.__dict__.setdefault("staging", {})
        buffer = buffers.get((g.device, role))
        if buffer is None or buffer.numel() < need:
            buffer = buffers[(g.device, role)] = torch.empty(need, dtype=torch.uint8, device=g.device)
        return buffer[:need].view(tensor.dtype).view(tensor.shape)

    def _staged_store(self, copy: Copy, tensor: torch.Tensor, call: Call, ck: Chunk, role: str) -> None:
        """Run a generated store into `tensor`, through the staging tensor where one is used."""
        g = call.g
        backend = self._backend_for(g.device)
        work = self._staging_for(tensor, g, role)
        if work is not tensor and not ck.covers_all:
            backend.copy(work, tensor)  # so skipped tokens come back unchanged
        copy(work, call.kvcaches, g, ck, self._words(work, call.binding))
        if work is not tensor:
            backend.copy(tensor, work)

    def _staged_load(self, copy: Copy, tensor: torch.Tensor, call: Call, ck: Chunk, role: str) -> None:
        """Run a generated load from `tensor`, through the staging tensor where one is used."""
        g = call.g
        work = self._staging_for(tensor, g, role)
        if work is not tensor:
            self._backend_for(g.device).copy(work, tensor)
        copy(work, call.kvcaches, g, ck, self._words(work, call.binding))

    def _check_staging(self, tensors: Sequence[torch.Tensor]) -> None:
        """Refuse, before anything moves, a transfer the capped staging buffer cannot hold."""
        if self.use_gpu and self.staging_bytes is not None:
            need = max((t.numel() * t.element_size() for t in tensors), default=0)
            if need > self.staging_bytes:
                raise KVLayoutError(f"staging buffer too small: a chunk needs {need} bytes, "
                                    f"{self.staging_bytes} bytes are available (staging_bytes)")

    def _words(self, tensor: torch.Tensor, binding: Binding) -> Words:
        """The widest copy unit both the call's cache and this object tensor allow."""
        g = binding.geometry
        width = widest([tensor], g.C, binding.width) if self.widen else tensor.element_size()
        return words(width, tensor.element_size(), g.C)

    def _shape(self, g: Geometry, num_tokens: int) -> tuple[int, ...]:
        raise NotImplementedError


class ChunkConnector(_Base):
    """Whole-chunk objects (KV_2LTD, KV_MLA_FMT): every layer of a chunk in one object."""

    layerwise = False

    def from_gpu(self, memory_obj: Any, start: int, end: int, *, kvcaches: Any, slot_mapping: Any,
                 offset: int = 0, **unknown: Any) -> None:
        """Copy tokens [start, end) from the paged cache into `memory_obj`."""
        calls.refuse_unknown("from_gpu", unknown, calls.WHOLE_STORE)
        self.batched_from_gpu([memory_obj], [start], [end], kvcaches=kvcaches, slot_mapping=slot_mapping,
                              offset=offset)

    def to_gpu(self, memory_obj: Any, start: int, end: int, *, kvcaches: Any, slot_mapping: Any,
               offset: int = 0, skip_prefix_n_tokens: int = 0, **unknown: Any) -> None:
        """Copy `memory_obj` into the paged cache at the slots of tokens [start, end)."""
        calls.refuse_unknown("to_gpu", unknown, calls.WHOLE_LOAD)
        self.batched_to_gpu([memory_obj], [start], [end], kvcaches=kvcaches, slot_mapping=slot_mapping,
                            offset=offset, skip_prefix_n_tokens=skip_prefix_n_tokens)

    def batched_from_gpu(self, memory_objs: Sequence[Any], starts: Sequence[int], ends: Sequence[int], *,
                         kvcaches: Any, slot_mapping: Any, offset: int = 0, **unknown: Any) -> None:
        """Copy each chunk's tokens from the paged cache into its memory object."""
        calls.refuse_unknown("batched_from_gpu", unknown, calls.WHOLE_STORE)
        call = self._begin(kvcaches, slot_mapping, starts, ends, offset, 0)
        tensors = self._check_chunk_objects(call, memory_objs, storing=True)
        for obj, tensor, ck in zip(memory_objs, tensors, call.chunks, strict=True):
            self._staged_store(self._store, tensor, call, ck, "whole")
            obj.metadata.fmt = relabel(obj.metadata.fmt, self.format)
        backend = self._backend_for(call.g.device)
        backend.synchronize(backend.current_stream())

    def batched_to_gpu(self, memory_objs: Sequence[Any], starts: Sequence[int], ends: Sequence[int], *,
                       kvcaches: Any, slot_mapping: Any, offset: int = 0, skip_prefix_n_tokens: int = 0,
                       **unknown: Any) -> None:
        """Copy each memory object into the paged cache at its chunk's slots."""
        calls.refuse_unknown("batched_to_gpu", unknown, calls.WHOLE_LOAD)
        call = self._begin(kvcaches, slot_mapping, starts, ends, offset, skip_prefix_n_tokens)
        tensors = self._check_chunk_objects(call, memory_objs, storing=False)
        self._check_unique_slots(call, _positions("starts", starts), skip_prefix_n_tokens, offset)
        for tensor, ck in zip(tensors, call.chunks, strict=True):
            self._staged_load(self._load, tensor, call, ck, "whole")
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


class LayerwiseConnector(_Base):
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
        return self._store_layers(memory_objs, starts, ends, kvcaches, slot_mapping, sync, offset)

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
        return self._load_layers(starts, ends, kvcaches, slot_mapping, sync, offset, skip_prefix_n_tokens)

    def _store_layers(self, memory_objs: Sequence[Sequence[Any]], starts: Sequence[int], ends: Sequence[int],
                      kvcaches: Any, slot_mapping: Any, sync: bool, offset: int) -> Generator[None, None, None]:
        call = self._begin(kvcaches, slot_mapping, starts, ends, offset, 0)
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
        backend = self._backend_for(g.device)
        stream = self._stream(g.device, "store")
        for layer in range(g.L):
            with on_stream(backend, stream):
                for tensor, ck in zip(tensors[layer], chunks, strict=True):
                    self._staged_store(partial(self._store_layer, layer), tensor, call, ck, "store")
            yield
        self._finish(backend, stream, sync)
        for objs in memory_objs:
            for obj in objs:
                obj.metadata.fmt = relabel(obj.metadata.fmt, self.format)
        yield

    def _load_layers(self, starts: Sequence[int], ends: Sequence[int], kvcaches: Any, slot_mapping: Any,
                     sync: bool, offset: int, skip: int) -> Generator[None, Sequence[Any], None]:
        call = self._begin(kvcaches, slot_mapping, starts, ends, offset, skip)
        g, chunks = call.g, call.chunks
        self._check_unique_slots(call, _positions("starts", starts), skip, offset)
        backend = self._backend_for(g.device)
        stream = self._stream(g.device, "load")
        objs = yield
        for layer in range(g.L):
            if not isinstance(objs, Sequence) or len(objs) != len(chunks):
                raise KVLayoutError(f"layer {layer}: send() a list of one memory object per chunk "
                                    f"({len(chunks)}), got {describe(objs)}")
            tensors = [self._check_object(o, g, ck.num_tokens, storing=False)
                       for o, ck in zip(objs, chunks, strict=True)]
            self._check_staging(tensors)
            self._check_apart(call, tensors, partial("for layer {}, chunk {}".format, layer))
            with on_stream(backend, stream):
                for tensor, ck in zip(tensors, chunks, strict=True):
                    self._staged_load(partial(self._load_layer, layer), tensor, call, ck, "load")
            if sync:
                backend.wait_stream(backend.current_stream(), stream)
            objs = yield
        self._finish(backend, stream, sync)
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


def _same_device(actual: torch.device, wanted: torch.device) -> bool:
    """Whether a cache on `actual` suits a connector made for `wanted`: `cuda` (no index)
    takes any CUDA device, `cuda:1` only that one."""
    return actual.type == wanted.type and (wanted.index is None or actual.index == wanted.index)


def _integer(what: str, value: Any) -> int:
    """`value` as an int (ints, integer numpy/torch scalars), else KVLayoutError."""
    if isinstance(value, bool):
        raise KVLayoutError(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise KVLayoutError(f"{what} must be an integer, got {type(value).__name__} {value!r}") from None


def _positions(what: str, values: Any) -> list[int]:
    """Chunk starts or ends: a sequence (or 1-D tensor) of integers."""
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.dtype.is_floating_point or values.dtype.is_complex:
            raise KVLayoutError(f"{what} must be a list of integers, got {describe(values)}")
        values = values.tolist()
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise KVLayoutError(f"{what} must be a list of integers (one per chunk), got {type(values).__name__}")
    return [_integer(f"{what}[{i}]", v) for i, v in enumerate(values)]
