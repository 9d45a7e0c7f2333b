"""How a connector reads a cache's geometry, decided at build time.

The planner knows which dims of a layout are list levels, single axes, fused groups,
singletons or a folded slot axis, and which extents a spec fixes. It writes that down as
the straight-line body of the generated `read_geometry`, so the runtime re-derives
nothing: it only runs the checks (`kvgen.runtime.CacheReader`) the body calls.
"""

from __future__ import annotations

from kvgen.notation import format_dim
from kvgen.spec.model import ITEMSIZE, Dim, Field, Part, Spec


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


def parts_geometry_body(spec: Spec) -> tuple[str, ...]:
    """Lines of `read_geometry(kvcaches)` for a format-2 cache: every part's tensors read
    and checked, shared extents (L, KV, B, N, H) equal across parts, each part's C, and
    each plane's bytes per value row."""
    levels = [a for a in spec.lists if a != "P"]
    head = ", ".join(levels) + ("," if len(levels) == 1 else "")
    lines = ["reader = runtime.CacheReader(PAGED, kvcaches)",
             f"({head}), leaves = reader.parts()" if levels else "_, leaves = reader.parts()"]
    known: dict[str, str] = {a: a for a in levels}  # an extent -> the variable holding it
    fused: list[tuple[int, Dim, str]] = []
    plain: list[str] = list(levels)
    for p, part in enumerate(spec.parts):
        names = [_part_dim_name(d, j, p, known) for j, d in enumerate(part.dims)]
        if names:
            lines.append(f"{', '.join(names)}{',' if len(names) == 1 else ''} = leaves[{p}].shape")
        for j, (dim, name) in enumerate(zip(part.dims, names, strict=True)):
            axis = "S" if dim.is_slot else (_own(dim.axes[0], p) if len(dim.axes) == 1 else None)
            if dim.is_singleton:
                lines.append(f"reader.singleton({j}, {name})")
            elif axis is None:
                fused.append((p, dim, name))
            elif axis in known and known[axis] != name:
                lines.append(f"reader.same({axis.split('_')[0]!r}, {known[axis]}, {name})")
            else:
                known[axis] = name
                plain.append(name)
        if part.has("C"):
            lines.append(_byte_rows(part, p))
    for axis, value in spec.sizes:
        lines.append(f"reader.fixed({axis!r}, {known[axis]}, {value})" if axis in known else f"{axis} = {value}")
        known.setdefault(axis, axis)
    for p, part in enumerate(spec.parts):
        width = part.size("C")
        if part.fields and part.dtypes:
            width = (part.row_bytes or 0) // ITEMSIZE[part.dtypes[0]]
        c = _own("C", p)
        if width is not None:
            lines.append(f"reader.fixed('C', {known[c]}, {width})" if c in known else f"{c} = {width}")
            known.setdefault(c, c)
    solved = []
    for p, dim, name in fused:
        axes = [_own(a, p) for a in dim.axes]
        unknown = [a for a in axes if a not in known]
        product = " * ".join(known[a] for a in axes if a in known)
        label = format_dim(dim.axes)
        if unknown:
            lines.append(f"{unknown[0]} = reader.split({label!r}, {name}, {product})")
            known[unknown[0]] = unknown[0]
            solved.append(unknown[0])
        else:
            lines.append(f"reader.fused({label!r}, {name}, {product})")
    lines.append(f"reader.positive({', '.join(f'{n}={n}' for n in dict.fromkeys([*plain, *solved]))})")
    planes = []
    for i, plane in enumerate(spec.moved_planes()):
        p = plane.index
        if plane.field is not None:
            size, word = str(plane.field.nbytes), _field_word(plane.field, plane.part, p)
        else:
            c = _own("C", p)
            lines.append(f"row{i} = {known[c]} * leaves[{p}].element_size()" if c in known
                         else f"row{i} = leaves[{p}].element_size()")
            size, word = f"row{i}", f"reader.word({p}, 0, row{i}{'' if c in known else ', keep_last=True'})"
            word += f", values={known[c] if c in known else 1}"
        planes.append(f"runtime.PlaneGeometry({plane.name!r}, {size}, {word})")
    first_c = _own("C", 0)
    slots = known.get("S", f"{known.get('B', 'B')} * {known.get('N', 'N')}")
    block = "None" if "S" in known else known.get("N", "N")
    lines += ["return runtime.Geometry(",
              f"    L={known.get('L', '1')}, KV={known.get('KV', '1')}, H={known.get('H', '1')}, "
              f"C={known.get(first_c, '1')}, N={block}, S={slots},",
              "    dtype=leaves[0].dtype, device=leaves[0].device,",
              "    planes=(",
              *(f"        {text}," for text in planes),
              "    ),",
              ")"]
    return tuple(lines)


def _byte_rows(part: Part, p: int) -> str:
    """The check that a part's rows (and a block's run, for block fields) are runs of bytes."""
    run = len(part.block_run) if part.fields_in == "block" else 0
    return f"reader.byte_rows({p}{', block=True' if run == 2 else f', run={run}' if run else ''})"


def _field_word(f: Field, part: Part, p: int) -> str:
    """The word a field's plane moves in; with rows of K and V (format 3), V's copy of the field
    starts a half row on, so that start must be a whole word too."""
    word = f"reader.word({p}, {f.offset}, {f.nbytes})"
    if part.dims[-1].axes == ("KV", "C"):
        word = f"min({word}, reader.word({p}, {f.offset + (part.row_bytes or 0)}, {f.nbytes}))"
    return word


def _own(axis: str, part: int) -> str:
    """C belongs to each part; every other axis is shared by all parts."""
    return f"C_{part}" if axis == "C" else axis


def _part_dim_name(dim: Dim, index: int, part: int, known: dict[str, str]) -> str:
    if dim.is_singleton:
        return f"unit{index}_{part}"
    if dim.is_slot:
        return "S" if "S" not in known else f"S_{part}"
    if dim.is_fused:
        return "_".join(dim.axes) + f"_{part}"
    axis = _own(dim.axes[0], part)
    return axis if axis not in known else f"{axis}_{part}"
