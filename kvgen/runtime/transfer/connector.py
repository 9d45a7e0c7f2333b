"""What every generated layout-to-layout transfer shares: binding both caches, checking every
input before the first write, the call's slot pairs, devices and the layer loop.

A generated transfer module subclasses `TransferBase` and supplies only the copies themselves
(`_copy` for every layer at once, `_copy_layer` for one layer) and the two geometry readers.

    T = transfer("vllm_flash_attn_hnd", "vllm_flash_attn_nhd")
    T().copy(src_caches, src_slots, dst_caches, dst_slots, heads=tp.HeadRanges((0, 8), (0, 8)))
    for _ in T().copy_layers(src_caches, src_slots, dst_caches, dst_slots): ...  # one layer per step

Token i moves from source slot src_slots[i] to destination slot dst_slots[i] (slots are token
addresses: block s // N, offset s % N on each side, whatever its block size); a slot < 0 on
either side skips the token. Head h of `heads.src_heads` goes to the matching head of
`heads.dst_heads` (a `kvgen.tp.HeadRanges`; a TP route's `.heads`).
A transfer may be shared by threads: each call's binding, frozen cache trees and pairs are its
own and immutable; the tables of bindings and streams are filled under a lock.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from kvgen.runtime import calls, native
from kvgen.runtime.aliasing import CacheMemory, share_elements
from kvgen.runtime.binding import (
    Binding,
    Snapshot,
    check_layer_leaves,
    layer_leaves,
    leaf_names,
    leaves,
    new_binding,
    snapshot,
)
from kvgen.runtime.connector import max_word
from kvgen.runtime.devices import Backend, backend_for, on_stream
from kvgen.runtime.errors import KVLayoutError
from kvgen.runtime.layout import Geometry, PagedLayout, describe
from kvgen.runtime.movers.program import TransferProgram
from kvgen.runtime.slots import signed_integers
from kvgen.runtime.transfer import compiled
from kvgen.runtime.transfer.pairs import Pairs, Scratch, pair_slots
from kvgen.runtime.words import Words, words
from kvgen.tp import HeadRanges

#: What a call with another keyword is told (the separate src_heads= / dst_heads= a transfer once took).
HEADS_PROTOCOL = ("The head ranges are one argument: heads=kvgen.tp.HeadRanges(src_heads=(start, stop), "
                  "dst_heads=(start, stop)), or a kvgen.tp.Route's .heads")
#: Bindings kept per side (a few caches in turn).
_BINDINGS_KEPT = 8


#: One side of a transfer as the caller gives it: (caches, slots).
Given = tuple[Any, Any]


@dataclass(frozen=True)
class TransferCall:
    """What one transfer works with, fixed when it starts."""

    src: Any  # the frozen source tree
    dst: Any
    gs: Geometry
    gd: Geometry
    pairs: Pairs
    words: Words
    #: The bindings of both sides (what a layerwise copy checks again between two steps).
    bindings: tuple[Binding, Binding]


class TransferBase:
    src_layout: ClassVar[PagedLayout]
    dst_layout: ClassVar[PagedLayout]
    #: The compiled kernel's planned description of this pair (kvgen.plan.program).
    program: ClassVar[TransferProgram]
    strategy: ClassVar[str]
    #: Whether the generated copies may move C as wider integer words (both sides end in C).
    widen: ClassVar[bool] = False
    read_src_geometry: ClassVar[Callable[[Any], Geometry]]
    read_dst_geometry: ClassVar[Callable[[Any], Geometry]]

    def __init__(self, *, backend: Backend | None = None, copy_backend: str | None = None):
        """`backend`: a device backend to use instead of each device's own (tests pass a fake).
        `copy_backend`: "native" (the compiled CPU kernel, refused where it cannot run), "torch"
        (the generated torch copies), or None: the kernel where it runs, else torch."""
        if copy_backend is not None and copy_backend not in compiled.BACKENDS:
            raise KVLayoutError(f"copy_backend must be one of {', '.join(map(repr, compiled.BACKENDS))} or "
                                f"None (auto), got {copy_backend!r}")
        if copy_backend == "native" and native.unavailable():
            raise KVLayoutError(f"copy_backend='native' cannot run here: {native.unavailable()}")
        self.copy_backend = copy_backend
        self._backend = backend
        self._lock = threading.Lock()
        self._bindings: dict[tuple[str, Any], Binding] = {}
        self._apart: set[tuple[Any, Any]] = set()
        self._streams: dict[torch.device, Any] = {}
        self._local = threading.local()  # per-thread scratch of whole copies

    @property
    def name(self) -> str:
        return f"{self.src_layout.name} -> {self.dst_layout.name}"

    # -- the two forms ---------------------------------------------------------------------

    @calls.keywords_named(HEADS_PROTOCOL)
    def copy(self, src_caches: Any, src_slots: Any, dst_caches: Any, dst_slots: Any, *,
             heads: HeadRanges | None = None) -> None:
        """Copy every layer of the given slots; returns once the copy is done."""
        scratch = self._local.__dict__.setdefault("scratch", Scratch())  # a whole copy ends before the next
        call = self._begin((src_caches, src_slots), (dst_caches, dst_slots), heads, scratch)
        if call.pairs.moved:
            description = self._compiled(call, layerwise=False)
            if description is not None:
                compiled.move(description, None)
            else:
                self._copy(call)
        for device in dict.fromkeys((call.gs.device, call.gd.device)):
            backend = self._backend_for(device)
            backend.synchronize(backend.current_stream())

    @calls.keywords_named(HEADS_PROTOCOL)
    def copy_layers(self, src_caches: Any, src_slots: Any, dst_caches: Any, dst_slots: Any, *,
                    heads: HeadRanges | None = None, sync: bool = True) -> Generator[None, None, None]:
        """Copy layer by layer: a generator that checks every input at its first next(), then
        yields once after each layer's copy is queued and once after the final wait (L + 1
        yields), so a caller can overlap the transfer with the forward pass. `sync=True`
        synchronizes at the end; False makes the current stream wait for the copies."""
        return self._layers((src_caches, src_slots), (dst_caches, dst_slots), heads, sync)

    def _layers(self, src: Given, dst: Given, heads: HeadRanges | None, sync: bool) -> Generator[None, None, None]:
        # A generator's own scratch: two generators stepped in turn may run on streams at once.
        call = self._begin(src, dst, heads, Scratch())
        device = call.gs.device if call.gs.device.type != "cpu" else call.gd.device
        backend = self._backend_for(device)
        stream = self._stream(device, backend)
        sides = [(leaves(tree), layer_leaves(tree, layout.lists, call.gs.L), binding) for tree, layout, binding
                 in ((call.src, self.src_layout, call.bindings[0]), (call.dst, self.dst_layout, call.bindings[1]))]
        description = self._compiled(call, layerwise=True) if call.pairs.moved else None
        for layer in range(call.gs.L):
            for tensors, per_layer, binding in sides if layer else ():  # the caller ran since the last step
                check_layer_leaves(tensors, per_layer[layer], binding, f"{self.name}: layer {layer}")
            if description is not None:
                compiled.move(description, layer)
            elif call.pairs.moved:
                with on_stream(backend, stream):
                    self._copy_layer(layer, call)
            yield
        if sync:
            backend.synchronize(stream)
        else:
            backend.wait_stream(backend.current_stream(), stream)
        yield

    def _compiled(self, call: TransferCall, *, layerwise: bool) -> compiled.TransferDescription | None:
        """The compiled kernel's description of this call, or None for the torch copies (a
        device other than the CPU, a cache the kernel cannot describe, copy_backend='torch')."""
        if self.copy_backend == "torch":
            return None
        if self.copy_backend is None and (native.unavailable() or "cpu" != call.gs.device.type
                                          or "cpu" != call.gd.device.type):
            return None  # not a fallback: the kernel never moves these
        try:
            return compiled.describe(self.program, call, layerwise)
        except native.Unsupported as why:
            if self.copy_backend == "native":
                raise KVLayoutError(f"{self.name}: copy_backend='native' cannot move these caches: {why}") from None
            native.stats["fallbacks"] += 1
            return None

    # -- checks, all before the first write ---------------------------------------------------

    def check(self, src_caches: Any, dst_caches: Any) -> tuple[Geometry, Geometry]:
        """Check both caches against the layouts and each other; their geometries."""
        (sb, _), (db, _) = self._bind("src", src_caches), self._bind("dst", dst_caches)
        self._check_pair(sb, db)
        return sb.geometry, db.geometry

    def _begin(self, src: Given, dst: Given, heads: HeadRanges | None, scratch: Scratch) -> TransferCall:
        (src_caches, src_slots), (dst_caches, dst_slots) = src, dst
        sb, src_tree = self._bind("src", src_caches)
        db, dst_tree = self._bind("dst", dst_caches)
        self._check_pair(sb, db)
        gs, gd = sb.geometry, db.geometry
        moved = self._heads(heads, gs, gd)
        s, d = _mapping("src_slots", src_slots, gs.device), _mapping("dst_slots", dst_slots, gd.device)
        if s.shape[0] != d.shape[0]:
            raise KVLayoutError(f"{self.name}: src_slots and dst_slots need one slot each per token, got "
                                f"{s.shape[0]} and {d.shape[0]} slots")
        try:
            pairs = pair_slots(s, d, gs, gd, moved)
        except KVLayoutError as error:
            raise KVLayoutError(f"{self.name}: {error}") from None
        size = torch.empty(0, dtype=gs.dtype).element_size()
        width = min(sb.width, db.width) if self.widen else size
        return TransferCall(src_tree, dst_tree, gs, gd, replace(pairs, scratch=scratch), words(width, size, gs.C),
                            (sb, db))

    def _bind(self, side: str, kvcaches: Any) -> tuple[Binding, Any]:
        """(binding, frozen tree) of one side's cache; any changed leaf makes a new binding."""
        tree, key = snapshot(kvcaches)
        binding = self._bindings.get((side, key)) if key is not None else None
        if binding is None:
            binding = self._new_binding(side, kvcaches, tree, key)
        return binding, tree

    def _new_binding(self, side: str, kvcaches: Any, tree: Any, key: Any) -> Binding:
        layout = self.src_layout if side == "src" else self.dst_layout
        read = self.read_src_geometry if side == "src" else self.read_dst_geometry
        try:
            geometry = read(kvcaches)
        except KVLayoutError as error:
            raise KVLayoutError(f"{side}_caches: {error}") from None
        if key is None:
            raise KVLayoutError(f"{side}_caches: {layout.name} caches are lists or tuples of tensors, got "
                                f"{describe(kvcaches)}")
        limit = max_word(geometry.device) if self.widen else None
        binding = new_binding(Snapshot(kvcaches, tree, key), geometry, tuple(leaf_names(tree, f"{side}_caches")),
                              word_limit=limit, owner=layout.name, argument=f"{side}_caches")
        with self._lock:
            mine = [k for k in self._bindings if k[0] == side]
            if len(mine) >= _BINDINGS_KEPT:
                self._bindings.pop(mine[0])
            self._bindings[(side, key)] = binding
        return binding

    def _check_pair(self, sb: Binding, db: Binding) -> None:
        gs, gd = sb.geometry, db.geometry
        for axis in ("L", "KV", "C"):
            a, b = getattr(gs, axis), getattr(gd, axis)
            if a != b:
                raise KVLayoutError(f"{self.name}: the caches must agree on {axis}, but src_caches "
                                    f"{self.src_layout.arrow(gs.extents())} has {axis}={a} and dst_caches "
                                    f"{self.dst_layout.arrow(gd.extents())} has {axis}={b}")
        if gs.dtype != gd.dtype:
            raise KVLayoutError(f"{self.name}: src_caches hold {str(gs.dtype).removeprefix('torch.')} and dst_caches "
                                f"{str(gd.dtype).removeprefix('torch.')}; a transfer copies bits, so the dtypes "
                                "must match")
        if (sb.key, db.key) not in self._apart:
            _check_apart(sb.memory, sb.names, db.memory, db.names)
            with self._lock:
                if len(self._apart) >= 4 * _BINDINGS_KEPT:
                    self._apart.clear()
                self._apart.add((sb.key, db.key))

    def _heads(self, heads: HeadRanges | None, gs: Geometry, gd: Geometry) -> tuple[int, int, int]:
        """(first source head, first destination head, count); both ranges default to every head."""
        if heads is None:
            heads = HeadRanges()
        elif not isinstance(heads, HeadRanges):
            raise KVLayoutError(f"heads must be a kvgen.tp.HeadRanges(src_heads, dst_heads) (a kvgen.tp.Route's "
                                f".heads) or None (every head of both sides), got {describe(heads)}")
        s = _range("src_heads", heads.src_heads, gs.H, self.src_layout)
        d = _range("dst_heads", heads.dst_heads, gd.H, self.dst_layout)
        if s[1] - s[0] != d[1] - d[0]:
            raise KVLayoutError(f"{self.name}: src_heads {s} is {s[1] - s[0]} heads but dst_heads {d} is "
                                f"{d[1] - d[0]}; give both ranges with the same number of heads (kvgen.tp.plan "
                                "gives them for a TP resharding)")
        self._check_head_groups(s, d, gs, gd)
        return s[0], d[0], s[1] - s[0]

    def _check_head_groups(self, s: tuple[int, int], d: tuple[int, int], gs: Geometry, gd: Geometry) -> None:
        """A cache whose H is split into groups of a size read from its tensor (`H%g`) moves whole
        groups: each range starts and ends on a group's edge, and two such sides group alike."""
        groups = {side: g.head_group for side, g in (("src", gs), ("dst", gd)) if g.splits}
        if len(set(groups.values())) > 1:
            raise KVLayoutError(f"{self.name}: src_caches hold heads in groups of {groups['src']} and dst_caches in "
                                f"groups of {groups['dst']}; a transfer moves between caches that group heads alike")
        for side, (start, stop) in (("src", s), ("dst", d)):
            n = groups.get(side, 1)
            if start % n or stop % n:
                raise KVLayoutError(f"{self.name}: {side}_heads ({start}, {stop}) cuts a group of {n} heads of "
                                    f"{side}_caches; give a range of whole groups")

    # -- devices -------------------------------------------------------------------------------

    def _backend_for(self, device: torch.device) -> Backend:
        return self._backend if self._backend is not None else backend_for(device)

    def _stream(self, device: torch.device, backend: Backend) -> Any:
        with self._lock:
            if device not in self._streams:
                self._streams[device] = backend.new_stream()
            return self._streams[device]

    # -- the generated copies ---------------------------------------------------------------------

    def _copy(self, call: TransferCall) -> None:
        """Every layer of `call` (generated: the torch copy, the transfer's readable reference)."""
        raise NotImplementedError

    def _copy_layer(self, layer: int, call: TransferCall) -> None:
        """Layer `layer` of `call` (generated)."""
        raise NotImplementedError


def _check_apart(src: CacheMemory, src_names: tuple[str, ...], dst: CacheMemory, dst_names: tuple[str, ...]) -> None:
    """A destination tensor sharing an element with a source tensor would overwrite what the
    transfer still has to read."""
    for k, e in enumerate(dst.leaves):
        for j in src.leaves_meeting(e.device, e.lo, e.hi):
            if share_elements(src.leaves[j], e):
                raise KVLayoutError(f"{dst_names[k]} shares memory with {src_names[j]}: a transfer would overwrite "
                                    "what it reads; pass two separate caches")


def _range(what: str, value: Any, extent: int, layout: PagedLayout) -> tuple[int, int]:
    if value is None:
        return (0, extent)
    try:
        start, stop = (operator.index(v) for v in value)
        if isinstance(value, (str, bytes)) or any(isinstance(v, bool) for v in value):
            raise TypeError
    except (TypeError, ValueError):
        raise KVLayoutError(f"{what} must be a (start, stop) pair of integers, got {value!r}") from None
    if not 0 <= start < stop <= extent:
        has = f"{extent} heads" if layout.has("H") else "no head axis (one latent: use (0, 1) or leave it out)"
        raise KVLayoutError(f"{what} ({start}, {stop}) is not a non-empty range of the {layout.name} cache's heads: "
                            f"it has {has}")
    return (start, stop)


def _mapping(what: str, value: Any, device: torch.device) -> torch.Tensor:
    """A slot tensor: 1-D, signed integers, on the CPU or the cache's device."""
    if not isinstance(value, torch.Tensor) or value.dim() != 1:
        raise KVLayoutError(f"{what} must be a 1-D integer tensor (one slot per token, < 0 to skip), got "
                            f"{describe(value)}")
    dtype = value.dtype
    if not signed_integers(dtype):
        raise KVLayoutError(f"{what} must hold signed integers (int64, int32, ...), got {describe(value)}")
    if value.device.type != "cpu" and value.device != device:
        raise KVLayoutError(f"{what} must be on the cpu or on {device} (its cache's device), got {describe(value)} "
                            f"on {value.device}")
    return value
