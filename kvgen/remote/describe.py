"""What one worker tells another about its cache in a P/D handshake: a `CacheDescription`.

A description names the layout (its spec and a digest of the layout facts its addresses come
from), the extents, the dtype, every leaf tensor's base address, each axis's byte stride (or,
for a list level, its step between leaves) and the worker's TP rank and size. That is all the
reading side needs to compute the address of any element of the remote cache, so it plans
the wire transfer without seeing the tensors. It serializes to a few hundred bytes of JSON.

The strides are read from the cache once, by the layout's generated geometry reader and the
runtime's per-axis byte strides (the same facts the compiled kernels use).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, replace
from functools import cache, cached_property
from typing import Any

import torch

from kvgen import generated
from kvgen.runtime.binding import leaves
from kvgen.runtime.errors import KVLayoutError
from kvgen.runtime.layout import Geometry, PagedLayout, part_leaves
from kvgen.runtime.movers import native as native_mover

#: Bump when the fields of a description change meaning.
VERSION = 1
#: Where a cache splits H into groups of a size read from its tensors (`H/g`, `H%g`: SGLang's
#: page_unified host pool), the description names the groups' axis GROUP and a head's place in its
#: group PLACE, whatever the spec calls them; PLACE's extent is the heads of a group.
GROUP, PLACE = "H/", "H%"


@dataclass(frozen=True)
class CacheDescription:
    """One worker's cache, as the other side of a transfer sees it (frozen, JSON-serializable)."""

    spec: str
    digest: str  # of the layout facts (lists, dims, sizes, dtypes): a spec version changes it
    dtype: str
    #: L, KV, H (this rank's heads), C, S (slots) and N (block size; 0 for a folded slot axis).
    extents: tuple[tuple[str, int], ...]
    #: Leaf tensor addresses in list order, and the bytes each spans.
    leaves: tuple[int, ...]
    span: int
    #: Byte stride of each tensor axis (B, N, or S for a folded slot axis, and the others).
    strides: tuple[tuple[str, int], ...]
    #: Leaf step of each list-level axis (leaf index = sum of index * step).
    steps: tuple[tuple[str, int], ...]
    tp_rank: int
    tp_size: int
    num_kv_heads: int  # the model's KV heads over every rank (1 for MLA)
    device_id: int = 0
    version: int = VERSION
    #: A cache of several parts (format 2): each part as a description of its own leaves,
    #: extents (its C), dtype and strides, named by `part`; the whole's fields above are the
    #: first part's, its leaves every leaf in list order. Empty for a single-part cache.
    parts: tuple[CacheDescription, ...] = ()
    part: str = ""

    # -- reading -------------------------------------------------------------------------

    def extent(self, axis: str) -> int:
        return self._axes[0].get(axis, 1)

    def stride(self, axis: str) -> int:
        """Byte stride of a tensor axis (0 where the axis is not one)."""
        return self._axes[1].get(axis, 0)

    def step(self, axis: str) -> int:
        """Leaf step of a list-level axis (0 where the axis is not one)."""
        return self._axes[2].get(axis, 0)

    @cached_property
    def _axes(self) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        # Planning asks these hundreds of times per plan; the fields stay the tuples the wire form has.
        return dict(self.extents), dict(self.strides), dict(self.steps)

    @property
    def block(self) -> int | None:
        """Slots per block, None for a folded slot axis."""
        return self.extent("N") or None

    @property
    def itemsize(self) -> int:
        return getattr(torch, self.dtype).itemsize

    @property
    def mla(self) -> bool:
        """Whether the layout holds one latent without heads (every TP rank keeps it whole)."""
        return "H" not in self._axes[1] and "H" not in self._axes[2] and not self.grouped

    @property
    def grouped(self) -> bool:
        """Whether the cache holds its heads in groups (GROUP and PLACE instead of H)."""
        return PLACE in self._axes[1]

    @property
    def group(self) -> int:
        """Heads per group (1 where the cache does not group its heads)."""
        return self.extent(PLACE)

    @property
    def fingerprint(self) -> str:
        """What a stored object needs to match to be read back here: the spec, its digest, the
        dtype, the extents that shape a token's KV and the TP split (no addresses, block counts)."""
        key = [self.spec, self.digest, self.dtype, self.extent("L"), self.extent("KV"), self.extent("H"),
               self.extent("C"), self.tp_size, self.num_kv_heads, self.version]
        if self.parts:
            key.append([(p.part, p.fingerprint) for p in self.parts])
        if self.grouped:  # the heads of a group shape where each head lies
            key.append([PLACE, self.group])
        return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]

    def regions(self) -> list[tuple[int, int, int]]:
        """(address, bytes, device id) of every leaf (of every part): what a transport registers."""
        if self.parts:
            return [r for p in self.parts for r in p.regions()]
        return [(a, self.span, self.device_id) for a in self.leaves]

    # -- the wire form -------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        return json.dumps(self._wire(), separators=(",", ":")).encode()

    def _wire(self) -> dict[str, Any]:
        """The fields, those of a cache of several parts only where it is one (a single-part
        description's wire form is the same as before parts were described)."""
        raw = {k: v for k, v in asdict(self).items() if k not in ("parts", "part")}
        if self.parts:
            raw["parts"] = [p._wire() for p in self.parts]
        if self.part:
            raw["part"] = self.part
        return raw

    @classmethod
    def _from_wire(cls, raw: dict[str, Any]) -> CacheDescription:
        raw = {**raw, **{k: tuple(tuple(p) for p in raw[k]) for k in ("extents", "strides", "steps")},
               "leaves": tuple(raw["leaves"]), "parts": tuple(cls._from_wire(p) for p in raw.get("parts", ()))}
        return cls(**raw)

    @classmethod
    def from_bytes(cls, data: bytes) -> CacheDescription:
        try:
            found = cls._from_wire(json.loads(data))
        except (ValueError, TypeError, KeyError, AttributeError) as why:
            raise KVLayoutError(f"not a kvgen cache description: {why} (got {data[:80]!r})") from why
        if found.version != VERSION:
            raise KVLayoutError(f"cache description version {found.version}, this kvgen reads version {VERSION}")
        return found

    def __str__(self) -> str:
        ext = " ".join(f"{a}={n}" for a, n in self.extents)
        name = f"{self.spec}.{self.part}" if self.part else self.spec
        each = [f"{p.part} {p.dtype} C={p.extent('C')}" for p in self.parts]
        parts = f" parts {', '.join(each)}" if each else ""
        return (f"{name}@{self.digest} {self.dtype} {ext}{parts} tp {self.tp_rank}/{self.tp_size} "
                f"of {self.num_kv_heads} KV heads")


@cache
def _connector(name: str) -> Any:
    """A generated connector class of the paged layout named `name` (a spec name or alias)."""
    spec = generated.resolve(name)
    obj = next((o for layout, o in generated.CONNECTORS if layout == spec), None)
    if obj is None:
        raise KVLayoutError(f"{spec} is not a paged layout with generated connectors; a description needs one")
    return generated.get(spec, obj)


def layout_of(name: str) -> tuple[PagedLayout, Any]:
    """The paged layout named `name` (a spec name or alias) and its generated geometry reader."""
    cls = _connector(name)
    return cls.layout, cls.read_geometry


def digest(layout: PagedLayout) -> str:
    """A digest of the layout facts element addresses come from."""
    facts = [layout.name, layout.lists, layout.dims, layout.sizes, layout.dtypes, layout.parts]
    return hashlib.sha256(repr(facts).encode()).hexdigest()[:16]


def empty(layout: str, ext: dict[str, int], dtype: torch.dtype) -> Any:
    """An uninitialized cache of `layout` with extents `ext` (L, KV, H, C, and B and N, or S for
    a folded slot axis; for a layout in head groups also PLACE, the heads of a group, which
    divides H), as the engine would hand it over."""
    paged, _ = layout_of(layout)
    if paged.head_split is not None and (ext.get(PLACE, 0) <= 0 or ext["H"] % ext[PLACE]):
        raise KVLayoutError(f"{paged.name} holds its heads in groups: its extents need {PLACE!r}, the heads of a "
                            f"group, dividing H={ext['H']} (got {ext.get(PLACE)})")
    sizes = {**ext, **_group_extents(paged, ext)}
    shape = [ext["S"] if dim == ("B", "N") else math.prod(sizes[a] for a in dim) for dim in paged.dims]

    def level(k: int) -> Any:
        if k == len(paged.lists):
            return torch.empty(shape, dtype=dtype)
        return [level(k + 1) for _ in range(ext[paged.lists[k]])]

    return level(0)


def _span(t: torch.Tensor) -> int:
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1) * t.element_size()


def _check_ranks(tp_rank: int, tp_size: int, device_id: int) -> None:
    for what, value in (("tp_size", tp_size), ("tp_rank", tp_rank), ("device_id", device_id)):
        if not isinstance(value, int) or isinstance(value, bool) or value < (1 if what == "tp_size" else 0):
            raise KVLayoutError(f"{what} must be a {'positive' if what == 'tp_size' else 'non-negative'} "
                                f"integer, got {value!r}")
    if tp_rank >= tp_size:
        raise KVLayoutError(f"tp_rank {tp_rank} is not one of the {tp_size} ranks (0..{tp_size - 1})")


def _list_steps(lists: tuple[str, ...], ext: dict[str, int]) -> dict[str, int]:
    """Leaves per step of each list level (the innermost level steps by one leaf)."""
    steps, step = {}, 1
    for a in reversed(lists):
        steps[a] = step
        step *= ext[a]
    return steps


def describe(caches: Any, layout: str, *, tp_rank: int, tp_size: int, device_id: int = 0,
             num_kv_heads: int | None = None) -> CacheDescription:
    """Describe `caches` (as the engine hands them over) of `layout` for TP rank `tp_rank` of
    `tp_size`. `num_kv_heads`: the model's KV heads over all ranks; by default this rank's
    heads times tp_size (pass it when heads are replicated, tp_size > num_kv_heads).
    KVLayoutError when the caches do not match the layout."""
    cls = _connector(layout)
    paged, read_geometry = cls.layout, cls.read_geometry
    places = cls.program.cache_places  # where each axis lives, as the planner placed it
    _check_ranks(tp_rank, tp_size, device_id)
    if paged.parts:
        return _described_parts(cls, caches, (tp_rank, tp_size, device_id), num_kv_heads)
    g: Geometry = read_geometry(caches)
    mla = not paged.has("H")
    heads = 1 if mla else (num_kv_heads if num_kv_heads is not None else g.H * tp_size)
    return _described_tree(paged, caches, g, places, (tp_rank, tp_size, device_id, heads))


def _described_tree(paged: PagedLayout, caches: Any, g: Geometry, places: tuple[Any, ...],
                    ranks: tuple[int, int, int, int]) -> CacheDescription:
    """A cache of one tree of leaves alike in strides: each axis's byte stride at its place and
    each list level's step; where it holds its heads in groups, H as GROUP and PLACE."""
    tensors = leaves(caches)
    first = tensors[0]
    if any(t.stride() != first.stride() for t in tensors[1:]):
        raise KVLayoutError(f"{paged.name}: every cache tensor must have the same strides to be described")
    split = paged.head_split
    ext = {**g.extents(), **({split[0]: g.H // g.head_group} if split else {})}
    strides = native_mover.strides(places, first, ext)
    extents = [("L", g.L), ("KV", g.KV), ("H", g.H), ("C", g.C), ("S", g.S), ("N", g.N or 0)]
    if split:
        strides[GROUP], strides[PLACE] = strides.pop(split[0]), strides.pop(split[1])
        extents.append((PLACE, g.head_group))
    tp_rank, tp_size, device_id, heads = ranks
    return CacheDescription(paged.name, digest(paged), str(first.dtype).removeprefix("torch."), tuple(extents),
                            tuple(t.data_ptr() for t in tensors), _span(first), tuple(sorted(strides.items())),
                            tuple(sorted(_list_steps(paged.lists, ext).items())), tp_rank, tp_size, heads,
                            device_id)


#: The axes a part's dims may hold for its runs to be planned: whole axes, none split or tiled
#: (but H in groups of a size read from the tensors, PagedLayout.head_split).
PLANNABLE = frozenset({"S", "B", "N", "H", "KV", "C"})


def _group_extents(paged: PagedLayout, ext: dict[str, int]) -> dict[str, int]:
    """The extents of a grouped cache's tile and place, from H and the description's PLACE."""
    split = paged.head_split
    if split is None:
        return {}
    return {split[0]: ext["H"] // ext[PLACE], split[1]: ext[PLACE]}


def _described_groups(cls: Any, caches: Any, g: Geometry, split: tuple[str, str],
                      ranks: tuple[int, int, int, int]) -> CacheDescription:
    """describe() of a one-tree cache in head groups ([B, H/g, L, KV, N, H%g, C], `split` its
    head_split): each axis at the dim that holds it (its plane program reaches L as layer slices)."""
    paged = cls.layout
    tile, place = split
    dims = paged.parts[0][1]
    odd = {a for d in dims for a in d} - PLANNABLE - {"L", tile, place}
    if odd:
        raise KVLayoutError(f"{paged.name}: its tree splits or tiles axes ({', '.join(sorted(odd))}) over its "
                            "dims; remote transfers plan dims that each hold whole axes or heads in groups")
    places = tuple((a, i, d[j + 1:]) for i, d in enumerate(dims) for j, a in enumerate(d))
    return _described_tree(paged, caches, g, places, ranks)


def _described_parts(cls: Any, caches: Any, ranks: tuple[int, int, int], num_kv_heads: int | None) -> CacheDescription:
    """describe() of a cache of several parts: each part a description of its own leaves, the
    whole the first part's with every leaf. KVLayoutError naming the part that cannot be planned."""
    paged = cls.layout
    g: Geometry = cls.read_geometry(caches)
    if len(g.planes) != len(paged.parts) or any(p.values is None for p in g.planes):
        raise KVLayoutError(f"{paged.name}: its parts hold typed fields ({', '.join(p.name for p in g.planes)}); "
                            "remote transfers plan parts of whole values, not fields inside a part")
    heads = num_kv_heads if num_kv_heads is not None else g.H * ranks[1]
    split = paged.head_split
    if len(paged.parts) == 1 and split is not None:
        return _described_groups(cls, caches, g, split, (*ranks, heads))
    parts = tuple(_described_part(cls, caches, g, k, (*ranks, heads)) for k in range(len(paged.parts)))
    return replace(parts[0], leaves=tuple(t.data_ptr() for t in leaves(caches)), parts=parts, part="")


def _placed_leaf(t: torch.Tensor, dims: Any, places: Any, what: str) -> torch.Tensor:
    """A part's leaf with its dims as the part's places number them: a singleton dim holds no
    place and drops out, but for the last (where a part's C of one value lives)."""
    view = t[tuple(0 if d == () and i < len(dims) - 1 else slice(None) for i, d in enumerate(dims))]
    if max((p[1] for p in places), default=-1) >= view.dim():
        raise KVLayoutError(f"{what}: its places {[p[:2] for p in places]} do not fit its {t.dim()} dims")
    return view


def _described_part(cls: Any, caches: Any, g: Geometry, k: int, ranks: tuple[int, int, int, int]) -> CacheDescription:
    """Part k of a cache of several parts, described as a cache of its own leaves."""
    paged, program = cls.layout, cls.program.planes[k]
    name = paged.parts[k][0]
    axes = {a for a, _, _ in program.cache_places}
    what = f"part {name}" if name else "its tree"
    if axes - PLANNABLE:
        raise KVLayoutError(f"{paged.name}: {what} splits or tiles axes ({', '.join(sorted(axes - PLANNABLE))}) "
                            "over its dims; remote transfers plan parts whose dims each hold whole axes")
    if not axes & {"S", "B", "N"}:
        raise KVLayoutError(f"{paged.name}: {what} has no token axis (one value per layer); remote transfers "
                            "move parts held per token")
    tensors = part_leaves(caches, paged.lists, k)
    first = tensors[0]
    if any(t.stride() != first.stride() for t in tensors[1:]):
        raise KVLayoutError(f"{paged.name}: every tensor of part {name} must have the same strides to be described")
    placed = _placed_leaf(first, paged.parts[k][1], program.cache_places, f"{paged.name}: part {name}")
    ext = {**g.extents(), "C": g.planes[k].values, "H": g.H if "H" in axes else 1, "KV": g.KV if "KV" in axes else 1}
    lists = tuple(a for a in paged.lists if a != "P")
    tp_rank, tp_size, device_id, heads = ranks
    extents = (("L", g.L), ("KV", ext["KV"]), ("H", ext["H"]), ("C", ext["C"]), ("S", g.S), ("N", g.N or 0))
    return CacheDescription(paged.name, digest(paged), str(first.dtype).removeprefix("torch."), extents,
                            tuple(t.data_ptr() for t in tensors), _span(first),
                            tuple(sorted(native_mover.strides(program.cache_places, placed, ext).items())),
                            tuple(sorted(_list_steps(lists, ext).items())), tp_rank, tp_size,
                            heads if "H" in axes else 1, device_id, part=name)


@cache
def _digest_of(spec: str) -> str:
    """digest() of this side's layout named `spec` (the generated layouts do not change in a process)."""
    return digest(layout_of(spec)[0])


def check_pair(src: CacheDescription, dst: CacheDescription) -> None:
    """Refuse two descriptions whose content cannot move one onto the other, naming both; and a
    description whose digest differs from this side's spec of the same name (another version)."""
    for d in (src, dst):
        here = _digest_of(d.spec)
        if here != d.digest:
            raise KVLayoutError(f"{d.spec}: the description's layout digest {d.digest} is not this side's "
                                f"{here} (another version of the spec): {d}")
    if src.parts or dst.parts:
        names = [p.part for p in src.parts], [p.part for p in dst.parts]
        if names[0] != names[1]:
            raise KVLayoutError(f"the two caches cannot exchange KV (parts {names[0]} vs {names[1]}): source {src}; "
                                f"destination {dst}")
        for a, b in zip(src.parts, dst.parts, strict=True):
            check_pair(a, b)
        return
    problems = [f"{what} {a} vs {b}" for what, a, b in (
        ("dtype", src.dtype, dst.dtype), ("head size C", src.extent("C"), dst.extent("C")),
        ("layers L", src.extent("L"), dst.extent("L")), ("KV planes", src.extent("KV"), dst.extent("KV")),
        ("MLA", src.mla, dst.mla), ("num_kv_heads", src.num_kv_heads, dst.num_kv_heads)) if a != b]
    if src.grouped and dst.grouped and src.group != dst.group:  # one head would be two places apart
        problems.append(f"heads per group {src.group} vs {dst.group}")
    if problems:
        raise KVLayoutError(f"the two caches cannot exchange KV ({'; '.join(problems)}): source {src}; "
                            f"destination {dst}")


__all__ = ["GROUP", "PLACE", "CacheDescription", "check_pair", "describe", "digest", "empty", "layout_of"]
