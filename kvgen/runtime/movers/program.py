"""The planner's description of one connector's copy, as its generated module carries it.

`kvgen.plan.program` decides it at build time from the two layouts, and the template writes
it into the module as `PROGRAM = runtime.CopyProgram(...)`. A mover executes it: it reads
only the live extents, strides and addresses of the tensors it is handed, never the layout
facts (PagedLayout / ObjectLayout), so what a reviewer reads in PROGRAM is what runs.

This module holds data only (no torch), so the description reads the same everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Where one axis lives in a leaf tensor: (axis, tensor dim, the axes after it in that dim).
#: A fused dim (H C) gives H the place (H, 3, (C,)): H steps by the dim's stride times C.
#: A folded slot dim [B N] is the axis S.
Place = tuple[str, int, tuple[str, ...]]


@dataclass(frozen=True)
class CopyPath:
    """One way a chunk's tokens reach the cache, as the dims of one kernel call.

    Dim names: a shared axis (KV, L, H, C, a split axis's tile or place: the same entries on
    both sides); B (whole blocks by id, the object's tokens in steps of a block), N (the slots
    of those blocks, the object's tokens one by one; or, split, its tile and place, the object's
    tokens in steps of a place's extent and one by one); T (single tokens by slot, each side split by its own block
    size). `store` and `load` list the dims outermost first in the order a call walks them
    (the planner gives both the object's order, so the object is written or read front to
    back); `store_run` / `load_run` are the innermost of them that
    both layouts keep adjacent, which may merge into one memcpy run where the live strides
    are contiguous too."""

    name: str
    store: tuple[str, ...]
    load: tuple[str, ...]
    store_run: tuple[str, ...]
    load_run: tuple[str, ...]


@dataclass(frozen=True)
class CopyProgram:
    """Everything about a connector's copy that does not depend on the live tensors."""

    #: None: the compiled kernels move this connector; else why they do not (the torch path does).
    compiled: str | None
    #: Per-layer objects: each call moves one layer, an offset on the cache.
    layerwise: bool = False
    #: The cache's slots are one folded dim [B N] (S), with no block size.
    folded: bool = False
    #: A plane without slots (a per-layer scale): one path, `plane`, moved with every chunk
    #: that moves a token.
    slotless: bool = False
    #: The cache's list levels, outermost first (leaves in row-major order over them).
    cache_lists: tuple[str, ...] = ()
    cache_places: tuple[Place, ...] = ()
    object_places: tuple[Place, ...] = ()
    #: The shared axes (one dim each where their extent is above 1).
    shared: tuple[str, ...] = ()
    paths: tuple[CopyPath, ...] = ()
    #: A block slot split into two cache dims, (tile, place) (`N/8`, `N%8`): whole blocks walk
    #: them as two dims, a single token's offset in its block is split by the place's extent; ()
    #: where the slot is one dim N.
    slot_split: tuple[str, ...] = ()
    #: A cache of several planes: each plane's program, over the byte views the module makes:
    #: `_plane_objects(tensor, g, ck)` (each plane's view of the object) and
    #: `_plane_leaves(kvcaches, g)` (each plane's leaf of every layer).
    planes: tuple[CopyProgram, ...] = ()

    def path(self, name: str) -> CopyPath | None:
        return next((p for p in self.paths if p.name == name), None)


@dataclass(frozen=True)
class TransferPath:
    """One path of a layout-to-layout transfer as the dims of one kernel call, outermost first
    in the order the call walks them (the planner gives the source's, read front to back):
    `whole` for a call over every layer, `layer` for one layer's (no L). B and N: whole blocks
    and their slots, each side split by its own block size (a folded slot axis by the other's);
    T: single tokens by slot. `whole_run` / `layer_run`: the innermost dims both layouts keep
    adjacent, which may merge into the memcpy run."""

    name: str
    whole: tuple[str, ...]
    layer: tuple[str, ...]
    whole_run: tuple[str, ...]
    layer_run: tuple[str, ...]


@dataclass(frozen=True)
class TransferProgram:
    """Everything about a transfer's copy that does not depend on the live caches."""

    compiled: str | None
    src_lists: tuple[str, ...] = ()
    src_places: tuple[Place, ...] = ()
    dst_lists: tuple[str, ...] = ()
    dst_places: tuple[Place, ...] = ()
    #: The axes both caches hold (H narrowed per call to its head ranges).
    shared: tuple[str, ...] = ()
    paths: tuple[TransferPath, ...] = ()

    def path(self, name: str) -> TransferPath | None:
        return next((p for p in self.paths if p.name == name), None)
