"""How a connector reads a cache's geometry, decided at build time.

The planner knows which dims of a layout are list levels, single axes, fused groups,
singletons or a folded slot axis, and which extents a spec fixes. It writes that down as
the straight-line body of the generated `read_geometry`, so the runtime re-derives
nothing: it only runs the checks (`kvgen.runtime.CacheReader`) the body calls.
"""

from __future__ import annotations

from kvgen.notation import format_dim
from kvgen.plan import splits
from kvgen.spec.elements import split_of
from kvgen.spec.model import ITEMSIZE, Dim, Field, Part, Plane, Spec


def _name(axes: tuple[str, ...], index: int) -> str:
    """The local variable holding one tensor dim's extent."""
    if not axes:
        return f"unit{index}"
    if axes == ("B", "N"):
        return "S"
    return "_".join(axes)


def geometry_body(spec: Spec) -> tuple[str, ...]:
    """Lines of `read_geometry(kvcaches)` for a paged spec (4-space indents, unindented)."""
    names = [_name(d.axes, i) for i, d in enumerate(spec.dims)]
    known = set(spec.lists) | {d.axes[0] for d in spec.dims if len(d.axes) == 1}
    lines = [*_tree_head(spec, names), *_tree_sizes(spec, known)]
    fused, solved = _tree_fused(spec, names, known)
    # Fused extents are products of checked axes, so only lists, plain dims and solved axes.
    plain = [n for d, n in zip(spec.dims, names, strict=True) if len(d.axes) == 1 or d.is_slot]
    positive = [*spec.lists, *plain, *solved]
    lines += [*fused, f"reader.positive({', '.join(f'{n}={n}' for n in dict.fromkeys(positive))})"]
    folded = any(d.is_slot for d in spec.dims)
    slots, block = ("S", "None") if folded else ("B * N", "N")
    kv = "KV" if spec.has("KV") else "1"
    heads = "H" if spec.has("H") else "1"
    lines.append(f"return runtime.Geometry(L=L, KV={kv}, H={heads}, C=C, N={block}, S={slots}, "
                 "dtype=leaf.dtype, device=leaf.device)")
    return tuple(lines)


def _tree_head(spec: Spec, names: list[str]) -> list[str]:
    """The leaves read, their dims' extents named, the singleton dims checked."""
    lists = ", ".join(spec.lists) + ("," if len(spec.lists) == 1 else "")
    lines = ["reader = runtime.CacheReader(PAGED, kvcaches)",
             f"({lists}), leaf = reader.leaves()" if spec.lists else "_, leaf = reader.leaves()",
             f"{', '.join(names)}{',' if len(names) == 1 else ''} = leaf.shape"]
    lines += [f"reader.singleton({i}, {name})" for i, (dim, name) in enumerate(zip(spec.dims, names, strict=True))
              if dim.is_singleton]
    return lines


def _tree_sizes(spec: Spec, known: set[str]) -> list[str]:
    """The spec's fixed extents: checked where a dim holds them, else set; `known` gains the set ones."""
    lines = []
    for axis, value in dict(spec.sizes).items():
        if axis in known:
            lines.append(f"reader.fixed({axis!r}, {axis}, {value})")
        else:
            lines.append(f"{axis} = {value}")
            known.add(axis)
    return lines


def _tree_fused(spec: Spec, names: list[str], known: set[str]) -> tuple[list[str], list[str]]:
    """Each fused dim (not the slot axis) checked as the product of its axes, or its one unknown
    axis solved from it; the lines and the solved axes, which `known` gains."""
    lines, solved = [], []
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
    return lines, solved


def planes_geometry_body(spec: Spec) -> tuple[str, ...]:
    """Lines of `read_geometry(kvcaches)` for a format-2 cache: every part's tensors read
    and checked, shared extents (L, KV, B, N, H) equal across parts, each part's C, and
    each plane's bytes per value row."""
    reading = _PlanesReading(spec)
    for p, part in enumerate(spec.parts):
        reading.read_part(p, part)
    reading.fix_sizes()
    reading.solve_fused()
    reading.lines.append(f"reader.positive({', '.join(f'{n}={n}' for n in dict.fromkeys(reading.plain))})")
    planes = [reading.plane(i, plane) for i, plane in enumerate(spec.moved_planes())]
    return (*reading.lines, *reading.result(planes))


class _PlanesReading:
    """The lines of a format-2 `read_geometry` as they are written, with the variable that holds
    each extent so far (`known`), the fused dims left to check, and the extents to check positive."""

    def __init__(self, spec: Spec):
        self.spec = spec
        levels = [a for a in spec.lists if a != "P"]
        head = ", ".join(levels) + ("," if len(levels) == 1 else "")
        self.lines = ["reader = runtime.CacheReader(PAGED, kvcaches)",
                      f"({head}), leaves = reader.parts()" if levels else "_, leaves = reader.parts()"]
        self.known: dict[str, str] = {a: a for a in levels}  # an extent -> the variable holding it
        self.fused: list[tuple[int, Dim, str]] = []
        self.plain: list[str] = list(levels)
        #: The place axis of each split by a named factor (`H%g`) -> the variable holding its extent.
        self.named: dict[str, str] = {}

    def read_part(self, p: int, part: Part) -> None:
        """Part `p`'s dims named and checked: singletons, fused dims kept for later, a shared extent
        the same as another part's."""
        names = [_part_dim_name(d, j, p, self.known) for j, d in enumerate(part.dims)]
        if names:
            self.lines.append(f"{', '.join(names)}{',' if len(names) == 1 else ''} = leaves[{p}].shape")
        for j, (dim, name) in enumerate(zip(part.dims, names, strict=True)):
            axis = "S" if dim.is_slot else (_own(dim.axes[0], p) if len(dim.axes) == 1 else None)
            if dim.is_singleton:
                self.lines.append(f"reader.singleton({j}, {name})")
            elif axis is None:
                self.fused.append((p, dim, name))
            elif axis in self.known and self.known[axis] != name:
                self.lines.append(f"reader.same({axis.split('_')[0]!r}, {self.known[axis]}, {name})")
            else:
                self.known[axis] = name
                self.plain.append(name)
        self.solve_splits(p, part)
        if part.has("C"):
            self.lines.append(_byte_rows(part, p))

    def solve_splits(self, p: int, part: Part) -> None:
        """Each split axis of part `p` (format 3): its place's extent checked against the factor,
        the whole axis solved as tile x place, or checked against another part's."""
        for base in ("N", "H", "C"):
            pair = splits.splits(part, base)
            if not pair:
                continue
            tile, place = (self.known[_own(a, p)] for a in pair)
            if isinstance(splits.factor(pair[1]), int):
                self.lines.append(f"reader.fixed({pair[1]!r}, {place}, {splits.factor(pair[1])})")
            else:  # a named factor: the place's extent, as the tensor has it
                self.named[pair[1]] = place
            whole, axis = f"{tile} * {place}", _own(base, p)
            if axis in self.known:
                self.lines.append(f"reader.same({base!r}, {self.known[axis]}, {whole})")
            else:
                self.lines.append(f"{axis} = {whole}")
                self.known[axis] = axis

    def fix_sizes(self) -> None:
        """The shared fixed extents, then each part's C (its own size, or the row its fields fill)."""
        known = self.known
        for axis, value in self.spec.sizes:
            self.lines.append(f"reader.fixed({axis!r}, {known[axis]}, {value})" if axis in known
                              else f"{axis} = {value}")
            known.setdefault(axis, axis)
        for p, part in enumerate(self.spec.parts):
            width = part.size("C")
            if part.fields and part.dtypes:
                width = (part.row_bytes or 0) // ITEMSIZE[part.dtypes[0]]
            c = _own("C", p)
            if width is not None:
                self.lines.append(f"reader.fixed('C', {known[c]}, {width})" if c in known else f"{c} = {width}")
                known.setdefault(c, c)

    def solve_fused(self) -> None:
        """Each fused dim checked as the product of its axes, or its one unknown axis solved from it."""
        for p, dim, name in self.fused:
            axes = [_own(a, p) for a in dim.axes]
            unknown = [a for a in axes if a not in self.known]
            product = " * ".join(self.known[a] for a in axes if a in self.known)
            label = format_dim(dim.axes)
            if unknown:
                self.lines.append(f"{unknown[0]} = reader.split({label!r}, {name}, {product})")
                self.known[unknown[0]] = unknown[0]
                self.plain.append(unknown[0])  # checked positive after the plain extents
            else:
                self.lines.append(f"reader.fused({label!r}, {name}, {product})")

    def plane(self, i: int, plane: Plane) -> str:
        """A moved plane's `PlaneGeometry`: its bytes per value row and the word it moves in."""
        p = plane.index
        if plane.field is not None:
            size, word = str(plane.field.nbytes), _field_word(plane.field, plane.part, p)
        else:
            c = _own("C", p)
            has_c = c in self.known
            self.lines.append(f"row{i} = {self.known[c]} * leaves[{p}].element_size()" if has_c
                              else f"row{i} = leaves[{p}].element_size()")
            size, word = f"row{i}", f"reader.word({p}, 0, row{i}{'' if has_c else ', keep_last=True'})"
            if splits.is_tiled(plane.part):  # moved value by value (kvgen.plan.splits)
                self.lines.append(f"word{i} = reader.word({p}, 0, leaves[{p}].element_size(), keep_last=True)")
                word = f"word{i}"
            word += f", values={self.known[c] if has_c else 1}"
        return f"runtime.PlaneGeometry({plane.name!r}, {size}, {word})"

    def result(self, planes: list[str]) -> list[str]:
        known = self.known
        slots = known.get("S", f"{known.get('B', 'B')} * {known.get('N', 'N')}")
        block = "None" if "S" in known else known.get("N", "N")
        return ["return runtime.Geometry(",
                f"    L={known.get('L', '1')}, KV={known.get('KV', '1')}, H={known.get('H', '1')}, "
                f"C={known.get(_own('C', 0), '1')}, N={block}, S={slots},",
                "    dtype=leaves[0].dtype, device=leaves[0].device,",
                "    planes=(",
                *(f"        {text}," for text in planes),
                "    ),",
                *([f"    splits=({' '.join(f'({a!r}, {v}),' for a, v in self.named.items())}),"] if self.named else []),
                ")"]


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
    """C belongs to each part; every other axis is shared by all parts. A split axis's
    variable names its tile (`C/8`: C_t8) or place (`C%8`: C_p8)."""
    split = split_of(axis)
    if split is not None:
        base, op, f = split
        name = f"{base}_{'t' if op == '/' else 'p'}{f}"
        return f"{name}_{part}" if base == "C" else name
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
