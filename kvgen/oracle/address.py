"""Where one KV element lives: the plain arithmetic of a spec, element by element.

This is the definition the generated copies are checked against (through
kvgen.oracle.reference); it shares nothing with the planner. No torch here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvgen.spec.elements import factor_value, split_extents, split_of
from kvgen.spec.model import ITEMSIZE, Dim, Field, Part, Plane, Spec

#: Logical coordinates of an element: l, kv, h, c, and slot (paged) or t (object).
Coords = Mapping[str, int]


def _coordinate(axis: str, coords: Coords, ext: Mapping[str, int]) -> int:
    split = split_of(axis)
    if split is not None:  # format 3: a tile of an axis, or the place in it
        base, op, f = split
        whole, value = _coordinate(base, coords, ext), factor_value(base, f, ext)
        return whole // value if op == "/" else whole % value
    if axis == "B":
        return coords["slot"] // ext["N"]
    if axis == "N":
        return coords["slot"] % ext["N"]
    if axis == "T":
        return coords["t"]
    return coords.get(axis.lower(), 0)


def element_address(spec: Spec, coords: Coords, ext: Mapping[str, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(container path, tensor index) of the element at `coords` for extents `ext`."""
    path = tuple(_coordinate(a, coords, ext) for a in spec.lists)
    return path, tensor_index(spec.dims, coords, ext)


def tensor_index(dims: tuple[Dim, ...], coords: Coords, ext: Mapping[str, int]) -> tuple[int, ...]:
    """The index of the element at `coords` in a tensor with `dims`."""
    index = []
    for dim in dims:
        if dim.is_singleton:
            index.append(0)
        elif dim.is_slot:
            index.append(coords["slot"])
        else:
            flat = 0
            for axis in dim.axes:
                flat = flat * ext[axis] + _coordinate(axis, coords, ext)
            index.append(flat)
    return tuple(index)


_SYMBOL = {"L": "l", "KV": "kv", "H": "h", "C": "c", "T": "t", "B": "slot // N", "N": "slot % N"}


def _sym(axis: str) -> str:
    split = split_of(axis)
    if split is None:
        return _SYMBOL[axis]
    base, op, f = split
    return f"{_SYMBOL[base]} {'//' if op == '/' else '%'} {f}"


def symbolic_address(spec: Spec) -> str:
    """`kvcaches[l][kv, slot // N, slot % N, h, c]` for people (kvgen explain)."""
    root = "kvcaches" if spec.is_paged else "tensor"
    path = "".join(f"[{_sym(a)}]" for a in spec.lists)
    parts = []
    for dim in spec.dims:
        if dim.is_singleton:
            parts.append("0")
        elif dim.is_slot:
            parts.append("slot")
        elif dim.is_fused:
            text = _sym(dim.axes[0])
            for i, axis in enumerate(dim.axes[1:]):
                text = f"{text if i == 0 else f'({text})'} * {axis} + {_sym(axis)}"
            parts.append(text)
        else:
            parts.append(_sym(dim.axes[0]))
    return f"{root}{path}[{', '.join(parts)}]"


# -- format 2: planes (parts and fields), byte addresses ---------------------------------------
# A value of a plane is `size` bytes; its address is (container path, tensor index of the
# storage element holding its first byte, byte inside that element). Tensors are read in
# index order (row-major over their shape), whatever their strides.

ByteAddress = tuple[tuple[int, ...], tuple[int, ...], int]


def part_width(spec: Spec, part: Part, ext: Mapping[str, int]) -> int:
    """Elements of the part's C: what its fields fill, its fixed size, or `ext["C.<part>"]`
    (else `ext["C"]`); 1 for a part without C."""
    if not part.has("C"):
        return 1
    if part.fields:
        return (part.row_bytes or 0) // ITEMSIZE[part.dtypes[0]]
    fixed = part.size("C")
    return fixed if fixed is not None else ext.get(f"C.{part.name}", ext["C"])


def plane_count(spec: Spec, plane: Plane, ext: Mapping[str, int]) -> int:
    """Units of one plane per (token, K or V, head): its values, or for a sub-byte field its
    packed bytes (two values each; the reference never moves half a byte)."""
    f = plane.field
    if f is None:
        return part_width(spec, plane.part, ext)
    return f.nbytes // f.itemsize


def stored_slots(spec: Spec, t: int) -> tuple[int, ...]:
    """Format 3: where token t's values are stored. Several tokens per slot (`tokens_per_slot`
    k): the one state t // k of a mapping in stored slots. Several slots per token
    (`slots_per_token` k): the states t * k .. t * k + k - 1, for t the token's slot in the
    mapping the engine's manager keeps (one entry per token), and for t a position in a chunk, the
    object rows that hold those states."""
    tokens, slots = spec.token_ratio
    return tuple(range(t * slots, (t + 1) * slots)) if slots > 1 else (t // tokens,)


def packed_value(f: Field, c: int) -> tuple[int, int]:
    """Value c of a field as (unit, bit shift): a whole-byte type is unit c at shift 0; a
    sub-byte one starts in packed byte unit, its bits [shift, shift + bits) of the bytes from
    there read as one little-endian integer. Nibbles: byte c // 2, value 2j in the low nibble under
    `low_first` (shift 0) and in the high one under `high_first` (shift 4). A bit stream (uint3):
    bit 3c of the field, so a value may reach into the next byte."""
    if not f.is_sub_byte:
        return c, 0
    if 8 % f.bits:
        return divmod(c * f.bits, 8)
    per = 8 // f.bits
    slot = c % per if f.packing == "low_first" else per - 1 - c % per
    return c // per, slot * f.bits


def scale_index(f: Field, scale: Field, c: int) -> int:
    """The value of the scale field `scale` that scales value c of field `f`."""
    if scale.scales != f.name or scale.group is None:
        raise ValueError(f"field {scale.name!r} does not scale {f.name!r}")
    return c // scale.group


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for n in reversed(shape):
        out.append(flat % n)
        flat //= n
    return tuple(reversed(out))


def plane_address(spec: Spec, plane: Plane, coords: Coords, ext: Mapping[str, int], item: int) -> ByteAddress:
    """Where value (l, kv, slot, h, c) of `plane` starts in a format-2 cache whose part
    tensors have `item`-byte elements."""
    part = plane.part
    pext = {**ext, "C": part_width(spec, part, ext)}
    pext.update(split_extents(part.tensor_axes, pext))
    path = tuple(plane.index if a == "P" else _coordinate(a, coords, pext) for a in spec.lists)
    c, f = coords.get("c", 0), plane.field

    def index(at: Coords) -> tuple[int, ...]:
        return tensor_index(part.dims, at, pext)

    if f is None:
        return path, index({**coords, "c": c}), 0
    if part.fields_in == "row":
        pos = f.offset + c * f.itemsize
        return path, index({**coords, "c": pos // item}), pos % item
    # Block fields: the elements of block b after B are one run of bytes (per K or V side when
    # the run starts with KV); the run holds one region per field, and a field's region starts at
    # offset * cells and holds cell k's values at k * nbytes. A cell is a slot of the block, or in
    # format 3 a (head, slot) pair in the dims' order.
    n, slot = ext["N"], coords["slot"]
    axes = [a for d in part.block_run for a in d.axes if a not in ("KV", "C")]
    cell_coord = {"H": coords.get("h", 0), "N": slot % n}
    cells, cell = 1, 0
    for a in axes:
        cells, cell = cells * pext[a], cell * pext[a] + cell_coord[a]
    side = coords.get("kv", 0) if any("KV" in d.axes for d in part.block_run) else 0
    pos = side * cells * pext["C"] * item + f.offset * cells + cell * f.nbytes + c * f.itemsize
    run = tuple(_product(pext[a] for a in d.axes) for d in part.block_run)
    head = tensor_index(part.dims[:len(part.dims) - len(run)], coords, pext)
    return path, (*head, *_unravel(pos // item, run)), pos % item


def _product(values: Iterable[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def region_layout(paged: Spec, obj: Spec, ext: Mapping[str, int], sizes: Mapping[str, int],
                  tokens: int) -> tuple[list[tuple[int, tuple[str, ...], tuple[int, ...]]], int]:
    """A regions object: per plane (start byte in a layer, region axes, region shape), and
    the bytes of one layer. Regions follow one another in plane order, each starting at a
    multiple of 16 bytes; a region is dense over the object's dims with the axes the plane
    lacks left out (and L). `sizes` gives each plane's value size in bytes."""
    out, at = [], 0
    for plane in paged.moved_planes():
        keep = set(plane.axes) | {"C"} | ({"T"} if plane.has_slots else set())
        axes = tuple(a for d in obj.dims for a in d.axes if a in keep and a != "L")
        ext_p = {**ext, "T": tokens, "C": plane_count(paged, plane, ext)}
        shape = tuple(ext_p[a] for a in axes)
        out.append((at, axes, shape))
        size = sizes[plane.name]
        for n in shape:
            size *= n
        at += -(-size // 16) * 16
    return out, at


class ObjectAddresses:
    """Where each value of each plane lies in a packed object (rows or regions) of a chunk
    of ext["T"] tokens; `sizes` gives each plane's value size in bytes, `item` the bytes per
    element of the object's tensor. Region starts and row offsets are worked out once."""

    def __init__(self, paged: Spec, obj: Spec, ext: Mapping[str, int], sizes: Mapping[str, int], item: int):
        self.obj, self.ext, self.sizes, self.item = obj, ext, sizes, item
        planes = paged.moved_planes()
        self.index = {p.name: i for i, p in enumerate(planes)}
        # rows: a plane's values start after every earlier plane's in the token's row
        self.row_start, at = [], 0
        for p in planes:
            self.row_start.append(at)
            at += plane_count(paged, p, ext) * sizes[p.name]
        self.regions, self.layer_bytes = region_layout(paged, obj, ext, sizes, ext["T"])

    def address(self, plane: Plane, coords: Coords) -> ByteAddress:
        i, size = self.index[plane.name], self.sizes[plane.name]
        path = (coords["l"],) if self.obj.lists else ()
        if self.obj.pack == "rows":
            pos = self.row_start[i] + coords.get("c", 0) * size
            return path, tensor_index(self.obj.dims, {**coords, "c": pos // self.item}, self.ext), pos % self.item
        start, axes, shape = self.regions[i]
        flat = 0
        for a, n in zip(axes, shape, strict=True):
            flat = flat * n + (coords["t"] if a == "T" else coords.get(a.lower(), 0))
        byte = start + flat * size
        return (path, (coords["l"], byte), 0) if not self.obj.lists else (path, (byte,), 0)


def _sym_dims(dims: tuple[Dim, ...], coord: Mapping[str, str]) -> str:
    parts = []
    for dim in dims:
        if dim.is_singleton:
            parts.append("0")
        elif dim.is_slot:
            parts.append("slot")
        elif dim.is_fused:
            text = coord.get(dim.axes[0], _sym(dim.axes[0]))
            for i, axis in enumerate(dim.axes[1:]):
                text = f"{text if i == 0 else f'({text})'} * {axis} + {coord.get(axis, _sym(axis))}"
            parts.append(text)
        else:
            parts.append(coord.get(dim.axes[0], _sym(dim.axes[0])))
    return ", ".join(parts)


def _value_step(f: Field) -> str:
    """How value c of a field steps from its first byte: by its size, or by half a byte."""
    if f.is_sub_byte and 8 % f.bits:
        return f" + {f.bits} * c // 8, from bit {f.bits} * c % 8 of a little-endian stream"
    if f.is_sub_byte:
        nibble = "low" if f.packing == "low_first" else "high"
        return f" + c // 2, the {nibble} nibble for even c"
    return f" + {f.itemsize} * c" if f.itemsize > 1 else " + c"


def symbolic_plane_address(spec: Spec, plane: Plane) -> str:
    """Where value c of a plane starts, for people: `kvcaches[l][2][slot, h, 0]`, or with
    fields the byte at which it starts (`kvcaches[l][slot // N, slot % N, byte 512 + 4 * c]`)."""
    path = "".join(f"[{plane.index}]" if a == "P" else f"[{_sym(a)}]" for a in spec.lists)
    f = plane.field
    if f is None:
        index = _sym_dims(plane.part.dims, {})
        return f"kvcaches{path}" + (f"[{index}]" if index else " (a 0-dim tensor)")
    step = _value_step(f)
    if plane.part.fields_in == "row":
        return f"kvcaches{path}[{_sym_dims(plane.part.dims, {'C': f'byte {f.offset}{step}'})}]"
    run = plane.part.block_run
    cells = " * ".join(a for d in run for a in d.axes if a not in ("KV", "C"))  # N, or format 3's H * N
    cell = {"H * N": "(h * N + slot % N)", "N * H": "((slot % N) * H + h)"}.get(cells, "(slot % N)")
    side = f"kv * {cells} * {plane.part.row_bytes} + " if any("KV" in d.axes for d in run) else ""
    where = f"{side}{f.offset} * {cells} + {f.nbytes} * {cell}{step}"
    head = _sym_dims(plane.part.dims[:len(plane.part.dims) - len(run)], {})
    return f"kvcaches{path}[{head}{', ' if head else ''}block bytes {where}]"


def explain_lines(spec: Spec) -> list[str]:
    """What `kvgen explain` adds for format-2 specs: parts, fields, planes, packs."""
    out: list[str] = []
    if spec.is_paged and not spec.is_simple:
        out += _parts_lines(spec)
        out += [line for p in spec.parts if p.fields for line in _fields_lines(p)]
        out.append("  planes (moved as bytes, in this order; value c of a plane at):")
        out += [_plane_line(spec, plane) for plane in spec.moved_planes()]
    if spec.pack == "rows":
        out.append("  pack:     rows: each token's row holds every plane of the cache, one after another, "
                   "as bytes; C counts elements of the cache's first part's dtype")
    elif spec.pack == "regions":
        template = " ".join(d.render() for d in spec.dims if d.axes != ("L",))
        out.append(f"  pack:     regions: bytes; per layer each plane as a dense [{template}] region "
                   "(axes it lacks left out), in plane order, each at a multiple of 16 bytes")
    return out


def _parts_lines(spec: Spec) -> list[str]:
    if not spec.is_multipart:
        return []
    return ["  parts (the list level P, in order):",
            *(f"    [{i}] {p.name:<10} {p.render():<18} dtypes {', '.join(p.dtypes)}"
              for i, p in enumerate(spec.parts))]


def _fields_lines(p: Part) -> list[str]:
    """A part's fields: what they fill, then each field's type, count and place."""
    owner = f" of part {p.name}" if p.name else ""
    sides = ", per K and V side" if any("KV" in d.axes for d in p.block_run) else ""
    cells = " * ".join(a for d in p.block_run for a in d.axes if a not in ("KV", "C"))
    what = "each row (C)" if p.fields_in == "row" else "each block (regions of N tokens each)" \
        if len(p.block_run) == 2 else f"each block's run (regions of {cells.replace(' * ', ' x ')} cells each{sides})"
    out = [f"  fields{owner}, in {what}, dtypes {', '.join(p.dtypes)}:"]
    for f in p.fields:
        at = f"byte {f.offset}" if p.fields_in == "row" else f"region at byte {f.offset} * {cells}"
        out.append(f"    {f.name:<10} {f.dtype} x {f.count} ({f.nbytes} bytes), {at}")
    return out


def _plane_line(spec: Spec, plane: Plane) -> str:
    count = f"x {plane.field.count}" if plane.field else ("x C" if plane.part.has("C") else "x 1")
    slot = "" if plane.has_slots else " (no slot: moves with every chunk that moves a token)"
    return f"    {plane.name:<14} {plane.dtype or 'any':<14} {count:<6} {symbolic_plane_address(spec, plane)}{slot}"
