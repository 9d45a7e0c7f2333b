"""Passes over objects that pack a cache's planes (format 2: `pack: rows` or `pack: regions`)."""

from __future__ import annotations

from kvgen.errors import Problem
from kvgen.spec.document import Document
from kvgen.spec.model import Pack, Spec
from kvgen.spec.passes.common import Pass


def check_pack(spec: Spec, doc: Document) -> list[Problem]:
    if spec.is_paged or spec.pack is None:
        return []
    out = []
    if "dtypes" in doc.data:
        out.append(doc.problem(("dtypes",), "a packed object takes its element type from the cache (rows) or "
                                            "holds bytes (regions); leave dtypes out", key=True))
    out += [doc.problem(("sizes", axis), f"a packed object takes {axis} from the cache it is filled from; its "
                                         "sizes may only say KV: 2", key=True)
            for axis, _ in spec.sizes if axis != "KV"]
    return out + (_rows_problems(spec, doc) if spec.pack is Pack.ROWS else _regions_problems(spec, doc))


def _rows_problems(spec: Spec, doc: Document) -> list[Problem]:
    """A rows object: one row per token, of L, T and C only, ending in C."""
    out = []
    for i, d in enumerate(spec.dims):
        bad = [a for a in d.axes if a not in ("L", "T", "C")]
        if bad:
            out.append(doc.problem(("dims", i), f"a rows object holds one row per token: every plane of the "
                                                f"token one after another in C; {' and '.join(bad)} cannot "
                                                "appear (planes with KV or H need pack: regions)"))
    if _last_axes(spec) != ("C",):
        out.append(doc.problem(("dims",), "a rows object ends in C, the row of one token"))
    return out


def _regions_problems(spec: Spec, doc: Document) -> list[Problem]:
    """A regions object: dense regions (no singleton dims) ending in C; a whole one starts with L."""
    dims = spec.dims
    out = [doc.problem(("dims", i), "a regions object has no singleton dims: each plane's region is "
                                    "dense over the dims it has")
           for i, d in enumerate(dims) if d.is_singleton]
    if _last_axes(spec)[-1:] != ("C",):
        out.append(doc.problem(("dims",), "a regions object ends in C: each plane's values are moved as bytes"))
    if not spec.lists and (not dims or dims[0].axes != ("L",)):
        out.append(doc.problem(("dims", 0), "a whole regions object starts with L: each layer holds its "
                                            "planes' regions one after another"))
    return out


def _last_axes(spec: Spec) -> tuple[str, ...]:
    return spec.dims[-1].axes if spec.dims else ()


PASSES: tuple[Pass, ...] = (check_pack,)
