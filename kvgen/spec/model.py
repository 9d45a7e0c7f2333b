"""The typed spec model: frozen dataclasses built from a schema-checked document.

Format 1 describes one tree of uniform tensors. Format 2 adds *parts* (several named tensor
trees in one cache: K and V of different widths, values and their scales), *fields* (typed
values at byte offsets inside a row or a block) and, for memory objects, a *pack* (how the
planes of such a cache are laid out in one object). A plane is the unit a connector moves:
one part, or one field of a part. docs/spec-language.md has the grammar.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping
from dataclasses import dataclass

from kvgen.notation import format_dim, format_layout
from kvgen.spec.elements import BITS, Packing, split_of, tiled
from kvgen.spec.elements import DTYPES as DTYPES  # re-exported: the planner, oracle and passes read them here
from kvgen.spec.elements import ITEMSIZE as ITEMSIZE

#: Axis letters: layer, K/V selector, block, slot-in-block, head, content, token-in-chunk.
AXES = ("L", "KV", "B", "N", "H", "C", "T")
#: Axes whose extent is 1 when a layout leaves them out (MLA has one plane and no heads).
OPTIONAL_AXES = ("KV", "H")
#: The list level whose entries are the parts of a format-2 cache (`lists: [L, P]`).
PART_LEVEL = "P"


class Vocabulary(str, enum.Enum):
    """A closed set of words: compares equal to, and prints as, its value."""

    def __str__(self) -> str:
        return str(self.value)


class Kind(Vocabulary):
    """An engine cache addressed by slot, or a memory object addressed by token."""

    PAGED = "paged"
    OBJECT = "object"


@dataclass(frozen=True)
class Dim:
    """One tensor dim: a single axis, a fused group of axes (outermost first) or a singleton."""

    axes: tuple[str, ...]

    @property
    def is_singleton(self) -> bool:
        return not self.axes

    @property
    def is_fused(self) -> bool:
        return len(self.axes) > 1

    @property
    def is_slot(self) -> bool:
        """SGLang's folded page buffer: [B, N] as one axis indexed by slot."""
        return self.axes == ("B", "N")

    def render(self, extents: Mapping[str, int] | None = None) -> str:
        return format_dim(self.axes, extents)


class FieldsIn(Vocabulary):
    """Where typed fields live: inside each row (the C axis of one token and head), or
    inside each block (one region per field, every token of the block in order)."""

    ROW = "row"
    BLOCK = "block"


class Pack(Vocabulary):
    """How a format-2 object holds the planes of a cache: each token's planes one after
    another in one row (LMCache's flat MLA plane), or each plane as its own dense region."""

    ROWS = "rows"
    REGIONS = "regions"
    #: A model's layer groups and state (kvgen.spec.models): one section per carried group,
    #: laid out as one of the object's members, then each carried state tensor.
    GROUPS = "groups"


@dataclass(frozen=True)
class Carries:
    """Which layer groups and state groups of a model a `pack: groups` object holds: "all",
    "none" or names."""

    groups: str | tuple[str, ...]
    state: str | tuple[str, ...]

    @staticmethod
    def pick(which: str | tuple[str, ...], names: tuple[str, ...]) -> tuple[str, ...]:
        """The carried names among `names` (a model's), in the model's order."""
        if which == "all":
            return names
        if which == "none":
            return ()
        return tuple(n for n in names if n in which)


@dataclass(frozen=True)
class Field:
    """One typed field: `count` values of `dtype` per token (and head) at a byte offset.

    Row fields: `offset` is the byte offset inside the row. Block fields: the field's region
    starts at byte `offset * N` of the block (the regions before it hold `offset` bytes per
    token) and token n's values start `n * nbytes` bytes into the region."""

    name: str
    dtype: str
    count: int
    offset: int
    #: Format 3, sub-byte fields: the order of the two values in a byte.
    packing: Packing | None = None
    #: Format 3, scale fields: the field whose values this one scales, `group` values per scale,
    #: consecutive along that field's C (value c of it is scaled by value c // group of this one).
    scales: str | None = None
    group: int | None = None

    @property
    def bits(self) -> int:
        return BITS[self.dtype]

    @property
    def itemsize(self) -> int:
        """Bytes of the smallest unit the field is addressed in (a packed byte for sub-byte types)."""
        return max(1, self.bits // 8)

    @property
    def nbytes(self) -> int:
        """Bytes per token (and head); a sub-byte field with an odd count ends in a half byte,
        which the passes refuse."""
        return -(-self.count * self.bits // 8)

    @property
    def is_sub_byte(self) -> bool:
        return self.bits < 8

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


class Shaped:
    """What a spec and each of its parts answer about their tensor dims and fixed sizes."""

    dims: tuple[Dim, ...]
    sizes: tuple[tuple[str, int], ...]

    @functools.cached_property  # frozen dataclasses: asked millions of times by the planner and the oracle
    def tensor_axes(self) -> tuple[str, ...]:
        return tuple(a for d in self.dims for a in d.axes)

    @property
    def axes(self) -> tuple[str, ...]:
        return self.tensor_axes

    def has(self, axis: str) -> bool:
        """Whether the axis is held, whole or (format 3) split into tiles (`C/16`, `C%16`)."""
        return axis in self.axes or any((split_of(a) or ("",))[0] == axis for a in self.axes)

    def size(self, axis: str) -> int | None:
        return dict(self.sizes).get(axis)


@dataclass(frozen=True)
class Part(Shaped):
    """One named tensor tree of a cache: its dims, sizes of its own axes, dtypes, fields."""

    name: str
    dims: tuple[Dim, ...]
    #: Extents fixed for this part only (its C).
    sizes: tuple[tuple[str, int], ...]
    dtypes: tuple[str, ...]
    fields: tuple[Field, ...] = ()
    fields_in: FieldsIn | None = None

    @property
    def has_slots(self) -> bool:
        return self.has("B")

    @property
    def row_bytes(self) -> int | None:
        """Bytes of one row (or, for block fields, per token) that the fields fill."""
        return max((f.end for f in self.fields), default=0) or None

    @property
    def block_run(self) -> tuple[Dim, ...]:
        """Block fields: the dims after B, whose elements are one run of bytes per block (per
        K or V side, in format 3, when the run starts with KV)."""
        i = next((j for j, d in enumerate(self.dims) if d.axes == ("B",)), len(self.dims))
        return self.dims[i + 1:]

    def render(self) -> str:
        return "[" + " ".join(d.render() for d in self.dims) + "]"


@dataclass(frozen=True)
class Plane:
    """What a connector moves as one unit: a part, or one field of a part."""

    part: Part
    #: Position of the part among the spec's parts (its index in the P list level).
    index: int
    field: Field | None
    #: The logical axes of one value besides the slot (or token): L, KV, H, C as present.
    axes: tuple[str, ...]

    @property
    def name(self) -> str:
        """The part's name, its field's, or both; `cache` for the one plane of a one-tree cache
        without fields (a tiled tree: kvgen.spec.model.Spec.is_simple)."""
        if self.field is None:
            return self.part.name or "cache"
        return self.field.name if not self.part.name else f"{self.part.name}.{self.field.name}"

    @property
    def dtype(self) -> str | None:
        """The element type of the plane's values (None when the part's dtype is free)."""
        if self.field is not None:
            return self.field.dtype
        return self.part.dtypes[0] if len(self.part.dtypes) == 1 else None

    @property
    def has_slots(self) -> bool:
        return self.part.has_slots


@dataclass(frozen=True)
class Spec(Shaped):
    """One layout or memory-object spec, as declared in its YAML file."""

    version: int
    name: str
    kind: Kind
    summary: str
    lists: tuple[str, ...]
    dims: tuple[Dim, ...]
    sizes: tuple[tuple[str, int], ...]
    aliases: tuple[str, ...]
    lmcache_format: str | None
    engines: tuple[str, ...]
    #: "device" (an engine's GPU-side cache) or "host" (a CPU-side pool).
    placement: str
    dtypes: tuple[str, ...]
    format: str | None
    code: int | None
    accepts: tuple[str, ...]
    source: str
    #: Where the spec came from, stable across machines (`specs/vllm/mla.yaml`).
    origin: str
    digest: str
    #: Format 2: the parts of the cache. A format-1 spec (or one without `parts`) has one
    #: part, named "", holding `dims`, its sizes, dtypes and fields.
    parts: tuple[Part, ...] = ()
    #: Format 2 objects: how the planes of a cache are laid out.
    pack: Pack | None = None
    #: `pack: groups` objects: the objects a group's section may take, and what is carried.
    members: tuple[str, ...] = ()
    carries: Carries | None = None
    #: Engine family -> the range of its releases this layout describes (`versions:`).
    versions: tuple[tuple[str, str], ...] = ()
    #: The order the engine hands each leaf over in (`given:`), a permutation of `dims`; () when
    #: the engine hands over the memory order itself.
    given: tuple[Dim, ...] = ()
    #: Format 3: engine family -> the engine's name for the quantization the cache stores (`quant:`).
    quant: tuple[tuple[str, str], ...] = ()
    #: Format 3: (tokens, slots): `tokens_per_slot: k` is (k, 1), `slots_per_token: k` is (1, k).
    token_ratio: tuple[int, int] = (1, 1)

    @property
    def is_paged(self) -> bool:
        return self.kind is Kind.PAGED

    @functools.cached_property
    def axes(self) -> tuple[str, ...]:
        """Every axis the layout names, list levels first, in declaration order."""
        return self.lists + self.tensor_axes

    @property
    def planes(self) -> int:
        """How many K/V planes the layout holds: 2, or 1 for MLA."""
        return 2 if self.has("KV") else 1

    @property
    def is_multipart(self) -> bool:
        return len(self.parts) > 1

    @property
    def is_simple(self) -> bool:
        """One tensor tree of one content, no fields, no pack, no split axes: what format 1 says.
        Everything else is planned plane by plane (kvgen.plan.planes)."""
        return (len(self.parts) <= 1 and not any(p.fields for p in self.parts) and self.pack is None
                and not any(tiled(p.tensor_axes) for p in self.parts))

    @property
    def head_groups(self) -> tuple[str, ...]:
        """(tile, place) where the spec splits H into groups of a size read from its tensors
        (`H/g`, `H%g`, format 3: SGLang's page_unified head groups); () otherwise."""
        for part in self.parts:
            found = [a for a in part.tensor_axes if (s := split_of(a)) is not None and s[0] == "H"
                     and isinstance(s[2], str)]
            if found:
                return tuple(sorted(found, key=lambda a: "%" in a))  # the tile, then the place
        return ()

    @property
    def part_lists(self) -> tuple[str, ...]:
        """The list levels without the part level P."""
        return tuple(a for a in self.lists if a != PART_LEVEL)

    def moved_planes(self) -> tuple[Plane, ...]:
        """The planes a connector moves, in order: parts in declaration order, each part's
        fields in declaration order (a part without fields is one plane)."""
        out = []
        for i, part in enumerate(self.parts):
            axes = tuple(a for a in ("L", "KV", "H", "C") if a in self.part_lists or part.has(a))
            for f in part.fields or (None,):
                out.append(Plane(part, i, f, axes))
        return tuple(out)

    def arrow(self, extents: Mapping[str, int] | None = None) -> str:
        """`KV -> L -> [(B N) H C]`; with extents, `L=32 -> [KV=2 B=10 N=16 H=8 C=128]`.

        Format 2 adds the parts at their list level, `L -> P{k [B N H C], v [B N H C]}`, a
        field list after the dims, `[B N C]{nope float8_e4m3fn x512, ...}`, and an object's
        pack, `[1 L T C] rows`."""
        if self.carries is not None:
            c = self.carries
            said = [v if isinstance(v, str) else ", ".join(v) for v in (c.groups, c.state)]
            return f"groups as {' | '.join(self.members)}; groups: {said[0]}; state: {said[1]}"
        if self.is_simple:
            return format_layout(self.lists, [d.axes for d in self.dims], extents)
        if not self.is_multipart:
            text = format_layout(self.lists, [d.axes for d in self.dims], extents) + _fields_text(self.parts[0])
            return text if self.pack is None else f"{text} {self.pack}"
        levels = [f"{a}={extents[a]}" if extents and a in extents else a for a in self.lists]
        inner = ", ".join(f"{p.name} {format_layout((), [d.axes for d in p.dims], extents)}{_fields_text(p)}"
                          for p in self.parts)
        return " -> ".join([*levels, "{" + inner + "}"])


def _fields_text(part: Part) -> str:
    if not part.fields:
        return ""
    body = ", ".join(f"{f.name} {f.dtype} x{f.count}" + (f" {f.packing}" if f.packing else "")
                     + (f" per {f.group} of {f.scales}" if f.scales else "") for f in part.fields)
    return f"{{{part.fields_in}: {body}}}"
