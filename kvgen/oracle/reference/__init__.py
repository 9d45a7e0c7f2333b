"""The reference interpreter: an obviously correct copy for every kind of generated module, one
module per kind. The (layout, object) pairs, as kvgen.plan.package's PAIR_KINDS names them:

- `layouts`: a cache and an object of one tensor tree each (spec format 1), element by element;
- `planes`: a cache of several parts or fields and a packed object (format 2), byte by byte;

and the other kinds of module a build makes:

- `transfers`: layout-to-layout transfers (`transfer`, of two `TransferSide`s);
- `models`: model connectors, every group and the state to and from one groups object.

It reads the specs through kvgen.oracle.address only (never the planner or generated code) and
so says what any generated module must produce; tests and `kvgen verify` compare every one with
it. `store` and `load` here take a pair's specs and pick the module of its kind; `common` holds
what the modules share (`Span`: the tokens one chunk moves).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import Any

from kvgen.oracle.reference import layouts, planes
from kvgen.oracle.reference.common import Span, leaf
from kvgen.spec.model import Spec


def module_of(paged: Spec, obj: Spec) -> ModuleType:
    """The reference module of a (layout, object) pair: `layouts` when both are one tensor tree
    (as kvgen.plan.copy plans them), else `planes`."""
    return layouts if paged.is_simple and obj.is_simple else planes


def store(paged: Spec, obj: Spec, ext: Mapping[str, int], kvcaches: Any, objects: Any, span: Span) -> None:
    """Copy the span's tokens from the cache into `objects` (one tensor, or a per-layer list)."""
    module_of(paged, obj).store(paged, obj, ext, kvcaches, objects, span)


def load(paged: Spec, obj: Spec, ext: Mapping[str, int], kvcaches: Any, objects: Any, span: Span) -> None:
    """Copy `objects` into the cache at the span's slots (its first `skip` tokens left alone)."""
    module_of(paged, obj).load(paged, obj, ext, kvcaches, objects, span)


__all__ = ["Span", "layouts", "leaf", "load", "module_of", "planes", "store"]
