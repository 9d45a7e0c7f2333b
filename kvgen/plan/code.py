"""The statements of each generated method, written from a copy plan.

Every choice (which op, which loops, which view) is made here, so the templates only
place ready lines. Lines are unindented; nesting adds four spaces per level.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvgen.plan.copy import MODULE_PROGRAM, CopyPlan, Loop, Mode, View, placed
from kvgen.plan.planes import PlaneCopy, PlanesPlan

INDENT = "    "
#: Parameters of the generated copy methods, after `self`.
CHUNK_PARAMS = ("tensor: torch.Tensor", "kvcaches: Any", "g: runtime.Geometry", "ck: runtime.Chunk",
                "w: runtime.Words")


@dataclass(frozen=True)
class Method:
    """One generated method: its name, parameters after `self`, and body lines."""

    name: str
    params: tuple[str, ...]
    body: tuple[str, ...]
    returns: str = "None"


def _indent(lines: list[str], levels: int = 1) -> list[str]:
    return [INDENT * levels + line for line in lines]


def _loops(loops: tuple[Loop, ...], body: list[str]) -> list[str]:
    head = [INDENT * i + f"for {lp.var} in range({lp.extent}):" for i, lp in enumerate(loops)]
    return head + _indent(body, len(loops))


def _axes(axes: tuple[str, ...]) -> str:
    return f"[{' '.join(axes)}]"


#: Generated lines stay within ruff's 120 columns; statements of a method body start at column 8.
COLUMNS = 120
LINE = COLUMNS - 8


def chain_calls(expr: str) -> list[str]:
    """`a(...).b(...)[i].c(...)` as ["a(...)", ".b(...)[i]", ".c(...)"]: its calls at the outermost level."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(expr):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "." and depth == 0 and i and expr[i - 1] in ")]":
            parts.append(expr[start:i])
            start = i
    return [*parts, expr[start:]]


def _assign(name: str, expr: str, comment: str) -> list[str]:
    """`name = expr  # comment` on one line where it fits in LINE; else the comment on a line
    above it, and a chain of calls too long for one line taken a call or more at a time."""
    one = f"{name} = {expr}  # {comment}"
    if len(one) <= LINE:
        return [one]
    return [f"# {comment}", *assign_chain(name, expr)]


def assign_chain(name: str, expr: str, width: int = LINE) -> list[str]:
    """`name = expr`, a chain of calls too long for one line (of `width` columns) taken a call or
    more at a time."""
    parts = chain_calls(expr)
    if re.search(rf"\b{re.escape(name)}\b", "".join(parts[1:])):  # a later call reads the name: one line
        return [f"{name} = {expr}"]
    lines, line = [], f"{name} = {parts[0]}"
    for part in parts[1:]:
        if len(line + part) > width:
            lines.append(line)
            line = f"{name} = {name}"
        line += part
    return [*lines, line]


def _bind(name: str, view: View, program: str | None, side: str) -> list[str]:
    """`name = view`; with `program` (a CopyProgram in the module whose places were planned
    over this view's dims) the view then taken at its places, on a line of its own."""
    if program is None:
        return _assign(name, view.expr, _axes(view.axes))
    return [*assign_chain(name, view.expr), f"{name} = {placed(name, program, side)}  # {_axes(view.axes)}"]


def _copy(plan: CopyPlan, store: bool, program: str | None = None) -> list[str]:
    """One copy between a canonical cache view `x` and the object, in one direction; `program`:
    the plane's program whose places `x` is taken at (see _bind)."""
    lines = _bind("x", plan.cache_view, program, "cache")
    if plan.block is not None:
        b = plan.block
        op = "take_index" if store else "put_index"
        lines += ["if ck.has_blocks:  # whole blocks by index over B, the object's viewed as x",
                  f"    blocks = {b.blocks.expr}"]
        lines += _indent(_loops(b.loops, [f"runtime.{op}(x{b.select}, {b.dim}, ck.block_ids, blocks{b.select})"]))
    lines.append("if ck.has_tokens:  # single tokens by slot")
    if plan.part_name != "o":
        lines.append(f"    y = {plan.object_part.expr}  # {_axes(plan.object_part.axes)}")
    tokens = plan.token_object
    if plan.token_rows:
        op = "gather_slots" if store else "scatter_slots"
        lines.append(f"    runtime.{op}(x, ck.slots, {tokens.expr}, ck.tok)")
        return lines
    name = tokens.expr
    if name != plan.part_name:
        lines.append(f"    tokens = {name}  # {_axes(tokens.axes)}, the order of x{plan.token_index}")
        name = "tokens"
    if store:
        lines.append(f"    runtime.put_tokens({name}, {plan.token_dim}, ck.tok, x{plan.token_index})")
    else:
        lines.append(f"    x{plan.token_index} = runtime.take_tokens({name}, {plan.token_dim}, ck.tok)")
    return lines


def copy_methods(plan: CopyPlan) -> tuple[Method, ...]:
    """`_store`/`_load` (whole) or `_store_layer`/`_load_layer` (layerwise)."""
    layerwise = plan.mode is Mode.LAYERWISE
    loops = plan.loops[1:] if layerwise else plan.loops  # the runtime steps the layer loop
    params = (("layer: int",) if layerwise else ()) + CHUNK_PARAMS
    suffix = "_layer" if layerwise else ""
    methods = []
    for direction in ("store", "load"):
        body = _assign("o", plan.object_view.expr, _axes(plan.object_view.axes))
        if plan.block is not None:
            body += _assign("ob", plan.block.base, f"whole blocks: {_axes(plan.block.base_axes)}")
        body += _loops(loops, _copy(plan, direction == "store"))
        methods.append(Method(f"_{direction}{suffix}", params, tuple(body)))
    return tuple(methods)


def shape_body(plan: CopyPlan) -> str:
    """The object shape as a tuple expression over `g` and `num_tokens`."""
    return f"({', '.join(plan.shape)}{',' if len(plan.shape) == 1 else ''})"


def _plane_copy(pc: PlaneCopy, store: bool, loops: tuple[Loop, ...], program: str | None) -> list[str]:
    """One plane of a format-2 pair: the format-1 copy over its byte views, or for a plane
    without a slot axis one plain copy per leaf, made with every chunk that moves a token.
    With `program` (the plane's CopyProgram in the module) both views are taken at its places,
    as the compiled movers take the module's byte views at them."""
    plan = pc.copy
    head = [f"# plane {pc.plane.name}"]
    whole = _bind("o", plan.object_view, program, "object")
    if not pc.slotless:
        body = list(whole)
        if plan.block is not None:
            body += _assign("ob", plan.block.base, f"whole blocks: {_axes(plan.block.base_axes)}")
        return head + body + _loops(loops, _copy(plan, store, program))
    inner = _bind("x", plan.cache_view, program, "cache")
    if plan.part_name != "o":
        inner.append(f"y = {plan.object_part.expr}  # {_axes(plan.object_part.axes)}")
    pair = (plan.token_object.expr, "x") if store else ("x", plan.token_object.expr)
    inner.append(f"runtime.copy_into({pair[0]}, {pair[1]})")
    return head + ["if ck.moved:  # no slot axis: it travels with every chunk that moves a token",
                   *_indent(whole), *_indent(_loops(loops, inner))]


def planes_methods(plan: PlanesPlan, programs: bool) -> tuple[Method, ...]:
    """`_dtype` (regions objects are bytes), then `_store`/`_load` or their per-layer forms,
    each running every plane in turn; `programs`: the module's PROGRAM holds one program per
    plane (PROGRAM.planes), whose places the copies' views follow."""
    layerwise = plan.mode is Mode.LAYERWISE
    params = (("layer: int",) if layerwise else ()) + CHUNK_PARAMS
    suffix = "_layer" if layerwise else ""
    methods = []
    if plan.dtype is not None:
        methods.append(Method("_dtype", ("g: runtime.Geometry",), (f"return {plan.dtype}",), "torch.dtype"))
    if plan.sizes:
        body = ("return (", *(f"    {size}," for size in plan.sizes), ")")
        methods.append(Method("_sizes", ("g: runtime.Geometry", "num_tokens: int"), body, "tuple[int, ...]"))
    for direction in ("store", "load"):
        body = list(plan.preamble)
        for i, pc in enumerate(plan.planes):
            loops = pc.copy.loops[1:] if layerwise else pc.copy.loops
            body += _plane_copy(pc, direction == "store", loops, f"{MODULE_PROGRAM}.planes[{i}]" if programs else None)
        methods.append(Method(f"_{direction}{suffix}", params, tuple(body)))
    return tuple(methods)


def planes_shape_body(plan: PlanesPlan) -> str:
    return f"({', '.join(plan.shape)}{',' if len(plan.shape) == 1 else ''})"
