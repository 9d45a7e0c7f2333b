"""Copy plans: how one (paged layout, memory object) pair moves KV, decided at build time.

A plan turns both sides into *canonical views* (one tensor dim per axis: fused groups
split with `unflatten`, singletons selected away; splitting a dim is always a view,
whatever the strides, so strided caches stay correct), fixes the axes that Python
containers hold with loops, and lines the object view up with the cache view:

* block path: whole blocks of the chunk move with one `index_select` / `index_copy_`
  over the B dim, the object's T dim split into (blocks, N) to match;
* token path: the remaining tokens (partial blocks, folded slot axes, arbitrary slot
  mappings) move by advanced indexing, the object permuted into the order torch gives
  the indexed result.

Everything here is string and tuple work on specs; torch is never imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from kvgen.library import Library
from kvgen.model import Dim, Spec

WHOLE = "whole"
LAYERWISE = "layerwise"

#: Name of the loop variable for each axis a Python container can hold.
LOOP_VARS = {"L": "layer", "KV": "kv"}
#: Extent expression of each axis on the runtime geometry `g`.
EXTENT = {a: f"g.{a}" for a in ("L", "KV", "H", "C", "N")}
#: Slot axes as they appear in a canonical cache view; S is a folded [B, N] axis.
SLOT = "S"


@dataclass(frozen=True)
class Loop:
    var: str
    axis: str
    extent: str


@dataclass(frozen=True)
class View:
    """A canonical view: an expression and the axis each of its dims holds."""

    expr: str
    axes: tuple[str, ...]


@dataclass(frozen=True)
class CopyPlan:
    paged: Spec
    obj: Spec
    mode: str
    loops: tuple[Loop, ...]
    #: Canonical view of the whole object tensor `o` (made once per chunk).
    object_view: View
    #: Canonical view of one cache leaf `x`, inside the loops.
    cache_view: View
    #: Object view inside the loops, before alignment (`o` with loop axes fixed), bound
    #: to `y` when loops select from it.
    object_part: View
    #: Token path: index applied to the cache view and the object in the result's order.
    token_index: str
    token_object: View
    #: Block path (None for folded slot axes): B dim of the cache view and the object
    #: view of the chunk's whole blocks, split and permuted to the cache's order.
    block_dim: int | None
    block_object: str | None
    #: Object shape, as expressions over `g` and `num_tokens`.
    shape: tuple[str, ...]

    @property
    def module(self) -> str:
        return f"{self.paged.name}__{self.obj.name}"

    @property
    def part_name(self) -> str:
        return "y" if self.object_part.expr != "o" else "o"

    @property
    def token_dim(self) -> int:
        return self.token_object.axes.index("T")

    @property
    def strategy(self) -> str:
        """One line for people: what the generated copy does."""
        loops = " x ".join(f"{lp.axis}" for lp in self.loops)
        per = f"per {loops} leaf" if loops else "one op across all layers"
        if self.block_dim is not None:
            how = f"whole blocks by index_select over B (dim {self.block_dim}), partial blocks by token gather"
        else:
            how = "token rows by index over the folded slot axis"
        return f"{per}: {how}"


def compatible(paged: Spec, obj: Spec) -> bool:
    """Same logical content (paged slots <-> object tokens), shared dtypes, and an object
    that is either whole-chunk or per layer."""
    if not paged.is_paged or obj.is_paged:
        return False
    if obj.lists not in ((), ("L",)):
        return False
    if set(paged.axes) - {"B", "N"} != set(obj.axes) - {"T"}:
        return False
    return bool(set(paged.dtypes) & set(obj.dtypes))


def mode_of(obj: Spec) -> str:
    return LAYERWISE if obj.lists else WHOLE


def canonical(base: str, dims: tuple[Dim, ...]) -> View:
    """Split fused dims and drop singletons, last dim first so earlier indices hold."""
    expr = base
    for i in range(len(dims) - 1, -1, -1):
        dim = dims[i]
        if dim.is_singleton:
            expr += f".select({i}, 0)"
        elif dim.is_fused and not dim.is_slot:
            sizes = ", ".join(EXTENT[a] for a in dim.axes)
            expr += f".unflatten({i}, ({sizes}))"
    axes: list[str] = []
    for dim in dims:
        if dim.is_slot:
            axes.append(SLOT)
        else:
            axes.extend(dim.axes)
    return View(expr, tuple(axes))


def index_suffix(axes: tuple[str, ...], fixed: dict[str, str]) -> str:
    """`[:, l]` for axes (KV, L, T, ...) with L fixed to `l`; "" when nothing is fixed."""
    parts = [fixed.get(a, ":") for a in axes]
    while parts and parts[-1] == ":":
        parts.pop()
    return f"[{', '.join(parts)}]" if parts else ""


def select(view: View, fixed: dict[str, str]) -> View:
    here = {a: v for a, v in fixed.items() if a in view.axes}
    return View(view.expr + index_suffix(view.axes, here), tuple(a for a in view.axes if a not in here))


def permute_suffix(have: tuple[str, ...], want: tuple[str, ...]) -> str:
    order = [have.index(a) for a in want]
    return "" if order == sorted(order) else f".permute({', '.join(map(str, order))})"


def indexed_order(axes: tuple[str, ...], advanced: tuple[str, ...]) -> tuple[str, ...]:
    """The dims of `x[index]` under torch's rule: adjacent advanced indices keep their
    place (as one T dim), separated ones move T to the front."""
    where = [i for i, a in enumerate(axes) if a in advanced]
    rest = [a for a in axes if a not in advanced]
    if where == list(range(where[0], where[0] + len(where))):
        return (*axes[: where[0]], "T", *axes[where[-1] + 1:])
    return ("T", *rest)


def shape_exprs(obj: Spec) -> tuple[str, ...]:
    def extent(axis: str) -> str:
        return "num_tokens" if axis == "T" else EXTENT[axis]

    return tuple("1" if d.is_singleton else " * ".join(extent(a) for a in d.axes) for d in obj.dims)


def make_plan(paged: Spec, obj: Spec) -> CopyPlan:
    if not compatible(paged, obj):
        raise ValueError(f"{paged.name} and {obj.name} do not hold the same KV content")
    mode = mode_of(obj)
    if mode == WHOLE:
        loops = tuple(Loop(LOOP_VARS[a], a, EXTENT[a]) for a in paged.lists)
    else:  # per-layer objects: the layer is the outer loop, then the other list levels
        loops = (Loop("layer", "L", EXTENT["L"]),
                 *(Loop(LOOP_VARS[a], a, EXTENT[a]) for a in paged.lists if a != "L"))
    fixed = {lp.axis: lp.var for lp in loops}

    leaf = "kvcaches" + "".join(f"[{LOOP_VARS[a]}]" for a in paged.lists)
    cache = select(canonical(f"runtime.bits({leaf})", paged.dims), fixed)
    whole_obj = canonical("runtime.bits(tensor)", obj.dims)
    part = select(View("o", whole_obj.axes), fixed)

    # The object inside the loops gets a name of its own when loops select from it.
    y = "y" if part.expr != "o" else "o"
    slot_axes = (SLOT,) if SLOT in cache.axes else ("B", "N")
    index_names = {SLOT: "ck.slots", "B": "ck.blk", "N": "ck.off"}
    token_index = index_suffix(cache.axes, {a: index_names[a] for a in slot_axes})
    result = indexed_order(cache.axes, slot_axes)
    token_object = View(y + permute_suffix(part.axes, result), result)

    block_dim = block_object = None
    if slot_axes == ("B", "N"):
        t = part.axes.index("T")
        split = (*part.axes[:t], "B", "N", *part.axes[t + 1:])
        block_dim = cache.axes.index("B")
        block_object = (f"{y}.narrow({t}, ck.block_start, ck.block_tokens)"
                        f".unflatten({t}, (-1, g.N)){permute_suffix(split, cache.axes)}")

    return CopyPlan(
        paged=paged, obj=obj, mode=mode, loops=loops, object_view=whole_obj, cache_view=cache,
        object_part=part, token_index=token_index, token_object=token_object,
        block_dim=block_dim, block_object=block_object, shape=shape_exprs(obj),
    )


def plan_library(library: Library) -> list[CopyPlan]:
    """A plan for every compatible (paged, object) pair, in a stable order."""
    return [make_plan(p, o) for p, o in product(library.paged, library.objects) if compatible(p, o)]


def format_transitions(library: Library) -> list[tuple[str, str]]:
    """(current, after store) label pairs: each object's `accepts`, and itself."""
    pairs = {(src, obj.format) for obj in library.objects if obj.format
             for src in (obj.format, *obj.accepts)}
    return sorted(pairs)
