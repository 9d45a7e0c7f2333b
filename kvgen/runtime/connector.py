"""What every generated connector shares: binding a cache, checking inputs, chunk and
layer loops, staging between devices, streams and format labels.

A generated module subclasses one of these and supplies only the copies themselves
(`_store`/`_load`, or `_store_layer`/`_load_layer`) and the object shape. Every check
runs before the first element is written, so a refused call leaves cache and object
exactly as they were.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any, ClassVar

import torch

from kvgen.runtime.devices import Backend, backend_for, on_stream
from kvgen.runtime.errors import KVLayoutError
from kvgen.runtime.layout import Geometry, ObjectLayout, PagedLayout, describe, read_geometry
from kvgen.runtime.memory import Format, format_name, relabel
from kvgen.runtime.slots import Chunk, plan_chunk


class _Base:
    layout: ClassVar[PagedLayout]
    memory: ClassVar[ObjectLayout]
    strategy: ClassVar[str]
    layerwise: ClassVar[bool]

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
        self.format = Format(self.memory.format, self.memory.code)

    # -- geometry ---------------------------------------------------------------------

    def bind(self, kvcaches: Any) -> Geometry:
        """Check `kvcaches` against the layout once; later calls with the same cache reuse it."""
        key = _cache_key(kvcaches)
        if key != self._key:
            geometry = read_geometry(self.layout, kvcaches)
            if self.device is not None and geometry.device != self.device:
                raise KVLayoutError(f"{self.layout.name}: kvcaches are on {geometry.device}, "
                                    f"but this connector was made for {self.device}")
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

    def _expected(self, g: Geometry, num_tokens: int) -> str:
        ext = {**g.extents(), "T": num_tokens}
        return f"{self.memory.name} {self.memory.arrow(ext)} {str(g.dtype).removeprefix('torch.')}"

    def _check_object(self, obj: Any, g: Geometry, num_tokens: int, *, storing: bool) -> torch.Tensor:
        tensor = getattr(obj, "tensor", None)
        if not isinstance(tensor, torch.Tensor) or not hasattr(obj, "metadata"):
            raise KVLayoutError(f"expected a memory object with .tensor and .metadata.fmt, got {describe(obj)}")
        shape = self._shape(g, num_tokens)
        if tuple(tensor.shape) != shape or tensor.dtype != g.dtype:
            raise KVLayoutError(f"memory object must be {self._expected(g, num_tokens)} "
                                f"(shape {list(shape)}), got {describe(tensor)}")
        current = format_name(obj.metadata.fmt)
        if storing:
            if current != self.memory.format and current not in self.memory.accepts:
                allowed = ", ".join([self.memory.format, *self.memory.accepts])
                raise KVLayoutError(f"cannot store {self.memory.format} into an object labelled "
                                    f"{current}; allowed labels before a store: {allowed}")
        elif current != self.memory.format:
            raise KVLayoutError(f"cannot load an object labelled {current}: this connector reads "
                                f"{self.memory.format}")
        return tensor

    def _slot_mapping(self, slot_mapping: Any) -> torch.Tensor:
        if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1:
            raise KVLayoutError(f"slot_mapping must be a 1-D integer tensor, got {describe(slot_mapping)}")
        if slot_mapping.dtype.is_floating_point or slot_mapping.dtype in (torch.bool, torch.uint8):
            raise KVLayoutError(f"slot_mapping must hold signed integers, got {slot_mapping.dtype}")
        return slot_mapping

    def _chunks(self, g: Geometry, slot_mapping: Any, starts: Sequence[int], ends: Sequence[int],
                offset: int, skip: int) -> list[Chunk]:
        if len(starts) != len(ends):
            raise KVLayoutError(f"got {len(starts)} starts but {len(ends)} ends")
        mapping = self._slot_mapping(slot_mapping)
        return [plan_chunk(mapping, int(s), int(e), num_slots=g.S, block_size=g.N, offset=offset, skip=skip)
                for s, e in zip(starts, ends)]

    # -- moving one object's tensor ---------------------------------------------------

    def _staging_for(self, tensor: torch.Tensor, g: Geometry) -> torch.Tensor:
        """A tensor on the cache's device shaped like `tensor` (itself when already there)."""
        if tensor.device == g.device:
            return tensor
        if not self.use_gpu:
            return torch.empty(tensor.shape, dtype=tensor.dtype, device=g.device)
        need = tensor.numel() * tensor.element_size()
        have = self._staging.numel() if self._staging is not None else 0
        if need > have:
            limit = self.staging_bytes
            if limit is not None and need > limit:
                raise KVLayoutError(f"staging buffer too small: this transfer needs {need} bytes, "
                                    f"the cap is {limit} bytes (staging_bytes)")
            self._staging = torch.empty(need, dtype=torch.uint8, device=g.device)
        assert self._staging is not None
        return self._staging[:need].view(tensor.dtype).view(tensor.shape)

    def _check_staging(self, tensors: Sequence[torch.Tensor], g: Geometry) -> None:
        if self.use_gpu and self.staging_bytes is not None:
            for t in tensors:
                need = t.numel() * t.element_size()
                if t.device != g.device and need > self.staging_bytes:
                    raise KVLayoutError(f"staging buffer too small: this transfer needs {need} bytes, "
                                        f"the cap is {self.staging_bytes} bytes (staging_bytes)")

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
        tensors = [self._check_object(o, g, ck.num_tokens, storing=True) for o, ck in zip(memory_objs, chunks)]
        self._check_staging(tensors, g)
        for obj, tensor, ck in zip(memory_objs, tensors, chunks):
            work = self._staging_for(tensor, g)
            if work is not tensor and not ck.covers_all:
                self.backend.copy(work, tensor)  # so skipped tokens come back unchanged
            self._store(work, kvcaches, g, ck)
            if work is not tensor:
                self.backend.copy(tensor, work)
            obj.metadata.fmt = relabel(obj.metadata.fmt, self.format)
        self.backend.synchronize(self.backend.current_stream())

    def batched_to_gpu(self, memory_objs: Sequence[Any], starts: Sequence[int], ends: Sequence[int], *,
                       kvcaches: Any, slot_mapping: Any, offset: int = 0, skip_prefix_n_tokens: int = 0,
                       **_: Any) -> None:
        """Copy each memory object into the paged cache at its chunk's slots."""
        g = self.bind(kvcaches)
        chunks = self._chunks(g, slot_mapping, starts, ends, offset, skip_prefix_n_tokens)
        self._check_count(memory_objs, chunks)
        tensors = [self._check_object(o, g, ck.num_tokens, storing=False) for o, ck in zip(memory_objs, chunks)]
        self._check_staging(tensors, g)
        for tensor, ck in zip(tensors, chunks):
            work = self._staging_for(tensor, g)
            if work is not tensor:
                self.backend.copy(work, tensor)
            self._load(work, kvcaches, g, ck)
        self.backend.synchronize(self.backend.current_stream())

    @staticmethod
    def _check_count(memory_objs: Sequence[Any], chunks: Sequence[Chunk]) -> None:
        if len(memory_objs) != len(chunks):
            raise KVLayoutError(f"got {len(memory_objs)} memory objects for {len(chunks)} chunks")

    def _store(self, tensor: torch.Tensor, kvcaches: Any, g: Geometry, ck: Chunk) -> None:
        raise NotImplementedError

    def _load(self, tensor: torch.Tensor, kvcaches: Any, g: Geometry, ck: Chunk) -> None:
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
        if len(memory_objs) != g.L or any(len(objs) != len(chunks) for objs in memory_objs):
            raise KVLayoutError(f"expected memory_objs[{g.L} layers][{len(chunks)} chunks], "
                                f"got {describe(memory_objs)}")
        tensors = [[self._check_object(o, g, ck.num_tokens, storing=True) for o, ck in zip(objs, chunks)]
                   for objs in memory_objs]
        self._check_staging([t for row in tensors for t in row], g)
        stream = self._stream("store")
        for layer in range(g.L):
            with on_stream(self.backend, stream):
                for tensor, ck in zip(tensors[layer], chunks):
                    work = self._staging_for(tensor, g)
                    if work is not tensor and not ck.covers_all:
                        self.backend.copy(work, tensor)
                    self._store_layer(layer, work, kvcaches, g, ck)
                    if work is not tensor:
                        self.backend.copy(tensor, work)
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
            if objs is None or len(objs) != len(chunks):
                raise KVLayoutError(f"layer {layer}: send() one memory object per chunk "
                                    f"({len(chunks)}), got {describe(objs)}")
            tensors = [self._check_object(o, g, ck.num_tokens, storing=False) for o, ck in zip(objs, chunks)]
            self._check_staging(tensors, g)
            with on_stream(self.backend, stream):
                for tensor, ck in zip(tensors, chunks):
                    work = self._staging_for(tensor, g)
                    if work is not tensor:
                        self.backend.copy(work, tensor)
                    self._load_layer(layer, work, kvcaches, g, ck)
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

    def _store_layer(self, layer: int, tensor: torch.Tensor, kvcaches: Any, g: Geometry, ck: Chunk) -> None:
        raise NotImplementedError

    def _load_layer(self, layer: int, tensor: torch.Tensor, kvcaches: Any, g: Geometry, ck: Chunk) -> None:
        raise NotImplementedError


def _cache_key(kvcaches: Any) -> tuple[Any, ...]:
    """Identity of a registered cache: the container and where its first tensor lives."""
    node = kvcaches
    while isinstance(node, (list, tuple)) and node:
        node = node[0]
    if isinstance(node, torch.Tensor):
        return (id(kvcaches), node.data_ptr(), tuple(node.shape), tuple(node.stride()), node.dtype)
    return (id(kvcaches),)
