"""Building the typed spec model from a schema-checked document: dims, sizes, fields, parts
and the Spec itself (kvgen.spec.model holds the types)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from kvgen.spec.elements import DTYPES, Packing
from kvgen.spec.loader import Document
from kvgen.spec.model import AXES, Carries, Dim, Field, FieldsIn, Kind, Pack, Part, Spec


def _dim(value: object) -> Dim:
    if isinstance(value, list):
        return Dim(tuple(value))
    if value == 1 and not isinstance(value, bool):
        return Dim(())
    return Dim((str(value),))


def _sizes(data: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(data.items(), key=lambda kv: AXES.index(kv[0]) if kv[0] in AXES else len(AXES)))


def _fields(data: Mapping[str, object] | None) -> tuple[tuple[Field, ...], FieldsIn | None]:
    """Fields of a row or block, with their byte offsets (explicit `at`, else packed)."""
    if not data:
        return (), None
    where, items = next(iter(data.items()))
    out, at = [], 0
    for item in items:  # type: ignore[attr-defined]
        dtype, count = item["dtype"], item["count"]
        at = item.get("at", at)
        packing = Packing(item["packing"]) if "packing" in item else None
        f = Field(item["name"], dtype, count, at, packing, item.get("scales"), item.get("group"))
        out.append(f)
        at += f.nbytes
    return tuple(out), FieldsIn(where)


def _part(name: str, d: Mapping[str, object]) -> Part:
    fields, where = _fields(d.get("fields"))  # type: ignore[arg-type]
    return Part(name=name, dims=tuple(_dim(v) for v in d.get("dims", ())),  # type: ignore[attr-defined]
                sizes=_sizes(d.get("sizes", {})), dtypes=tuple(d.get("dtypes", DTYPES)),  # type: ignore[arg-type]
                fields=fields, fields_in=where)


def _tree(d: Mapping[str, Any]) -> tuple[tuple[Part, ...], tuple[Dim, ...], tuple[str, ...]]:
    """A spec's parts, its top-level dims and the element types it may hold."""
    if d.get("pack") == Pack.GROUPS:
        return (), (), ("uint8",)
    if "parts" in d:
        parts = tuple(_part(name, body) for name, body in d["parts"].items())
        # Every element type some part may hold, in the canonical order.
        return parts, (), tuple(t for t in DTYPES if any(t in p.dtypes for p in parts))
    dims = tuple(_dim(v) for v in d["dims"])
    dtypes = tuple(d.get("dtypes", DTYPES))
    fields, where = _fields(d.get("fields"))
    own = tuple((k, v) for k, v in _sizes(d.get("sizes", {})) if k == "C")
    return (Part("", dims, own, dtypes, fields, where),), dims, dtypes


def _carries(d: Mapping[str, Any]) -> Carries | None:
    if "carries" not in d:
        return None
    return Carries(*(c if isinstance(c, str) else tuple(c) for c in (d["carries"]["groups"], d["carries"]["state"])))


def build_spec(doc: Document, origin: str | None = None) -> Spec:
    """Typed view of a document that passed the schema."""
    d = doc.data
    parts, dims, dtypes = _tree(d)
    return Spec(
        version=d["kvgen"],
        name=d["name"],
        kind=Kind(d["kind"]),
        summary=d["summary"],
        lists=tuple(d.get("lists", ())),
        dims=dims,
        sizes=_sizes(d.get("sizes", {})),
        aliases=tuple(d.get("aliases", ())),
        lmcache_format=d.get("lmcache", {}).get("format"),
        engines=tuple(d.get("engines", ())),
        placement=d.get("placement", "device"),
        dtypes=dtypes,
        format=d.get("format"),
        code=d.get("code"),
        accepts=tuple(d.get("accepts", ())),
        source=doc.file,
        origin=origin or doc.file,
        digest=hashlib.sha256(doc.text).hexdigest(),
        parts=parts,
        pack=Pack(d["pack"]) if "pack" in d else None,
        members=tuple(d.get("members", ())),
        versions=tuple(sorted(d.get("versions", {}).items())),
        given=tuple(_dim(v) for v in d.get("given", ())),
        quant=tuple(sorted(d.get("quant", {}).items())),
        token_ratio=(d.get("tokens_per_slot", 1), d.get("slots_per_token", 1)),
        carries=_carries(d),
    )
