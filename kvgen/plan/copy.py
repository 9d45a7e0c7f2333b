"""Copy plans: how one (paged layout, memory object) pair moves KV, decided at build time.

A plan turns both sides into *canonical views* (one tensor dim per axis: fused groups
split with `unflatten`, singletons selected away; splitting a dim is always a view,
whatever the strides, so strided caches stay correct), fixes the axes that Python
containers hold with loops, and lines the object view up with the cache view:

* block path: whole blocks of the chunk move with one `index_select` / `index_copy_`
  over the B dim (a plain slice copy when the blocks are consecutive), the object's T
  dim split into (blocks, N) to match;
* token path: the remaining tokens (partial blocks, folded slot axes, arbitrary slot
  mappings) move by advanced indexing, the object permuted into the order torch gives
  the indexed result, or as rows by slot over a folded slot axis.

When both sides end in C, values move as wide integer words (up to 16 bytes), chosen per
call by the runtime from the strides it meets.

Everything here is string and tuple work on specs; torch is never imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from kvgen.plan import splits
from kvgen.spec.library import Library
from kvgen.spec.model import Dim, Spec, Vocabulary


class Mode(Vocabulary):
    """Whole-chunk objects (every layer in one) or per-layer objects moved by generators."""

    WHOLE = "whole"
    LAYERWISE = "layerwise"


WHOLE, LAYERWISE = Mode.WHOLE, Mode.LAYERWISE


class PathKind(Vocabulary):
    """The copy strategy: whole blocks by index over B with the rest by slot, single tokens
    by (block, offset) index, or rows of a folded slot axis by slot."""

    BLOCKS_THEN_TOKENS = "blocks_then_tokens"
    TOKENS_BY_SLOT = "tokens_by_slot"
    ROWS_BY_SLOT = "rows_by_slot"

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
class BlockPath:
    """Whole blocks of a chunk, moved by one index op over B per loop step.

    The object's whole blocks are viewed in the cache's dim order; loops fix the axes that
    a cache block holds but the object keeps outside its tokens (L and KV of cross-layer
    blocks, K/V packed in content), so each op's inner dims are in the same order on
    both sides and, where memory allows, each block moves as one contiguous row."""

    loops: tuple[Loop, ...]
    #: The object chunk's whole blocks with B and N split from T (`ob`, once per chunk).
    base: str
    base_axes: tuple[str, ...]
    #: `ob` inside the loops, in x's dim order.
    blocks: View
    #: Index suffix selecting the loop axes, the same on x and on `blocks`.
    select: str
    #: B dim of x and `blocks` after the selection.
    dim: int


@dataclass(frozen=True)
class CopyPlan:
    paged: Spec
    obj: Spec
    mode: Mode
    loops: tuple[Loop, ...]
    #: True when both sides end in C, so copies may move C as wide integer words.
    widen: bool
    #: Canonical view of the whole object tensor `o` (made once per chunk).
    object_view: View
    #: Canonical view of one cache leaf `x`, inside the loops.
    cache_view: View
    #: Object view inside the loops (`o` with loop axes fixed), bound to `y` when loops
    #: select from it.
    object_part: View
    #: Token path: index applied to x, and the object in the order torch gives x[index].
    token_index: str
    token_object: View
    #: Token rows: a folded slot axis first in x and T first in the object.
    token_rows: bool
    block: BlockPath | None
    #: Object shape, as expressions over `g` and `num_tokens`.
    shape: tuple[str, ...]

    @property
    def module(self) -> str:
        return f"{self.paged.name}__{self.obj.name}"

    @property
    def part_name(self) -> str:
        return _part_name(self.object_part)

    @property
    def token_dim(self) -> int:
        return self.token_object.axes.index("T")

    @property
    def path(self) -> PathKind:
        """How the generated copy reaches the cache's slots."""
        if self.block is not None:
            return PathKind.BLOCKS_THEN_TOKENS
        return PathKind.ROWS_BY_SLOT if self.token_rows else PathKind.TOKENS_BY_SLOT

    @property
    def strategy(self) -> str:
        """One line for people: what the generated copy does."""
        loops = " x ".join(lp.axis for lp in self.loops)
        per = f"per {loops} leaf" if loops else "all layers at once"
        if self.block is None:
            how = "tokens as rows by slot" if self.path is PathKind.ROWS_BY_SLOT else "tokens by slot"
        else:
            extra = " x ".join(lp.axis for lp in self.block.loops)
            how = (f"whole blocks by index over B (dim {self.block.dim})" + (f" per {extra}" if extra else "")
                   + ", the rest by slot")
        return f"{per}: {how}" + ("; wide words" if self.widen else "")


def _part_name(part: View) -> str:
    """The object inside the loops gets a name of its own (`y`) when loops select from it."""
    return "y" if part.expr != "o" else "o"


def compatible(paged: Spec, obj: Spec) -> bool:
    """Same logical content (paged slots <-> object tokens), shared dtypes, and an object
    that is either whole-chunk or per layer."""
    if not paged.is_paged or obj.is_paged:
        return False
    if not (paged.is_simple and obj.is_simple):  # format-2 pairs: kvgen.plan.planes
        return False
    if paged.token_ratio[0] != 1:  # format 3: several tokens per slot move in model groups only
        return False
    if obj.lists not in ((), ("L",)):
        return False
    if set(paged.axes) - {"B", "N"} != set(obj.axes) - {"T"}:
        return False
    return bool(set(paged.dtypes) & set(obj.dtypes))


def mode_of(obj: Spec) -> Mode:
    return LAYERWISE if obj.lists else WHOLE


def canonical(base: str, dims: tuple[Dim, ...], extent: dict[str, str] = EXTENT) -> View:
    """Split fused dims and drop singletons, last dim first so earlier indices hold."""
    expr = base
    for i in range(len(dims) - 1, -1, -1):
        dim = dims[i]
        if dim.is_singleton:
            expr += f".select({i}, 0)"
        elif dim.is_fused and not dim.is_slot:
            sizes = ", ".join(extent[a] for a in dim.axes)
            expr += f".unflatten({i}, ({sizes}))"
    axes: list[str] = []
    for dim in dims:
        if dim.is_slot:
            axes.append(SLOT)
        else:
            axes.extend(dim.axes)
    return View(expr, tuple(axes))


def ends_in_c(spec: Spec) -> bool:
    """The innermost value of a leaf is one of C's, so C can be moved in wider words."""
    last = [d for d in spec.dims if not d.is_singleton]
    return bool(last) and spec.dims[-1] == last[-1] and last[-1].axes[-1] == "C"


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


def _split_t(axes: tuple[str, ...], into: tuple[str, ...] = ("B", "N")) -> tuple[str, ...]:
    t = axes.index("T")
    return (*axes[:t], *into, *axes[t + 1:])


def _block_path(cache: View, whole: View, fixed: dict[str, str], extent: dict[str, str] = EXTENT) -> BlockPath:
    # The chunk's whole blocks are split out of T once per chunk (`ob`); each loop step
    # selects its part and orders it like x. A split N (format 3) splits T into its tile and place too.
    t = whole.axes.index("T")
    into, sizes = splits.block_tokens(cache.axes)
    base = f"o.narrow({t}, ck.block_start, ck.block_tokens).unflatten({t}, {sizes})"
    part = select(View("ob", _split_t(whole.axes, into)), fixed)
    blocks = View(part.expr + permute_suffix(part.axes, cache.axes), cache.axes)
    b = cache.axes.index("B")
    inside = cache.axes[b + 1:]
    loop_axes = [a for a in inside if a not in part.axes[part.axes.index(into[1]):]]
    inner = {a: LOOP_VARS.get(a, f"i{a.lower()}") for a in loop_axes}
    loops = tuple(Loop(inner[a], a, extent[a]) for a in loop_axes)
    return BlockPath(loops, base, _split_t(whole.axes, into), blocks, index_suffix(cache.axes, inner), b)


@dataclass(frozen=True)
class Source:
    """Where the copy of one plane reads and writes, for caches of several parts or fields
    (kvgen.plan.planes): the cache leaf expression inside the loops, the expression of the
    plane's whole object view, and the extents (C counted in bytes)."""

    leaf: str
    tensor: str
    extent: dict[str, str]
    #: How a cache leaf is viewed before its dims are split: bytes, so planes of any
    #: dtype and fields at byte offsets move alike.
    raw: str = "runtime.bytes_of({})"


def _loops(paged: Spec, mode: Mode) -> tuple[Loop, ...]:
    """The loops over the cache's list levels; per-layer objects loop over the layer first."""
    if mode == WHOLE:
        return tuple(Loop(LOOP_VARS[a], a, EXTENT[a]) for a in paged.lists)
    return (Loop("layer", "L", EXTENT["L"]), *(Loop(LOOP_VARS[a], a, EXTENT[a]) for a in paged.lists if a != "L"))


def _views(paged: Spec, obj: Spec, source: Source | None, fixed: dict[str, str]
           ) -> tuple[bool, dict[str, str], View, View]:
    """(widen, the extents' expressions, the cache leaf's view with the loop levels fixed, the whole object's view)."""
    if source is not None:
        leaf, tensor, widen, extent = source.raw.format(source.leaf), source.tensor, False, source.extent
    else:
        widen = ends_in_c(paged) and ends_in_c(obj)
        extent = {**EXTENT, "C": "w.C"} if widen else EXTENT
        raw = "{}.view(w.dtype)" if widen else "runtime.bits({})"
        leaf = raw.format("kvcaches" + "".join(f"[{LOOP_VARS[a]}]" for a in paged.lists))
        # The views take every axis's place from the module's PROGRAM (kvgen.plan.program), the
        # description every mover executes: the torch code too moves what PROGRAM says.
        cache = View(placed(leaf, MODULE_PROGRAM, "cache"), canonical(leaf, paged.dims).axes)
        whole = View(placed(raw.format("tensor"), MODULE_PROGRAM, "object"), canonical("tensor", obj.dims).axes)
        return widen, extent, select(cache, fixed), whole
    return widen, extent, select(canonical(leaf, paged.dims, extent), fixed), canonical(tensor, obj.dims, extent)


#: A connector's program as its generated methods name it.
MODULE_PROGRAM = "self.program"


def placed(expr: str, program: str, side: str) -> str:
    """`expr` viewed at the places the CopyProgram `program` (an expression in the module)
    gives `side` ("cache" or "object"): one dim per place (runtime.placed)."""
    return f"runtime.placed({expr}, {program}.{side}_places, g)"


def make_plan(paged: Spec, obj: Spec, source: Source | None = None) -> CopyPlan:
    """The copy plan of a compatible pair; with `source`, of one plane of a format-2 pair
    (`paged` and `obj` are then the plane's one-tree views, already checked)."""
    if source is None and not compatible(paged, obj):
        raise ValueError(f"{paged.name} and {obj.name} do not hold the same KV content")
    mode = mode_of(obj)
    loops = _loops(paged, mode)
    fixed = {lp.axis: lp.var for lp in loops}
    widen, extent, cache, whole_obj = _views(paged, obj, source, fixed)
    part = select(View("o", whole_obj.axes), fixed)

    y = _part_name(part)
    slot_axes = (SLOT,) if SLOT in cache.axes else splits.slot_axes(cache.axes)
    index_names = {SLOT: "ck.slots", **splits.slot_index(cache.axes)}
    token_index = index_suffix(cache.axes, {a: index_names[a] for a in slot_axes if a in cache.axes})
    has_slots = any(a in cache.axes for a in slot_axes)
    result = indexed_order(cache.axes, slot_axes) if has_slots else cache.axes
    token_object = View(y + permute_suffix(part.axes, result), result)
    token_rows = slot_axes == (SLOT,) and cache.axes[0] == SLOT and result[0] == "T"
    block = _block_path(cache, whole_obj, fixed, extent) if slot_axes != (SLOT,) and has_slots else None

    return CopyPlan(
        paged=paged, obj=obj, mode=mode, loops=loops, widen=widen, object_view=whole_obj, cache_view=cache,
        object_part=part, token_index=token_index, token_object=token_object, token_rows=token_rows,
        block=block, shape=shape_exprs(obj) if source is None else (),  # a plane's object: its pair's shape
    )


def plan_library(library: Library) -> list[CopyPlan]:
    """A plan for every compatible (paged, object) pair, in a stable order."""
    return [make_plan(p, o) for p, o in product(library.paged, library.objects) if compatible(p, o)]
