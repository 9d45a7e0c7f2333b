"""What every generated connector shares: binding a cache, checking inputs, staging
between devices, streams and format labels. The chunk loop of whole-chunk objects lives in
`kvgen.runtime.whole`, the layer loop of per-layer objects in `kvgen.runtime.layerwise`.

A generated module subclasses one of those and supplies only the copies themselves
(`_store`/`_load`, or `_store_layer`/`_load_layer`) and the object shape. Every check
runs before the first element is written, so a refused call leaves cache and object
exactly as they were (a layerwise load checks each layer's objects as they arrive, and a
layerwise transfer checks each layer's cache tensors and objects again before its copy, since
the caller runs between two steps).

A connector may be shared by threads: what a call works with (the cache's binding, its
chunks, the frozen cache tree) is computed per call and immutable; the only shared state is
a cache of bindings, backends and streams (filled under a lock) and the staging buffers,
which are per thread. See docs/connectors.md.
"""

from __future__ import annotations

import itertools
import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from kvgen.runtime import calls
from kvgen.runtime.aliasing import check_objects_apart, check_unique_slots
from kvgen.runtime.binding import Binding, Snapshot, leaf_names, new_binding, snapshot
from kvgen.runtime.devices import Backend, backend_for, check_device, device_kind
from kvgen.runtime.errors import KVLayoutError
from kvgen.runtime.layout import Geometry, ObjectLayout, PagedLayout, broadcast_dims, describe
from kvgen.runtime.memory import Format, check_fingerprint, check_relabel, format_name
from kvgen.runtime.movers.choose import MoverChoice
from kvgen.runtime.movers.program import CopyProgram
from kvgen.runtime.slots import Chunk, plan_chunk, plan_pooled_chunk, signed_integers
from kvgen.runtime.words import Words, widest, words

#: Bindings kept per connector (a few caches in turn, e.g. one per engine or thread).
_BINDINGS_KEPT = 8

_MISSING: Any = calls.MISSING
_SERIALS = itertools.count(1)


class Call:
    """What one transfer works with, fixed when it starts: the binding, the frozen cache
    tree the copies index, the slot mapping on the cache's device, the chunks, and the
    mapping's entries each chunk writes (`windows`, for the load's one-writer-per-slot check)."""

    __slots__ = ("binding", "kvcaches", "mapping", "chunks", "windows", "offset", "serial")

    def __init__(self, binding: Binding, kvcaches: Any, mapping: torch.Tensor, chunks: list[Chunk],
                 windows: Sequence[tuple[int, int]] = (), offset: int = 0):
        self.binding, self.kvcaches, self.mapping, self.chunks = binding, kvcaches, mapping, chunks
        #: Per chunk, the tokens [start + skip, end) a load writes; `offset`: the mapping's first token.
        self.windows, self.offset = tuple(windows), offset
        #: This call's number in the process, never reused (what movers keep per call is keyed by it).
        self.serial = next(_SERIALS)

    @property
    def g(self) -> Geometry:
        return self.binding.geometry


def max_word(device: torch.device) -> int:
    """Widest copy word of the torch path on `device` (the device registry's fact)."""
    kind = device_kind(device.type)
    return kind.word if kind is not None else 8


class ConnectorBase(MoverChoice):
    layout: ClassVar[PagedLayout]
    memory: ClassVar[ObjectLayout]
    #: The planned copy description (kvgen.plan.program) the movers execute.
    program: ClassVar[CopyProgram]
    strategy: ClassVar[str]
    layerwise: ClassVar[bool]
    #: Whether the generated copies may move C as wider integer words (both sides end in C).
    widen: ClassVar[bool] = False
    #: The generated module's geometry reading: checks a cache, returns its extents.
    read_geometry: ClassVar[Callable[[Any], Geometry]]

    def __init__(self, device: torch.device | str | None = None, *, use_gpu: bool = False,
                 staging_bytes: int | None = None, backend: Backend | str | None = None):
        """`device`: where the cache lives (default: read from the first cache bound); a
        device that is not present here is refused now. `use_gpu`: gather into a reusable
        staging tensor on the cache's device (one per thread), then make one copy to the
        host; `staging_bytes` caps that tensor (default: sized on demand). `backend`: the
        mover chunks move with, "native", "triton" or "torch" (default: the first the device
        registry lists that runs here, kvgen.runtime.movers.choose); a device Backend object
        instead replaces the device's own (tests pass a recording fake)."""
        self.device = check_device(device) if device is not None else None
        self.use_gpu = use_gpu
        self.staging_bytes = staging_bytes
        self._backend = None if isinstance(backend, str) else backend
        self._init_movers(backend if isinstance(backend, str) else None, self.device)
        self._lock = threading.Lock()
        self._bindings: dict[Any, Binding] = {}
        self._last: Binding | None = None
        self._backends: dict[torch.device, Backend] = {}
        self._streams: dict[tuple[torch.device, str], Any] = {}
        self._local = threading.local()
        self._words_of: dict[tuple[Any, ...], Words] = {}
        self.format = Format(self.memory.format, self.memory.code)
        #: The loading cache's layout fingerprint (kvgen.remote.check_loads sets it): a load
        #: refuses an object stamped with another. None: loads check no stamp.
        self.layout_fingerprint: str | None = None

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
        geometry = self.read_geometry(kvcaches)  # the one place a cache's geometry is read
        per = self.layout.slots_per_token
        if per > 1 and (geometry.N or 0) % per:
            raise KVLayoutError(f"{self.layout.name}: a block stores whole tokens of {per} slots each, but the "
                                f"cache's blocks have N={geometry.N} slots ({describe(kvcaches)})")
        if key is None:  # the geometry check accepted what is no tree of tensors
            raise KVLayoutError(f"{self.layout.name}: kvcaches must be lists or tuples of tensors, got "
                                f"{describe(kvcaches)}")
        limit = max_word(geometry.device) if self.widen else None
        binding = new_binding(Snapshot(kvcaches, tree, key), geometry, tuple(leaf_names(tree)), word_limit=limit,
                              owner=self.layout.name, argument=f"{self.layout.name}: kvcaches")
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
            raise KVLayoutError(f"{type(self).__module__}: no cache bound yet; pass kvcaches to a "
                                "transfer or call bind(kvcaches) first")
        return last.geometry

    def get_shape(self, num_tokens: int, kvcaches: Any = None) -> torch.Size:
        """Shape of the memory object (of one layer's object, when layerwise) for a chunk of
        `kvcaches` (default: the cache bound last)."""
        count = token_count(num_tokens)
        g = self.geometry if kvcaches is None else self.bind(kvcaches)
        return torch.Size(self._shape(g, count * self.layout.slots_per_token))

    def get_dtype(self, kvcaches: Any = None) -> torch.dtype:
        """Element type of the memory object for `kvcaches` (default: the cache bound last):
        the cache's, or for a format-2 object of regions, bytes."""
        g = self.geometry if kvcaches is None else self.bind(kvcaches)
        return self._dtype(g)

    def _dtype(self, g: Geometry) -> torch.dtype:
        return g.dtype

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
        starts, ends = _positions("starts", starts), _positions("ends", ends)
        offset, skip = _integer("offset", offset), _integer("skip_prefix_n_tokens", skip)
        mapping, chunks = self._chunks(binding.geometry, slot_mapping, starts, ends, offset, skip)
        return Call(binding, tree, mapping, chunks, [(s + skip, e) for s, e in zip(starts, ends, strict=True)], offset)

    def _expected(self, g: Geometry, num_tokens: int | None) -> str:
        """`kv_2ltd [KV=2 L=32 T=256 (H=8 C=128)] bfloat16`; T left open when None."""
        ext = g.extents() if num_tokens is None else {**g.extents(), "T": num_tokens}
        return f"{self.memory.name} {self.memory.arrow(ext)} {str(self._dtype(g)).removeprefix('torch.')}"

    def _check_object(self, obj: Any, g: Geometry, num_tokens: int, *, storing: bool) -> torch.Tensor:
        # The layout text of a message is spelled out only for a refusal: it costs more than the checks.
        def expected() -> str:
            return self._expected(g, num_tokens)

        tensor = getattr(obj, "tensor", None)
        metadata = getattr(obj, "metadata", None)
        if not isinstance(tensor, torch.Tensor) or not hasattr(metadata, "fmt"):
            raise KVLayoutError(f"expected a memory object with .tensor ({expected()}) and .metadata.fmt, "
                                f"got {describe(obj)}"
                                + (f" with .tensor {describe(tensor)}" if hasattr(obj, "tensor") else ""))
        shape = self._shape(g, num_tokens)
        if tensor.shape != shape or tensor.dtype != self._dtype(g):
            raise KVLayoutError(f"memory object must be {expected()} "
                                f"(shape {list(shape)}), got {describe(tensor)}")
        if tensor.is_meta:
            raise KVLayoutError(f"memory object {expected()} must have storage, got a tensor on {tensor.device}")
        shared = broadcast_dims(tensor)
        if shared:
            raise KVLayoutError(f"memory object {expected()} has dims {shared} with stride 0 "
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
            check_relabel(metadata, lambda: f"memory object {expected()}")
        elif current != self.memory.format:
            raise KVLayoutError(f"cannot load an object labelled {current}: this connector reads "
                                f"{self.memory.format} ({expected()})")
        else:
            check_fingerprint(metadata, self.layout_fingerprint)
        return tensor

    @staticmethod
    def _check_apart(call: Call, tensors: Sequence[torch.Tensor], name: Callable[[int], str]) -> None:
        """Objects may share memory neither with themselves, each other nor the cache."""
        check_objects_apart(tensors, name, call.binding.memory, call.binding.names)

    @staticmethod
    def _check_unique_slots(call: Call) -> None:
        """A load writes each slot from one token at most."""
        check_unique_slots(call.mapping, call.windows, call.offset)

    def _slot_mapping(self, slot_mapping: Any, g: Geometry) -> torch.Tensor:
        """The slot mapping as a 1-D signed integer tensor on the cache's device."""
        if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1:
            raise KVLayoutError(f"slot_mapping must be a 1-D integer tensor (one slot per token, < 0 to "
                                f"skip), got {describe(slot_mapping)}")
        dtype = slot_mapping.dtype
        if not signed_integers(dtype):
            raise KVLayoutError(f"slot_mapping must hold signed integers (int64, int32, ...), got "
                                f"{describe(slot_mapping)}")
        if slot_mapping.device.type == "meta":
            raise KVLayoutError(f"slot_mapping must be on the cpu or on {g.device}, got {describe(slot_mapping)}")
        if slot_mapping.device != g.device:
            slot_mapping = slot_mapping.to(g.device)
        return slot_mapping

    def _chunks(self, g: Geometry, slot_mapping: Any, starts: list[int], ends: list[int],
                offset: int, skip: int) -> tuple[torch.Tensor, list[Chunk]]:
        if len(starts) != len(ends):
            raise KVLayoutError(f"expected one end per start, got {len(starts)} starts {list(starts)} but "
                                f"{len(ends)} ends {list(ends)}")
        mapping = self._slot_mapping(slot_mapping, g)
        per = self.layout.slots_per_token
        if per > 1:
            return mapping, [plan_pooled_chunk(mapping, (s, e), g, per, offset=offset, skip=skip)
                             for s, e in zip(starts, ends, strict=True)]
        return mapping, [plan_chunk(mapping, s, e, g, offset=offset, skip=skip)
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

    def _staged_store(self, tensor: torch.Tensor, call: Call, ck: Chunk, role: str, layer: int | None = None) -> None:
        """Store chunk `ck` (one layer of it, when `layer` is given) into `tensor` with the
        device's mover, through the staging tensor where one is used."""
        g = call.g
        backend = self._backend_for(g.device)
        work = self._staging_for(tensor, g, role)
        if work is not tensor and not ck.covers_all:
            backend.copy(work, tensor)  # so skipped tokens come back unchanged
        self._move(True, work, call, ck, layer)
        if work is not tensor:
            backend.copy(tensor, work)

    def _staged_load(self, tensor: torch.Tensor, call: Call, ck: Chunk, role: str, layer: int | None = None) -> None:
        """Load chunk `ck` (one layer of it, when `layer` is given) from `tensor` with the
        device's mover, through the staging tensor where one is used."""
        g = call.g
        work = self._staging_for(tensor, g, role)
        if work is not tensor:
            self._backend_for(g.device).copy(work, tensor)
        self._move(False, work, call, ck, layer)

    def _check_staging(self, tensors: Sequence[torch.Tensor]) -> None:
        """Refuse, before anything moves, a transfer the capped staging buffer cannot hold."""
        if self.use_gpu and self.staging_bytes is not None:
            need = max((t.numel() * t.element_size() for t in tensors), default=0)
            if need > self.staging_bytes:
                raise KVLayoutError(f"staging buffer too small: a chunk needs {need} bytes, "
                                    f"{self.staging_bytes} bytes are available (staging_bytes)")

    def _words(self, tensor: torch.Tensor, binding: Binding) -> Words:
        """The widest copy unit both the call's cache and this object tensor allow; kept per
        object geometry, since a layerwise call asks once per layer with equal objects."""
        g = binding.geometry
        key = (binding.width, g.C, tensor.dtype, tensor.shape, tensor.stride(), tensor.storage_offset() % 16)
        found = self._words_of.get(key)
        if found is None:
            width = widest([tensor], g.C, binding.width) if self.widen else tensor.element_size()
            found = words(width, tensor.element_size(), g.C)
            if len(self._words_of) >= 64:
                self._words_of.clear()
            self._words_of[key] = found
        return found

    def _shape(self, g: Geometry, num_tokens: int) -> tuple[int, ...]:
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


def token_count(value: Any) -> int:
    """A number of tokens: an integer >= 0, else KVLayoutError (a negative count would make a
    shape with a negative extent)."""
    count = _integer("num_tokens", value)
    if count < 0:
        raise KVLayoutError(f"num_tokens must be >= 0, got {count}")
    return count


def _positions(what: str, values: Any) -> list[int]:
    """Chunk starts or ends: a sequence (or 1-D tensor) of integers."""
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.dtype.is_floating_point or values.dtype.is_complex:
            raise KVLayoutError(f"{what} must be a list of integers, got {describe(values)}")
        values = values.tolist()
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise KVLayoutError(f"{what} must be a list of integers (one per chunk), got {type(values).__name__}")
    return [_integer(f"{what}[{i}]", v) for i, v in enumerate(values)]
