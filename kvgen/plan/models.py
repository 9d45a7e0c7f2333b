"""Model connectors, decided at build time: one per (model, `pack: groups` object) pair.

For each pair the planner picks every carried group's *member* (the first of the object's
members the build has a whole-chunk connector for, with the group's layout), and writes the
table the generated module holds: per group its layers, member object and member connector
module, declared sizes, dtypes and window; per carried state group its layers and tensors.
A pair is not generated when a carried group has no member, or when the object names a group
or state group the model lacks; `kvgen.plan.package.skipped_models` says why. No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvgen.errors import KVLayoutError
from kvgen.spec.library import Library
from kvgen.spec.model import Pack, Spec
from kvgen.spec.models import Group, ModelSpec

#: A runtime table entry's fields, in the order the runtime's dataclass declares them.
Fields = tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class ModelPlan:
    """One generated model connector module."""

    model: ModelSpec
    obj: Spec
    #: Per carried group, in model order: the fields of runtime.GroupTable.
    groups: tuple[Fields, ...]
    #: Per carried state group, in model order: the fields of runtime.StateTable.
    states: tuple[Fields, ...]
    #: Member objects, by group name (for `kvgen explain` and the docs).
    members: tuple[tuple[str, str], ...]
    #: Other groups objects of this model whose sections are a prefix of this one's:
    #: (object name, module), reachable by Connector.view_as as views.
    views: tuple[tuple[str, str], ...] = ()

    @property
    def module(self) -> str:
        # Spec names never hold "__", so this is unique per pair (like connector modules).
        return f"{self.model.name}__{self.obj.name}"

    @property
    def object_fields(self) -> Fields:
        return (("name", self.obj.name), ("format", self.obj.format), ("code", self.obj.code),
                ("accepts", self.obj.accepts), ("lists", ()), ("dims", ()), ("pack", str(self.obj.pack)))

    @property
    def sources(self) -> tuple[Any, ...]:
        return (self.model, self.obj)

    @property
    def group_names(self) -> tuple[str, ...]:
        """Every group of the model, in model order (slot mappings given as a sequence follow it)."""
        return self.model.group_names

    @property
    def carried(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return (tuple(dict(g)["name"] for g in self.groups), tuple(dict(s)["name"] for s in self.states))


def whole_chunk_pairs(connectors: Sequence[Any]) -> dict[tuple[str, str], str]:
    """(layout, object) -> connector module, for the whole-chunk connectors of a build."""
    return {(c.paged.name, c.obj.name): c.module for c in connectors if str(c.mode) == "whole"}


def _member(library: Library, obj: Spec, layout: str, pairs: dict[tuple[str, str], str]) -> Spec | None:
    for name in obj.members:
        try:
            member = library[name]
        except KVLayoutError:
            continue
        if (layout, member.name) in pairs:
            return member
    return None


def _group_fields(g: Group, layout: Spec, member: Spec, module: str) -> tuple[tuple[str, Any], ...]:
    """The GroupTable fields of one carried group; a ratio only where there is one, so every
    other module reads as before."""
    fields = (("name", g.name), ("layers", g.layers), ("layout", layout.name), ("member", member.name),
              ("module", module), ("sizes", g.sizes), ("dtypes", g.dtypes or layout.dtypes), ("window", g.window))
    return fields + ((("tokens_per_slot", g.tokens_per_slot),) if g.tokens_per_slot != 1 else ())


def plan_model(library: Library, model: ModelSpec, obj: Spec,
               pairs: dict[tuple[str, str], str]) -> ModelPlan | str:
    """The plan of one pair, or why it is not generated."""
    assert obj.carries is not None
    for which, have in (("groups", model.group_names), ("state", model.state_names)):
        wanted = getattr(obj.carries, which)
        if isinstance(wanted, tuple):
            lacking = [n for n in wanted if n not in have]
            if lacking:
                kind = "group" if which == "groups" else "state group"
                return f"{obj.name} carries {kind} {', '.join(map(repr, lacking))}, which {model.name} lacks"
    groups, members = [], []
    carried = set(obj.carries.pick(obj.carries.groups, model.group_names))
    for g in model.groups:
        if g.name not in carried:
            continue
        layout = library[g.layout]
        member = _member(library, obj, layout.name, pairs)
        if member is None:
            return (f"group {g.name!r} ({layout.name}) has no member: the build has no whole-chunk connector "
                    f"from {layout.name} to any of {', '.join(obj.members)}")
        members.append((g.name, member.name))
        groups.append(_group_fields(g, layout, member, pairs[(layout.name, member.name)]))
    carried_states = set(obj.carries.pick(obj.carries.state, model.state_names))
    states = tuple((("name", s.name), ("layers", s.layers),
                    ("tensors", tuple((t.name, t.shape, t.dtypes, t.split) for t in s.tensors)))
                   for s in model.states if s.name in carried_states)
    return ModelPlan(model, obj, tuple(groups), states, tuple(members))


def _prefix_views(plans: list[ModelPlan]) -> list[ModelPlan]:
    """Each plan with the other objects of its model whose sections are a prefix of its own
    (kv_groups_attention of kv_groups): same groups and members, state groups a prefix."""
    out = []
    for p in plans:
        views = tuple((q.obj.name, q.module) for q in plans
                      if q is not p and q.model is p.model and q.groups == p.groups
                      and q.states == p.states[:len(q.states)])
        out.append(ModelPlan(p.model, p.obj, p.groups, p.states, p.members, views))
    return out


def plan_models(library: Library, connectors: Sequence[Any]) -> tuple[list[ModelPlan], list[tuple[str, str, str]]]:
    """Every model connector of a build, and (model, object, why) for each pair left out."""
    pairs = whole_chunk_pairs(connectors)
    plans: list[ModelPlan] = []
    skipped: list[tuple[str, str, str]] = []
    for model in library.models:
        for obj in library.objects:
            if obj.pack is not Pack.GROUPS:
                continue
            planned = plan_model(library, model, obj, pairs)
            if isinstance(planned, str):
                skipped.append((model.name, obj.name, planned))
            else:
                plans.append(planned)
    return _prefix_views(plans), skipped


__all__ = ["ModelPlan", "plan_model", "plan_models", "whole_chunk_pairs"]
