"""How a connector reads a cache's geometry, decided at build time.

The planner knows which dims of a layout are list levels, single axes, fused groups,
singletons or a folded slot axis, and which extents a spec fixes. It writes that down as
the straight-line body of the generated `read_geometry`, so the runtime re-derives
nothing: it only runs the checks (`kvgen.runtime.CacheReader`) the body calls.
"""

from __future__ import annotations

from kvgen.notation import format_dim
from kvgen.spec.model import Spec


def _name(axes: tuple[str, ...], index: int) -> str:
    """The local variable holding one tensor dim's extent."""
    if not axes:
        return f"unit{index}"
    if axes == ("B", "N"):
        return "S"
    return "_".join(axes)


def geometry_body(spec: Spec) -> tuple[str, ...]:
    """Lines of `read_geometry(kvcaches)` for a paged spec (4-space indents, unindented)."""
    fixed = dict(spec.sizes)
    names = [_name(d.axes, i) for i, d in enumerate(spec.dims)]
    lists = ", ".join(spec.lists) + ("," if len(spec.lists) == 1 else "")
    lines = ["reader = runtime.CacheReader(PAGED, kvcaches)",
             f"({lists}), leaf = reader.leaves()" if spec.lists else "_, leaf = reader.leaves()"]
    lines.append(f"{', '.join(names)}{',' if len(names) == 1 else ''} = leaf.shape")
    known = set(spec.lists) | {d.axes[0] for d in spec.dims if len(d.axes) == 1}
    for i, (dim, name) in enumerate(zip(spec.dims, names, strict=True)):
        if dim.is_singleton:
            lines.append(f"reader.singleton({i}, {name})")
    for axis, value in fixed.items():
        if axis in known:
            lines.append(f"reader.fixed({axis!r}, {axis}, {value})")
        else:
            lines.append(f"{axis} = {value}")
            known.add(axis)
    solved = []
    for dim, name in zip(spec.dims, names, strict=True):
        if not dim.is_fused or dim.is_slot:
            continue
        unknown = [a for a in dim.axes if a not in known]
        product = " * ".join(a for a in dim.axes if a in known)
        label = format_dim(dim.axes)
        if unknown:  # the passes allow at most one unknown axis per fused dim
            lines.append(f"{unknown[0]} = reader.split({label!r}, {name}, {product})")
            known.add(unknown[0])
            solved.append(unknown[0])
        else:
            lines.append(f"reader.fused({label!r}, {name}, {product})")
    # Fused extents are products of checked axes, so only lists, plain dims and solved axes.
    plain = [n for d, n in zip(spec.dims, names, strict=True) if len(d.axes) == 1 or d.is_slot]
    positive = [*spec.lists, *plain, *solved]
    lines.append(f"reader.positive({', '.join(f'{n}={n}' for n in dict.fromkeys(positive))})")
    slots = "S" if any(d.is_slot for d in spec.dims) else "B * N"
    block = "None" if any(d.is_slot for d in spec.dims) else "N"
    kv = "KV" if spec.has("KV") else "1"
    heads = "H" if spec.has("H") else "1"
    lines.append(f"return runtime.Geometry(L=L, KV={kv}, H={heads}, C=C, N={block}, S={slots}, "
                 "dtype=leaf.dtype, device=leaf.device)")
    return tuple(lines)
