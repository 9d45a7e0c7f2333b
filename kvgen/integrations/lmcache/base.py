"""What every LMCache-compatible connector shares: finding the layout of the cache it is
handed (detection, once per cache), holding the generated kvgen connector for it,
translating LMCache's keyword arguments into the ones kvgen's connectors accept, and the
device buffer allocator LMCache's layerwise callers read.

The generated connector is used only through its public methods (`batched_from_gpu`,
`batched_to_gpu`); keyword arguments are passed only where its signature names them.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import threading
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any, ClassVar

import torch

from kvgen.errors import KVLayoutError
from kvgen.integrations.detect import HINTS, SYNONYMS, Detection, detect, read_structure
from kvgen.integrations.lmcache._compat import GPUConnectorInterface
from kvgen.runtime import MemoryObj, backend_for
from kvgen.runtime.connector import token_count
from kvgen.runtime.devices import on_stream

#: How many distinct caches one connector remembers the detection of.
_BINDINGS = 8


class BufferObj(MemoryObj):
    """A memory object carved out of a LayerBufferAllocator, with LMCache's ref counting."""

    def __init__(self, tensor: torch.Tensor, fmt: Any, release: Callable[[], None]):
        super().__init__(tensor, fmt)
        self._release = release
        self._refs = 1

    def get_shape(self) -> torch.Size:
        return self.tensor.shape

    def get_ref_count(self) -> int:
        return self._refs

    def is_valid(self) -> bool:
        return self._refs > 0

    def ref_count_up(self) -> None:
        self._refs += 1

    def ref_count_down(self) -> None:
        self._refs -= 1
        if self._refs == 0:
            self._release()


class LayerBufferAllocator:
    """LMCache's `gpu_buffer_allocator`: device memory the size of one cache layer, handing
    out memory objects (`allocate(shape, dtype, fmt)`, None when full). kvgen's connectors
    stage through their own buffer, so this memory is taken only on the first allocate."""

    ALIGN = 256

    def __init__(self, size: int, device: torch.device | str):
        self.size = int(size)
        self.device = torch.device(device)
        self._buffer: torch.Tensor | None = None
        self._taken: dict[int, int] = {}  # offset -> bytes
        self._lock = threading.Lock()

    def allocate(self, shapes: Any, dtypes: Any, fmt: Any = None, allocator_type: str | None = None
                 ) -> BufferObj | None:
        shape = torch.Size(shapes[0] if isinstance(shapes, list) else shapes)
        dtype = dtypes[0] if isinstance(dtypes, list) else dtypes
        need = shape.numel() * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            if self._buffer is None:
                self._buffer = torch.empty(self.size, dtype=torch.uint8, device=self.device)
            offset = self._find(need)
            if offset is None:
                return None
            self._taken[offset] = need
        view = self._buffer[offset:offset + need].view(dtype).view(shape)
        return BufferObj(view, fmt, lambda: self._free(offset))

    def _find(self, need: int) -> int | None:
        at = 0
        for start in sorted(self._taken):
            if start - at >= need:
                return at
            at = -(-(start + self._taken[start]) // self.ALIGN) * self.ALIGN
        return at if self.size - at >= need else None

    def _free(self, offset: int) -> None:
        with self._lock:
            self._taken.pop(offset, None)

    def memcheck(self) -> bool:
        """Whether the allocator's books are consistent (LMCache's tests call this after
        transfers): every taken range inside the buffer, none overlapping another."""
        with self._lock:
            at = 0
            for start in sorted(self._taken):
                if start < at or start + self._taken[start] > self.size:
                    return False
                at = start + self._taken[start]
            return True

    def close(self) -> None:
        with self._lock:
            self._buffer, self._taken = None, {}


_SIGNATURES: dict[tuple[type, str], frozenset[str]] = {}


def keywords_of(method: Callable[..., Any]) -> frozenset[str]:
    """The keyword arguments a bound method names in its signature."""
    key = (type(getattr(method, "__self__", None)), getattr(method, "__name__", ""))
    if key not in _SIGNATURES:
        params = inspect.signature(method).parameters.values()
        _SIGNATURES[key] = frozenset(p.name for p in params
                                     if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
    return _SIGNATURES[key]


def call_with(method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a kvgen connector method with the keyword arguments it names; a meaningful
    argument it does not name is refused rather than dropped."""
    names = keywords_of(method)
    dropped = {k: v for k, v in kwargs.items() if k not in names}
    if any(v not in (0, None) for v in dropped.values()):
        raise KVLayoutError(f"{getattr(method, '__qualname__', method)} takes no {', '.join(sorted(dropped))}; "
                            "this kvgen runtime cannot honour them")
    return method(*args, **{k: v for k, v in kwargs.items() if k in names})


def require(kwargs: Mapping[str, Any], name: str) -> Any:
    if name not in kwargs:
        raise ValueError(f"'{name}' should be provided in kwargs.")
    return kwargs[name]


def check_objects(memory_objs: Sequence[Any]) -> list[Any]:
    """LMCache memory objects as kvgen reads them, refusing freed ones by name (LMCache's
    `.tensor` is None once the ref count reached 0)."""
    out = []
    for i, obj in enumerate(memory_objs):
        valid = getattr(obj, "is_valid", None)
        if callable(valid) and not valid():
            raise KVLayoutError(f"memory object {i} was freed (its ref count reached 0); allocate a new one")
        out.append(obj)
    return out


#: The label LMCache's allocator gives whole-chunk objects; LMCache's MLA stores overwrite it.
_ALLOCATION_LABEL = "KV_2LTD"


@contextlib.contextmanager
def mla_relabelled(objs: Sequence[Any]) -> Iterator[None]:
    """An MLA store into objects labelled KV_2LTD, as LMCache's does: they are relabelled
    KV_MLA_FMT (with the label's own enum) for the store, and get their label back if the
    store refuses them. Any other label is left for the connector to judge."""
    changed = []
    for obj in objs:
        fmt = getattr(getattr(obj, "metadata", None), "fmt", None)
        if getattr(fmt, "name", None) == _ALLOCATION_LABEL and "KV_MLA_FMT" in getattr(type(fmt), "__members__", {}):
            obj.metadata.fmt = type(fmt)["KV_MLA_FMT"]
            changed.append((obj, fmt))
    try:
        yield
    except BaseException:
        for obj, fmt in changed:
            obj.metadata.fmt = fmt
        raise


def _leaf_key(kvcaches: Any) -> tuple[Any, ...]:
    if isinstance(kvcaches, torch.Tensor):
        return (kvcaches.device, kvcaches.data_ptr(), tuple(kvcaches.shape), kvcaches.stride(), kvcaches.dtype)
    if isinstance(kvcaches, (list, tuple)):
        return (len(kvcaches), *(_leaf_key(t) for t in kvcaches))
    return (id(kvcaches),)


class Adapter(GPUConnectorInterface):
    """Base of the LMCache-compatible connectors."""

    #: 'vllm', 'sglang' or 'trtllm': the engine hint given to detection.
    ENGINE: ClassVar[str]
    LAYERWISE: ClassVar[bool] = False

    def _setup(self, hidden_dim_size: int, num_layers: int, use_gpu: bool, options: Mapping[str, Any]) -> None:
        """`options`: the keywords LMCache's connectors take (chunk_size, dtype, device, use_mla,
        layout_hints) and kvgen's own kvgen_hints (more hints for detection)."""
        self.hidden_dim_size = int(hidden_dim_size)
        self.num_layers = int(num_layers)
        self.use_gpu = bool(use_gpu)
        self.chunk_size = options.get("chunk_size")
        self.dtype = options.get("dtype")
        device = options.get("device")
        self.device = torch.device(device) if device is not None else None
        self.use_mla = bool(options.get("use_mla", False))
        self.layout_hints: dict[str, Any] = dict(options.get("layout_hints") or {})
        self.kvcaches: Any = None
        self.detection: Detection | None = None
        self._extra_hints = dict(options.get("kvgen_hints") or {})
        self._given: Any = None
        self._bindings: dict[tuple[Any, ...], tuple[Detection, Any]] = {}
        self._lock = threading.Lock()
        backend = backend_for(self.device) if self.device is not None else None
        self.store_stream = backend.new_stream() if backend is not None else None
        self.load_stream = backend.new_stream() if backend is not None else None

    # -- the kvgen connector for a cache ------------------------------------------------

    def _object_name(self) -> str:
        if self.LAYERWISE:
            return "kv_mla_layer" if self.use_mla else "kv_t2d"
        return "kv_mla" if self.use_mla else "kv_2ltd"

    def _package(self) -> ModuleType | str:
        return self.layout_hints.get("kvgen_package", "kvgen.generated")

    def _hints(self) -> dict[str, Any]:
        hints: dict[str, Any] = {"engine": self.ENGINE, "num_layers": self.num_layers,
                                 "hidden_dim": self.hidden_dim_size, "use_mla": self.use_mla}
        hints.update(self._extra_hints)
        for key, value in self.layout_hints.items():
            if SYNONYMS.get(key, key) in HINTS:
                hints[SYNONYMS.get(key, key)] = value
        return hints

    def _bind(self, kwargs: Mapping[str, Any]) -> tuple[Any, Any]:
        """The generated connector for the cache in `kwargs` (or the last one given) and the
        memory-order view of that cache it moves."""
        kvcaches = kwargs.get("kvcaches", self._given)
        if kvcaches is None:
            raise ValueError("'kvcaches' should be provided in kwargs or initialized beforehand.")
        key = _leaf_key(kvcaches)
        with self._lock:
            bound = self._bindings.get(key)
            if bound is None:
                found = detect(kvcaches, package=self._package(), **self._hints())
                package = self._package()
                if isinstance(package, str):
                    package = importlib.import_module(package)
                connector = package.get(found.layout, self._object_name())(self.device, use_gpu=self.use_gpu)
                if len(self._bindings) >= _BINDINGS:
                    self._bindings.clear()
                bound = self._bindings[key] = (found, connector)
        found, connector = bound
        view = found.view(kvcaches)
        self.detection, self._given, self.kvcaches = found, kvcaches, view
        return connector, view

    def _stream(self, stream: Any) -> Any:
        """Run on `stream` after the work already queued on the current one (the engine's
        writes to the cache), as LMCache's connectors run on their own streams."""
        if stream is None:
            return contextlib.nullcontext()
        return on_stream(backend_for(self.device), stream)  # type: ignore[arg-type]

    def _init_buffer_allocator(self) -> None:
        """LMCache's lazily made staging allocator: one layer of the cache, on its device."""
        if not self.use_gpu or getattr(self, "gpu_buffer_allocator", None) is not None:
            return
        _, leaves = read_structure(self._given)
        assert self.detection is not None
        ext = self.detection.extents
        per_layer = sum(t.numel() for t in leaves) // max(ext.get("L", 1), 1)
        self.tokens_per_layer = ext["S"]
        self.elements_per_layer = per_layer
        self.gpu_buffer_allocator = LayerBufferAllocator(per_layer * leaves[0].element_size(), leaves[0].device)

    # -- shapes -------------------------------------------------------------------------

    def get_shape(self, num_tokens: int) -> torch.Size:
        num_tokens = token_count(num_tokens)
        if self.LAYERWISE:
            return torch.Size([num_tokens, self.hidden_dim_size] if self.use_mla
                              else [num_tokens, 2, self.hidden_dim_size])
        return torch.Size([1 if self.use_mla else 2, self.num_layers, num_tokens, self.hidden_dim_size])


class WholeAdapter(Adapter):
    """Whole-chunk objects (KV_2LTD / KV_MLA_FMT): from_gpu, to_gpu and their batches."""

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        self.batched_from_gpu([memory_obj], [start], [end], **kwargs)

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        self.batched_to_gpu([memory_obj], [start], [end], **kwargs)

    def batched_from_gpu(self, memory_objs: Sequence[Any], starts: Sequence[int], ends: Sequence[int],
                         **kwargs: Any) -> None:
        connector, view = self._bind(kwargs)
        mapping = require(kwargs, "slot_mapping")
        objs = check_objects(memory_objs)
        relabel = mla_relabelled(objs) if self.use_mla else contextlib.nullcontext()
        with self._stream(self.store_stream), relabel:
            call_with(connector.batched_from_gpu, objs, list(starts), list(ends), kvcaches=view,
                      slot_mapping=mapping, **self._store_extra(kwargs))

    def batched_to_gpu(self, memory_objs: Sequence[Any], starts: Sequence[int], ends: Sequence[int],
                       **kwargs: Any) -> None:
        connector, view = self._bind(kwargs)
        mapping = require(kwargs, "slot_mapping")
        objs = check_objects(memory_objs)
        extra, mapping = self._load_extra(kwargs, mapping, starts, ends)
        with self._stream(self.load_stream):
            call_with(connector.batched_to_gpu, objs, list(starts), list(ends), kvcaches=view,
                      slot_mapping=mapping, **extra)

    def _store_extra(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """kvgen keyword arguments for a store, from LMCache's (engine-specific)."""
        return {}

    def _load_extra(self, kwargs: Mapping[str, Any], mapping: Any, starts: Sequence[int], ends: Sequence[int]
                    ) -> tuple[dict[str, Any], Any]:
        return {}, mapping


class LayerwiseAdapter(Adapter):
    """Per-layer objects moved by generators: L + 1 yields to store, L + 2 to load."""

    LAYERWISE = True

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        raise NotImplementedError

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        raise NotImplementedError

    def batched_from_gpu(self, memory_objs: Sequence[Sequence[Any]], starts: Sequence[int],
                         ends: Sequence[int], **kwargs: Any) -> Generator[None, None, None]:
        connector, view = self._bind(kwargs)
        mapping = require(kwargs, "slot_mapping")
        sync = require(kwargs, "sync")
        self._init_buffer_allocator()
        objs = [check_objects(layer) for layer in memory_objs]
        yield from call_with(connector.batched_from_gpu, objs, list(starts), list(ends), kvcaches=view,
                             slot_mapping=mapping, sync=sync, **self._store_extra(kwargs))

    def batched_to_gpu(self, starts: Sequence[int], ends: Sequence[int], **kwargs: Any
                       ) -> Generator[None, Sequence[Any], None]:
        connector, view = self._bind(kwargs)
        mapping = require(kwargs, "slot_mapping")
        sync = require(kwargs, "sync")
        self._init_buffer_allocator()
        extra, mapping = self._load_extra(kwargs, mapping, starts, ends)
        inner = call_with(connector.batched_to_gpu, list(starts), list(ends), kvcaches=view,
                          slot_mapping=mapping, sync=sync, **extra)
        sent = yield next(inner)
        while True:
            if isinstance(sent, (list, tuple)):
                sent = check_objects(sent)
            try:
                sent = yield inner.send(sent)
            except StopIteration:
                return

    def _store_extra(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        return {}

    def _load_extra(self, kwargs: Mapping[str, Any], mapping: Any, starts: Sequence[int], ends: Sequence[int]
                    ) -> tuple[dict[str, Any], Any]:
        return {}, mapping
