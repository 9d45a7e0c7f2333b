"""How a user's name for a layout or memory object resolves, in one place.

A spec name matches exactly; an alias (`NHD`) or an LMCache format name (`KV_2LTD`)
matches without regard to case. The spec library and every generated package resolve
through here, so `kvgen explain nhd` and `get("NHD", "KV_2LTD")` agree.
No torch here: the generator and the runtime both import this module.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvgen.errors import KVLayoutError


class UnknownName(KVLayoutError, LookupError):
    """A name that is no layout, alias or format of this build."""


def resolve(name: str, names: Iterable[str], aliases: Mapping[str, str],
            formats: Mapping[str, str] | None = None) -> str:
    """The spec name `name` stands for. `aliases` and `formats` map a label to a spec name;
    for a format held by several objects (whole and per-layer), map it to the whole one."""
    known = list(names)
    if name in known:
        return name
    folded = str(name).casefold()
    for table in (aliases, formats or {}):
        for label, target in table.items():
            if label.casefold() == folded:
                return target
    lowered = [n for n in known if n.casefold() == folded]
    if lowered:
        return lowered[0]
    choices = ", ".join(sorted(known))
    labels = ", ".join(sorted({*aliases, *(formats or {})}))
    raise UnknownName(f"unknown layout or object {name!r}; names: {choices}; aliases and formats "
                      f"(any case): {labels or '-'}")
