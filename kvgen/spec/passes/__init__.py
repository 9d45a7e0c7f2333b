"""Semantic passes: what the JSON Schema cannot say.

Each pass takes a spec and its document and returns problems located by YAML path;
`check_spec` runs every pass that applies to a spec, in the order of the tables below, so a
user sees every problem in a file at once. One module per group of rules, each with its list
of passes:

- `layout`: one tensor tree's axes, lists, sizes and formats, and the engines a spec names;
- `parts`: where a cache's parts are, each part as a tree, what ties them together;
- `fields`: row and block fields, sub-byte and scale fields, rows of K and V;
- `objects`: how an object packs a cache's planes (rows, regions);
- `splits`: split axes (tiles) and token-to-slot ratios;
- `models`: model specs and `pack: groups` objects (one file, and against the library);
- `library`: the rules across files (`check_library`).
"""

from __future__ import annotations

from kvgen.errors import Problem
from kvgen.spec.document import Document
from kvgen.spec.model import Pack, Spec
from kvgen.spec.passes import fields, layout, objects, parts, splits
from kvgen.spec.passes.common import Pass
from kvgen.spec.passes.library import check_library
from kvgen.spec.passes.models import check_groups_object, check_model

#: A `pack: groups` object takes its layout from its members: only these apply.
GROUPS_OBJECT: tuple[Pass, ...] = (parts.check_version_features, check_groups_object, layout.check_accepts_self,
                                   layout.check_reserved_format)
#: After the passes of the spec's tree, every spec's, in the order their problems are reported.
PASSES: tuple[Pass, ...] = (*parts.PASSES, *fields.PASSES, *objects.PASSES, layout.check_quant,
                            layout.check_explicit_dtypes, *splits.PASSES)


def passes_for(spec: Spec) -> tuple[Pass, ...]:
    """The passes that check `spec`, in order."""
    if spec.pack is Pack.GROUPS:
        return GROUPS_OBJECT
    # A cache of several parts has no top-level dims: kvgen.spec.passes.parts checks them part by part.
    tree = (layout.check_lists,) if spec.is_multipart else layout.TREE
    return (*tree, *PASSES)


def check_spec(spec: Spec, doc: Document) -> list[Problem]:
    return [p for check in passes_for(spec) for p in check(spec, doc)]


__all__ = ["check_library", "check_model", "check_spec", "passes_for"]
