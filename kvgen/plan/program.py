"""The copy description of a connector (its PROGRAM), decided at build time from the layouts.

Everything about a copy that does not depend on the live tensors is decided here, once, and
written into the generated module as `PROGRAM = runtime.CopyProgram(...)`
(kvgen.runtime.movers.program): where every axis lives on each side (tensor dim, or a list
level of the cache), the token paths (whole blocks by id then single tokens by slot, or
tokens by slot over a folded slot axis), the dims of each kernel call in the destination's
order per direction, which of the innermost dims both layouts keep adjacent (so they may merge
into one memcpy run), and, for a pair the compiled kernel cannot move, the reason.

Movers (kvgen.runtime.movers) execute the description with the live extents, strides and
addresses only; none of them reads the layout facts to decide anything.

String and tuple work on specs; torch is never imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvgen.plan.copy import CopyPlan, Mode
from kvgen.plan.parts import PartsPlan
from kvgen.spec.model import Spec

#: The most dims one call of the compiled kernel takes (KV_MAXD in kvgen/runtime/csrc/kvcopy.c;
#: tests check the two agree).
KERNEL_DIMS = 8
#: Axes that address tokens: the cache's block, slot in block and folded slot, the object's token.
TOKEN_AXES = frozenset({"B", "N", "S", "T"})
#: Why caches of several planes or fields (spec format 2) keep the torch path.
PLANES_REASON = "caches of several planes move by torch ops"

Fields = tuple[tuple[str, Any], ...]
Place = tuple[str, int, tuple[str, ...]]


@dataclass(frozen=True)
class ProgramPlan:
    """A connector's PROGRAM: the CopyProgram's fields and each CopyPath's, ready to render."""

    fields: Fields
    paths: tuple[Fields, ...]

    @property
    def compiled(self) -> str | None:
        return dict(self.fields)["compiled"]


def places(spec: Spec) -> tuple[Place, ...]:
    """(axis, tensor dim, axes after it in that dim) for every axis of a leaf, outermost first;
    a folded slot dim [B N] is S, singleton dims hold none."""
    out: list[Place] = []
    for i, dim in enumerate(spec.dims):
        if dim.is_slot:
            out.append(("S", i, ()))
            continue
        out.extend((a, i, dim.axes[k + 1:]) for k, a in enumerate(dim.axes))
    return tuple(out)


def _why_not(plan: CopyPlan, shared: tuple[str, ...], cache: tuple[str, ...], obj: tuple[str, ...]) -> str | None:
    """Why the compiled kernel cannot move this pair (layout facts only); None when it can."""
    if [a for a in plan.obj.lists if a != "L"]:
        return f"object list levels {plan.obj.lists}"
    for a in shared:
        if a not in cache and a not in plan.paged.lists:
            return f"axis {a} is on the object only"
        if a not in obj:
            return f"axis {a} is on the cache only"
    if "T" not in obj or ("S" not in cache and ("B" not in cache or "N" not in cache)):
        return "token axes not found"
    if len(shared) + 2 > KERNEL_DIMS:
        return f"{len(shared) + 2} dims exceed the kernel's {KERNEL_DIMS}"
    return None


def _run(order: tuple[str, ...], cache: tuple[str, ...], obj: tuple[str, ...], lists: tuple[str, ...]
         ) -> tuple[str, ...]:
    """The innermost dims of `order` that both layouts keep adjacent and innermost, so that
    with contiguous strides they are one run: each is, on both sides, the axis right before
    the one merged before it (the last axis of the leaf, for the first). N merges as the
    cache's slot in block and the object's token; indexed dims (B, T) and list levels never."""
    merged: list[str] = []
    inner_c, inner_o = len(cache), len(obj)
    for name in reversed(order):
        if name in ("B", "T") or name in lists:
            break
        at_c, at_o = cache.index(name), obj.index("T" if name == "N" else name)
        if at_c != inner_c - 1 or at_o != inner_o - 1:
            break
        merged.append(name)
        inner_c, inner_o = at_c, at_o
    return tuple(reversed(merged))


def _order(dims: tuple[str, ...], key: dict[str, tuple[int, int]]) -> tuple[str, ...]:
    return tuple(sorted(dims, key=lambda d: key[d]))


def program_plan(plan: CopyPlan | PartsPlan) -> ProgramPlan:
    """The PROGRAM of one connector."""
    if isinstance(plan, PartsPlan):
        return ProgramPlan((("compiled", PLANES_REASON),), ())
    paged, obj = plan.paged, plan.obj
    layerwise = plan.mode is Mode.LAYERWISE
    cp, op = places(paged), places(obj)
    cache, objs = tuple(p[0] for p in cp), tuple(p[0] for p in op)
    axes = (set(cache) | set(paged.lists) | set(objs)) - TOKEN_AXES - ({"L"} if layerwise else set())
    shared = tuple(sorted(axes))
    folded = "S" in cache
    fields: Fields = (("compiled", _why_not(plan, shared, cache, objs)), ("layerwise", layerwise),
                      ("folded", folded), ("cache_lists", paged.lists), ("cache_places", cp),
                      ("object_places", op), ("shared", shared))
    if dict(fields)["compiled"] is not None:
        return ProgramPlan(fields, ())
    # Destination order: the object's axis order for a store; the cache's (list levels
    # first) for a load. B and N sit at the token's place, blocks outside slots.
    t = objs.index("T")
    okey = {a: (objs.index(a), 0) for a in shared}
    okey.update(B=(t, 0), N=(t, 1), T=(t, 0))
    lists = paged.lists
    ckey = {a: ((lists.index(a), 0) if a in lists else (len(lists) + cache.index(a), 0)) for a in shared}
    slot = len(lists) + cache.index("S" if folded else "B")
    ckey.update(T=(slot, 0))
    if not folded:
        ckey.update(B=(slot, 0), N=(len(lists) + cache.index("N"), 0))
    paths = []
    for name, dims in ((("blocks", ("B", "N", *shared)),) if not folded else ()) + (("tokens", ("T", *shared)),):
        store, load = _order(dims, okey), _order(dims, ckey)
        paths.append((("name", name), ("store", store), ("load", load),
                      ("store_run", _run(store, cache, objs, lists)), ("load_run", _run(load, cache, objs, lists))))
    return ProgramPlan(fields, tuple(paths))
