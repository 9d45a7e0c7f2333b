"""The statements of each generated method, written from a copy plan.

Every choice (which op, which loops, which view) is made here, so the templates only
place ready lines. Lines are unindented; nesting adds four spaces per level.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgen.plan.copy import CopyPlan, Loop, Mode

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


def _indent(lines: list[str], levels: int = 1) -> list[str]:
    return [INDENT * levels + line for line in lines]


def _loops(loops: tuple[Loop, ...], body: list[str]) -> list[str]:
    head = [INDENT * i + f"for {lp.var} in range({lp.extent}):" for i, lp in enumerate(loops)]
    return head + _indent(body, len(loops))


def _axes(axes: tuple[str, ...]) -> str:
    return f"[{' '.join(axes)}]"


def _copy(plan: CopyPlan, store: bool) -> list[str]:
    """One copy between a canonical cache view `x` and the object, in one direction."""
    cv = plan.cache_view
    lines = [f"x = {cv.expr}  # {_axes(cv.axes)}"]
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
        body = [f"o = {plan.object_view.expr}  # {_axes(plan.object_view.axes)}"]
        if plan.block is not None:
            body.append(f"ob = {plan.block.base}  # whole blocks: {_axes(plan.block.base_axes)}")
        body += _loops(loops, _copy(plan, direction == "store"))
        methods.append(Method(f"_{direction}{suffix}", params, tuple(body)))
    return tuple(methods)


def shape_body(plan: CopyPlan) -> str:
    """The object shape as a tuple expression over `g` and `num_tokens`."""
    return f"({', '.join(plan.shape)}{',' if len(plan.shape) == 1 else ''})"
