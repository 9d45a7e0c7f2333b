"""What every pass group shares: the shape of a pass and the YAML paths of a spec's places."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from kvgen.errors import Problem, YamlPath
from kvgen.spec.document import Document
from kvgen.spec.model import Part, Spec

#: A pass: one spec and its document in, the problems it finds out, each located by YAML path.
Pass = Callable[[Spec, Document], list[Problem]]


def occurrences(spec: Spec) -> Iterator[tuple[str, YamlPath]]:
    """Every axis letter with the YAML path where it is written."""
    for i, axis in enumerate(spec.lists):
        yield axis, ("lists", i)
    for i, dim in enumerate(spec.dims):
        if dim.is_fused:
            for j, axis in enumerate(dim.axes):
                yield axis, ("dims", i, j)
        elif not dim.is_singleton:
            yield dim.axes[0], ("dims", i)


def path_of(spec: Spec, axis: str) -> YamlPath:
    """Where `axis` is first written, or `dims` when it is not."""
    return next((path for a, path in occurrences(spec) if a == axis), ("dims",))


def part_path(spec: Spec, part: Part) -> YamlPath:
    """Where a part is written: `parts.NAME`, or the top of a spec of one tree."""
    return ("parts", part.name) if spec.is_multipart else ()


def field_list_path(spec: Spec, part: Part) -> YamlPath:
    """Where a part's fields are listed: `fields.row` or `fields.block` under the part."""
    return (*part_path(spec, part), "fields", str(part.fields_in))


def mapping_at(doc: Document, path: YamlPath) -> Any:
    """The mapping written at `path` in the document, or an empty one where there is none."""
    node = doc.data
    for key in path:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return {}
    return node if isinstance(node, dict) else {}
