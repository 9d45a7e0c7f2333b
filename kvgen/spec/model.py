"""The typed spec model: frozen dataclasses built from a schema-checked document."""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from kvgen.notation import format_dim, format_layout
from kvgen.spec.loader import Document

#: Axis letters: layer, K/V selector, block, slot-in-block, head, content, token-in-chunk.
AXES = ("L", "KV", "B", "N", "H", "C", "T")
#: Axes whose extent is 1 when a layout leaves them out (MLA has one plane and no heads).
OPTIONAL_AXES = ("KV", "H")
DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8", "uint8")


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


@dataclass(frozen=True)
class Spec:
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
    dtypes: tuple[str, ...]
    format: str | None
    code: int | None
    accepts: tuple[str, ...]
    source: str
    #: Where the spec came from, stable across machines (`specs/vllm/mla.yaml`).
    origin: str
    digest: str

    @property
    def is_paged(self) -> bool:
        return self.kind is Kind.PAGED

    @property
    def axes(self) -> tuple[str, ...]:
        """Every axis the layout names, list levels first, in declaration order."""
        return self.lists + tuple(a for d in self.dims for a in d.axes)

    @property
    def tensor_axes(self) -> tuple[str, ...]:
        return tuple(a for d in self.dims for a in d.axes)

    def has(self, axis: str) -> bool:
        return axis in self.axes

    def size(self, axis: str) -> int | None:
        return dict(self.sizes).get(axis)

    @property
    def planes(self) -> int:
        """How many K/V planes the layout holds: 2, or 1 for MLA."""
        return 2 if self.has("KV") else 1

    def arrow(self, extents: Mapping[str, int] | None = None) -> str:
        """`KV -> L -> [(B N) H C]`; with extents, `L=32 -> [KV=2 B=10 N=16 H=8 C=128]`."""
        return format_layout(self.lists, [d.axes for d in self.dims], extents)


def _dim(value: object) -> Dim:
    if isinstance(value, list):
        return Dim(tuple(value))
    if value == 1 and not isinstance(value, bool):
        return Dim(())
    return Dim((str(value),))


def build_spec(doc: Document, origin: str | None = None) -> Spec:
    """Typed view of a document that passed the schema."""
    d = doc.data
    return Spec(
        version=d["kvgen"],
        name=d["name"],
        kind=Kind(d["kind"]),
        summary=d["summary"],
        lists=tuple(d.get("lists", ())),
        dims=tuple(_dim(v) for v in d["dims"]),
        sizes=tuple(sorted(d.get("sizes", {}).items(), key=lambda kv: AXES.index(kv[0]))),
        aliases=tuple(d.get("aliases", ())),
        lmcache_format=d.get("lmcache", {}).get("format"),
        engines=tuple(d.get("engines", ())),
        dtypes=tuple(d.get("dtypes", DTYPES)),
        format=d.get("format"),
        code=d.get("code"),
        accepts=tuple(d.get("accepts", ())),
        source=doc.file,
        origin=origin or doc.file,
        digest=hashlib.sha256(doc.text).hexdigest(),
    )
