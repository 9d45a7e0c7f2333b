"""Facts about kvgen's own `pack: groups` objects, written from docs/spec-language.md ("Models")
rather than read from the specs: the format name and code, the member objects a group's section
may take (first match wins), and what each object carries. The byte layout of a section is
checked by the model reference (kvgen.oracle.reference.models); these facts pin what the specs declare.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgen.spec.model import Pack, Spec


@dataclass(frozen=True)
class GroupsFact:
    format: str
    code: int
    members: tuple[str, ...]
    groups: str
    state: str


#: Whole-chunk members in the order kvgen documents: K/V pairs as KV_2LTD, MLA latent rows as
#: KV_MLA_FMT, caches of several planes as kvgen's regions object.
_MEMBERS = ("kv_2ltd", "kv_mla", "kv_planes")

GROUPS_FACTS: dict[str, GroupsFact] = {
    "kv_groups": GroupsFact("KVGEN_GROUPS", 130, _MEMBERS, "all", "all"),
    "kv_groups_attention": GroupsFact("KVGEN_GROUPS_ATTENTION", 131, _MEMBERS, "all", "none"),
}


def groups_disagreement(spec: Spec) -> str | None:
    """The first way a groups object differs from its facts, or None."""
    fact = GROUPS_FACTS.get(spec.name)
    if fact is None:
        return f"no fact entry for {spec.name}"
    if spec.pack is not Pack.GROUPS or spec.carries is None:
        return f"pack {spec.pack}, the facts say groups"
    if (spec.format, spec.code) != (fact.format, fact.code):
        return f"format {spec.format} ({spec.code}), the facts say {fact.format} ({fact.code})"
    if spec.members != fact.members:
        return f"members {list(spec.members)}, the facts say {list(fact.members)}"
    if (spec.carries.groups, spec.carries.state) != (fact.groups, fact.state):
        return (f"carries groups {spec.carries.groups}, state {spec.carries.state}; the facts say groups "
                f"{fact.groups}, state {fact.state}")
    return None
