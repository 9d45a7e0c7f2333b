"""How a user's name for a layout or memory object resolves, in one place.

First match wins: the spec name; an exact alias; a name or alias in any case (`nhd`);
then an LMCache format name in any case (`KV_2LTD`, `NL_X_TWO_NB_BS_NH_HS`). A name that
fits several specs in one tier is refused with the candidates. The spec library and
every generated package resolve through here, so `kvgen explain nhd` and
`get("NHD", "KV_2LTD")` agree. No torch here: generator and runtime both import this.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvgen.errors import KVLayoutError


@dataclass(frozen=True)
class Named:
    """What a spec answers to: its name, its aliases and the LMCache format names it carries."""

    name: str
    aliases: tuple[str, ...] = ()
    formats: tuple[str, ...] = ()


def resolve(name: str, entries: Sequence[Named]) -> str:
    """The spec name `name` stands for, or KVLayoutError listing the valid names."""
    for entry in entries:
        if entry.name == name:
            return name
    exact = [e for e in entries if name in e.aliases]
    if len(exact) == 1:
        return exact[0].name
    key = str(name).casefold()
    tiers: tuple[tuple[str, Callable[[Named], tuple[str, ...]]], ...] = (
        ("name or alias", lambda e: (e.name, *e.aliases)),
        ("LMCache format name", lambda e: e.formats),
    )
    for what, labels in tiers:
        found = [e.name for e in entries if key in (label.casefold() for label in labels(e))]
        if len(found) == 1:
            return found[0]
        if found:
            raise KVLayoutError(f"{name!r} is the {what} of {len(found)} specs: {', '.join(found)}; "
                                "name one of them")
    raise KVLayoutError(f"no layout or object named {name!r} (names and aliases match in any case, as do "
                        f"LMCache format names); {closest(name, entries)}")


def closest(name: str, entries: Sequence[Named], n: int = 5) -> str:
    """`closest: a (A), b; `kvgen list` shows all 52`: the few names nearest `name` (any of
    their labels), else every name when there are only a few."""
    shown = {e.name: e for e in entries}
    if len(shown) <= n:
        return f"known: {', '.join(described(list(shown.values())))}"
    labels = {label.casefold(): e.name for e in entries for label in (e.name, *e.aliases, *e.formats)}
    near = difflib.get_close_matches(str(name).casefold(), list(labels), n=3 * n, cutoff=0.4)
    names = list(dict.fromkeys(labels[label] for label in near))[:n]
    picked = described([shown[x] for x in names])
    order = {x: i for i, x in enumerate(names)}
    picked.sort(key=lambda text: order[text.split(" ")[0]])
    head = f"closest: {', '.join(picked)}; " if picked else ""
    return f"{head}`kvgen list` shows all {len(shown)}"


def described(entries: Sequence[Named]) -> list[str]:
    """`vllm_flash_attn_nhd (NHD)`, `kv_2ltd (KV_2LTD)`: every name with its other labels, sorted."""
    out = []
    for e in sorted(entries, key=lambda e: e.name):
        other = list(dict.fromkeys((*e.aliases, *e.formats)))
        out.append(e.name + (f" ({', '.join(other)})" if other else ""))
    return out
