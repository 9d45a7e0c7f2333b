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
from dataclasses import asdict, dataclass
from functools import cache, cached_property
from typing import Any

import torch

from kvgen import generated
from kvgen.runtime.binding import leaves
from kvgen.runtime.errors import KVLayoutError
from kvgen.runtime.layout import Geometry, PagedLayout
from kvgen.runtime.movers import native as native_mover

#: Bump when the fields of a description change meaning.
VERSION = 1


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
        return "H" not in self._axes[1] and "H" not in self._axes[2]

    @property
    def fingerprint(self) -> str:
        """What a stored object needs to match to be read back here: the spec, its digest, the
        dtype, the extents that shape a token's KV and the TP split (no addresses, block counts)."""
        key = [self.spec, self.digest, self.dtype, self.extent("L"), self.extent("KV"), self.extent("H"),
               self.extent("C"), self.tp_size, self.num_kv_heads, self.version]
        return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]

    def regions(self) -> list[tuple[int, int, int]]:
        """(address, bytes, device id) of every leaf: what a transport registers."""
        return [(a, self.span, self.device_id) for a in self.leaves]

    # -- the wire form -------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> CacheDescription:
        try:
            raw = json.loads(data)
            raw = {**raw, **{k: tuple(tuple(p) for p in raw[k]) for k in ("extents", "strides", "steps")},
                   "leaves": tuple(raw["leaves"])}
            found = cls(**raw)
        except (ValueError, TypeError, KeyError) as why:
            raise KVLayoutError(f"not a kvgen cache description: {why} (got {data[:80]!r})") from why
        if found.version != VERSION:
            raise KVLayoutError(f"cache description version {found.version}, this kvgen reads version {VERSION}")
        return found

    def __str__(self) -> str:
        ext = " ".join(f"{a}={n}" for a, n in self.extents)
        return (f"{self.spec}@{self.digest} {self.dtype} {ext} tp {self.tp_rank}/{self.tp_size} "
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
    a folded slot axis), as the engine would hand it over."""
    paged, _ = layout_of(layout)
    shape = [ext["S"] if dim == ("B", "N") else math.prod(ext[a] for a in dim) for dim in paged.dims]

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


def _list_steps(paged: PagedLayout, ext: dict[str, int]) -> dict[str, int]:
    """Leaves per step of each list level (the innermost level steps by one leaf)."""
    steps, step = {}, 1
    for a in reversed(paged.lists):
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
    if paged.parts:
        raise KVLayoutError(f"{paged.name} has several parts; remote transfers move single-part layouts")
    _check_ranks(tp_rank, tp_size, device_id)
    g: Geometry = read_geometry(caches)
    tensors = leaves(caches)
    first = tensors[0]
    if any(t.stride() != first.stride() for t in tensors[1:]):
        raise KVLayoutError(f"{paged.name}: every cache tensor must have the same strides to be described")
    ext = g.extents()
    strides = native_mover.strides(places, first, ext)
    mla = not paged.has("H")
    heads = 1 if mla else (num_kv_heads if num_kv_heads is not None else g.H * tp_size)
    extents = (("L", g.L), ("KV", g.KV), ("H", g.H), ("C", g.C), ("S", g.S), ("N", g.N or 0))
    return CacheDescription(paged.name, digest(paged), str(g.dtype).removeprefix("torch."), extents,
                            tuple(t.data_ptr() for t in tensors), _span(first),
                            tuple(sorted(strides.items())), tuple(sorted(_list_steps(paged, ext).items())),
                            tp_rank, tp_size, heads, device_id)


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
    problems = [f"{what} {a} vs {b}" for what, a, b in (
        ("dtype", src.dtype, dst.dtype), ("head size C", src.extent("C"), dst.extent("C")),
        ("layers L", src.extent("L"), dst.extent("L")), ("KV planes", src.extent("KV"), dst.extent("KV")),
        ("MLA", src.mla, dst.mla), ("num_kv_heads", src.num_kv_heads, dst.num_kv_heads)) if a != b]
    if problems:
        raise KVLayoutError(f"the two caches cannot exchange KV ({'; '.join(problems)}): source {src}; "
                            f"destination {dst}")


__all__ = ["CacheDescription", "check_pair", "describe", "digest", "empty", "layout_of"]
