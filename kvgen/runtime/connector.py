"""What every generated connector shares: binding a cache, checking inputs, chunk and
layer loops, staging between devices, streams and format labels.

A generated module subclasses one of these and supplies only the copies themselves
(`_store`/`_load`, or `_store_layer`/`_load_layer`) and the object shape. Every check
runs before the first element is written, so a refused call leaves cache and object
exactly as they were.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Generator, Sequence
from functools import partial
from typing import Any, ClassVar

import torch

from kvgen.runtime.devices import Backend, backend_for, on_stream
from kvgen.runtime.errors import KVLayoutError
from kvgen.runtime.layout import Geometry, ObjectLayout, PagedLayout, broadcast_dims, describe
from kvgen.runtime.memory import Format, format_name, relabel
from kvgen.runtime.slots import Chunk, plan_chunk
from kvgen.runtime.words import Words, widest, words

#: A generated copy: (object tensor, kvcaches, geometry, chunk, copy words).
Copy = Callable[[torch.Tensor, Any, Geometry, Chunk, Words], None]

#: Widest copy word per device type. 16-byte words are complex128, which Intel GPUs
#: without native FP64 may not index, so other devices stop at 8-byte integers.
MAX_WORD = {"cpu": 16, "cuda": 16}


class _Base:
    layout: ClassVar[PagedLayout]
    memory: ClassVar[ObjectLayout]
    strategy: ClassVar[str]
    layerwise: ClassVar[bool]
    #: Whether the generated copies may move C as wider integer words (both sides end in C).
    widen: ClassVar[bool] = False
    #: The generated module's geometry reading: checks a cache, returns its extents.
    read_geometry: ClassVar[Callable[[Any], Geometry]]

    def __init__(self, device: torch.device | str | None = None, *, use_gpu: bool = False,
                 staging_bytes: int | None = None, backend: Backend | None = None):
        """`device`: where the cache lives (default: read from the first cache bound).
        `use_gpu`: gather into one reusable staging tensor on the cache's device, then make
        one copy to the host; `staging_bytes` caps that tensor (default: sized on demand)."""
        self.device = torch.device(device) if device is not None else None
        self.use_gpu = use_gpu
        self.staging_bytes = staging_bytes
        self._backend = backend
        self._key: tuple[Any, ...] | None = None
        self._geometry: Geometry | None = None
        self._staging: torch.Tensor | None = None
        self._streams: dict[str, Any] = {}
        self._words_key: tuple[Any, ...] | None = None
        self._cache_width = 0
        self.format = Format(self.memory.format, self.memory.code)

    # -- geometry ---------------------------------------------------------------------

    def bind(self, kvcaches: Any) -> Geometry:
        """Check `kvcaches` against the layout once; later calls with the same cache reuse it."""
        key = _cache_key(kvcaches)
        if key != self._key:
            geometry = self.read_geometry(kvcaches)
            if self.device is not None and not _same_device(geometry.device, self.device):
                raise KVLayoutError(f"{self.layout.name}: kvcaches must be "
                                    f"{self.layout.arrow(geometry.extents())} on {self.device} (the "
                                    f"connector's device), got {describe(kvcaches)} on {geometry.device}")
            self._geometry, self._key = geometry, key
        assert self._geometry is not None
        return self._geometry

    @property
    def geometry(self) -> Geometry:
        if self._geometry is None:
            raise RuntimeError(f"{type(self).__module__}: no cache bound yet; pass kvcaches to a "
                               "transfer or call bind(kvcaches) first")
        return self._geometry

    def get_shape(self, num_tokens: int) -> torch.Size:
        """Shape of the memory object (of one layer's object, when layerwise) for a chunk."""
        return torch.Size(self._shape(self.geometry, num_tokens))

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            self._backend = backend_for(self.geometry.device)
        return self._backend

    def _stream(self, role: str) -> Any:
        if role not in self._streams:
            self._streams[role] = self.backend.new_stream()
        return self._streams[role]

    # -- checks (all before any write) ------------------------------------------------

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
        if storing and broadcast_dims(tensor):
            raise KVLayoutError(f"memory object {expected} has dims {broadcast_dims(tensor)} with stride 0 "
                                "(an expanded view): distinct tokens would share memory; store into a "
                                "tensor with its own storage")
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
                offset: int, skip: int) -> list[Chunk]:
        starts, ends = _positions("starts", starts), _positions("ends", ends)
        if len(starts) != len(ends):
            raise KVLayoutError(f"expected one end per start, got {len(starts)} starts {list(starts)} but "
                                f"{len(ends)} ends {list(ends)}")
        offset, skip = _integer("offset", offset), _integer("skip_prefix_n_tokens", skip)
        mapping = self._slot_mapping(slot_mapping, g)
        return [plan_chunk(mapping, s, e, num_slots=g.S, block_size=g.N, offset=offset, skip=skip)
                for s, e in zip(starts, ends, strict=True)]

    # -- moving one object's tensor ---------------------------------------------------

    def _staging_for(self, tensor: torch.Tensor, g: Geometry) -> torch.Tensor:
        """Where a copy works: the object itself when it lives with the cache; else (and
        always with use_gpu) a tensor on the cache's device, copied to or from the object
        in one step. With use_gpu that tensor is one reusable staging buffer."""
        if not self.use_gpu:
            if tensor.device == g.device:
                return tensor
            return torch.empty(tensor.shape, dtype=tensor.dtype, device=g.device)
        need = tensor.numel() * tensor.element_size()
        if self._staging is None or self._staging.numel() < need:
            self._staging = torch.empty(need, dtype=torch.uint8, device=g.device)
        return self._staging[:need].view(tensor.dtype).view(tensor.shape)

    def _staged_store(self, copy: Copy, tensor: torch.Tensor, kvcaches: Any, g: Geometry, ck: Chunk) -> None:
        """Run a generated store into `tensor`, through the staging tensor where one is used."""
        work = self._staging_for(tensor, g)
        if work is not tensor and not ck.covers_all:
            self.backend.copy(work, tensor)  # so skipped tokens come back unchanged
        copy(work, kvcaches, g, ck, self._words(work, kvcaches, g))
        if work is not tensor:
            self.backend.copy(tensor, work)

    def _staged_load(self, copy: Copy, tensor: torch.Tensor, kvcaches: Any, g: Geometry, ck: Chunk) -> None:
        """Run a generated load from `tensor`, through the staging tensor where one is used."""
        work = self._staging_for(tensor, g)
        if work is not tensor:
            self.backend.copy(work, tensor)
        copy(work, kvcaches, g, ck, self._words(work, kvcaches, g))

    def _check_staging(self, tensors: Sequence[torch.Tensor]) -> None:
        """Refuse, before anything moves, a transfer the capped staging buffer cannot hold."""
        if self.use_gpu and self.staging_bytes is not None:
            need = max((t.numel() * t.element_size() for t in tensors), default=0)
            if need > self.staging_bytes:
                raise KVLayoutError(f"staging buffer too small: a chunk needs {need} bytes, "
                                    f"{self.staging_bytes} bytes are available (staging_bytes)")

    def _words(self, tensor: torch.Tensor, kvcaches: Any, g: Geometry) -> Words:
        """The widest copy unit both the bound cache and this object tensor allow."""
        if self._words_key != self._key:
            leaves = _leaves(kvcaches)
            limit = MAX_WORD.get(g.device.type, 8)
            self._cache_width = widest(leaves, g.C, limit) if self.widen else leaves[0].element_size()
            self._words_key = self._key
        width = widest([tensor], g.C, self._cache_width) if self.widen else tensor.element_size()
        return words(width, tensor.element_size(), g.C)

    def _shape(self, g: Geometry, num_tokens: int) -> tuple[int, ...]:
        raise NotImplementedError


class ChunkConnector(_Base):
    """Whole-chunk objects (KV_2LTD, KV_MLA_FMT): every layer of a chunk in one object."""

    layerwise = False

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        self.batched_from_gpu([memory_obj], [start], [end], **kwargs)

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        self.batched_to_gpu([memory_obj], [start], [end], **kwargs)

    def batched_from_gpu(self, memory_objs: Sequence[Any], starts: Sequence[int], ends: Sequence[int], *,
                         kvcaches: Any, slot_mapping: Any, offset: int = 0, **_: Any) -> None:
        """Copy each chunk's tokens from the paged cache into its memory object."""
        g = self.bind(kvcaches)
        chunks = self._chunks(g, slot_mapping, starts, ends, offset, 0)
        self._check_count(memory_objs, chunks)
        tensors = [self._check_object(o, g, ck.num_tokens, storing=True)
                   for o, ck in zip(memory_objs, chunks, strict=True)]
        self._check_staging(tensors)
        for obj, tensor, ck in zip(memory_objs, tensors, chunks, strict=True):
            self._staged_store(self._store, tensor, kvcaches, g, ck)
            obj.metadata.fmt = relabel(obj.metadata.fmt, self.format)
        self.backend.synchronize(self.backend.current_stream())

    def batched_to_gpu(self, memory_objs: Sequence[Any], starts: Sequence[int], ends: Sequence[int], *,
                       kvcaches: Any, slot_mapping: Any, offset: int = 0, skip_prefix_n_tokens: int = 0,
                       **_: Any) -> None:
        """Copy each memory object into the paged cache at its chunk's slots."""
        g = self.bind(kvcaches)
        chunks = self._chunks(g, slot_mapping, starts, ends, offset, skip_prefix_n_tokens)
        self._check_count(memory_objs, chunks)
        tensors = [self._check_object(o, g, ck.num_tokens, storing=False)
                   for o, ck in zip(memory_objs, chunks, strict=True)]
        self._check_staging(tensors)
        for tensor, ck in zip(tensors, chunks, strict=True):
            self._staged_load(self._load, tensor, kvcaches, g, ck)
        self.backend.synchronize(self.backend.current_stream())

    @staticmethod
    def _check_count(memory_objs: Sequence[Any], chunks: Sequence[Chunk]) -> None:
        if not isinstance(memory_objs, Sequence) or len(memory_objs) != len(chunks):
            raise KVLayoutError(f"expected a list of {len(chunks)} memory objects (one per chunk), "
                                f"got {describe(memory_objs)}")

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
                        "batched_from_gpu(memory_objs[layer][chunk], starts, ends, ...) instead of from_gpu")

    def to_gpu(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(f"{type(self).__module__} moves per-layer objects: use the generator "
                        "batched_to_gpu(starts, ends, ...) and send() each layer's objects instead of to_gpu")

    def batched_from_gpu(self, memory_objs: Sequence[Sequence[Any]], starts: Sequence[int],
                         ends: Sequence[int], *, kvcaches: Any, slot_mapping: Any, sync: bool = True,
                         offset: int = 0, **_: Any) -> Generator[None, None, None]:
        """Store layer by layer: yields once per layer after its copy is queued, then once
        after the final synchronization (L + 1 yields)."""
        g = self.bind(kvcaches)
        chunks = self._chunks(g, slot_mapping, starts, ends, offset, 0)
        if (not isinstance(memory_objs, Sequence) or len(memory_objs) != g.L
                or any(not isinstance(objs, Sequence) or len(objs) != len(chunks) for objs in memory_objs)):
            shape = [len(o) if isinstance(o, Sequence) else type(o).__name__ for o in memory_objs] \
                if isinstance(memory_objs, Sequence) else type(memory_objs).__name__
            raise KVLayoutError(f"expected memory_objs[{g.L} layers][{len(chunks)} chunks] of "
                                f"{self._expected(g, None)} objects, got {describe(memory_objs)} "
                                f"(objects per layer: {shape})")
        tensors = [[self._check_object(o, g, ck.num_tokens, storing=True) for o, ck in zip(objs, chunks, strict=True)]
                   for objs in memory_objs]
        self._check_staging([t for row in tensors for t in row])
        stream = self._stream("store")
        for layer in range(g.L):
            with on_stream(self.backend, stream):
                for tensor, ck in zip(tensors[layer], chunks, strict=True):
                    self._staged_store(partial(self._store_layer, layer), tensor, kvcaches, g, ck)
            yield
        self._finish(stream, sync)
        for objs in memory_objs:
            for obj in objs:
                obj.metadata.fmt = relabel(obj.metadata.fmt, self.format)
        yield

    def batched_to_gpu(self, starts: Sequence[int], ends: Sequence[int], *, kvcaches: Any, slot_mapping: Any,
                       sync: bool = True, offset: int = 0, skip_prefix_n_tokens: int = 0,
                       **_: Any) -> Generator[None, Sequence[Any], None]:
        """Load layer by layer: prime with next(), send() each layer's objects (one per
        chunk), then next() once more (L + 2 yields)."""
        g = self.bind(kvcaches)
        chunks = self._chunks(g, slot_mapping, starts, ends, offset, skip_prefix_n_tokens)
        stream = self._stream("load")
        objs = yield
        for layer in range(g.L):
            if not isinstance(objs, Sequence) or len(objs) != len(chunks):
                raise KVLayoutError(f"layer {layer}: send() a list of one memory object per chunk "
                                    f"({len(chunks)}), got {describe(objs)}")
            tensors = [self._check_object(o, g, ck.num_tokens, storing=False)
                       for o, ck in zip(objs, chunks, strict=True)]
            self._check_staging(tensors)
            with on_stream(self.backend, stream):
                for tensor, ck in zip(tensors, chunks, strict=True):
                    self._staged_load(partial(self._load_layer, layer), tensor, kvcaches, g, ck)
            if sync:
                self.backend.wait_stream(self.backend.current_stream(), stream)
            objs = yield
        self._finish(stream, sync)
        yield

    def _finish(self, stream: Any, sync: bool) -> None:
        if sync:
            self.backend.synchronize(stream)
        else:
            self.backend.wait_stream(self.backend.current_stream(), stream)

    def _store_layer(self, layer: int, tensor: torch.Tensor, kvcaches: Any, g: Geometry, ck: Chunk,
                     w: Words) -> None:
        raise NotImplementedError

    def _load_layer(self, layer: int, tensor: torch.Tensor, kvcaches: Any, g: Geometry, ck: Chunk,
                    w: Words) -> None:
        raise NotImplementedError


def _leaves(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    return [t for sub in tree for t in _leaves(sub)]


def _cache_key(kvcaches: Any) -> tuple[Any, ...]:
    """Identity of a registered cache: the container and where its first tensor lives."""
    node = kvcaches
    while isinstance(node, (list, tuple)) and node:
        node = node[0]
    if isinstance(node, torch.Tensor):
        return (id(kvcaches), node.device, node.data_ptr(), tuple(node.shape), tuple(node.stride()), node.dtype)
    return (id(kvcaches),)


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
