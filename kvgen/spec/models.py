"""Model specs (`kind: model`, format 2): the whole KV cache of one model as an engine keeps it.

A model's cache list (what the engine hands a connector, one entry per layer in the engine's
order) is split into *groups* and *state groups*:

* a group is a set of attention layers in one paged layout of the library, with its own
  geometry (heads, head size, block size) and its own block table, so a connector takes one
  slot mapping per group (vLLM's hybrid allocator: sliding-window and full-attention groups);
* a state group is a set of layers that keep per-request state (Mamba-2, gated delta net):
  each such layer's entry is a tuple of state tensors [S, *shape], indexed by request slot.

Geometry is declared at tensor parallelism 1, from the model's published config; a rank of
TP t holds H / t heads and state tensors whose `split` dim is divided by t.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvgen.spec.loader import Document
from kvgen.spec.model import ITEMSIZE, Vocabulary

#: The layer set of the group that takes every entry no other group or state group names.
OTHERS = "others"


class ModelKind(Vocabulary):
    MODEL = "model"


@dataclass(frozen=True)
class Group:
    """Attention layers in one layout with one geometry and one block table."""

    name: str
    layout: str
    #: Indices into the model's cache list, ascending.
    layers: tuple[int, ...]
    #: Fixed extents at TP 1: H, C, N, or C.PART for one part of a format-2 layout.
    sizes: tuple[tuple[str, int], ...]
    dtypes: tuple[str, ...]
    window: int | None = None
    #: Tokens one stored slot covers (vLLM's tokens_per_state > 1): the group's slot mapping has one
    #: entry per k tokens of a chunk, and a chunk starts and ends at multiples of k.
    tokens_per_slot: int = 1

    def size(self, axis: str) -> int | None:
        return dict(self.sizes).get(axis)


@dataclass(frozen=True)
class StateTensor:
    """One tensor of a state layer: [S, *shape], S the request slots."""

    name: str
    shape: tuple[int, ...]
    dtypes: tuple[str, ...]
    #: The dim of `shape` that tensor parallelism divides (None: every rank holds all of it).
    split: int | None = None
    #: Sizes at TP 1 of the sections the split dim concatenates, each divided by TP on its own
    #: (a Mamba conv state's x|B|C); None: the split dim is one section.
    sections: tuple[int, ...] | None = None

    def rank_shape(self, tp: int) -> tuple[int, ...]:
        if self.split is None or tp == 1:
            return self.shape
        return tuple(n // tp if i == self.split else n for i, n in enumerate(self.shape))

    def nbytes(self, dtype: str, tp: int = 1) -> int:
        """Bytes of one request's state in this tensor."""
        out = ITEMSIZE[dtype]
        for n in self.rank_shape(tp):
            out *= n
        return out


@dataclass(frozen=True)
class StateGroup:
    """Layers that keep per-request state, each as the same tuple of tensors."""

    name: str
    layers: tuple[int, ...]
    tensors: tuple[StateTensor, ...]


@dataclass(frozen=True)
class ModelSpec:
    """One model spec, as declared in its YAML file (layer sets resolved to indices)."""

    version: int
    name: str
    kind: ModelKind
    summary: str
    config: str | None
    layers: int
    groups: tuple[Group, ...]
    states: tuple[StateGroup, ...]
    engines: tuple[str, ...]
    source: str
    origin: str
    digest: str
    #: The groups overlay each other in one allocation (each block id owned by one group at a
    #: time): entries of different groups may share memory; entries of one group never do.
    overlaid: bool = False

    # What the cross-file rules ask of every spec: a model has no aliases and no format.
    aliases: tuple[str, ...] = ()
    format: str | None = None
    code: int | None = None
    accepts: tuple[str, ...] = ()

    @property
    def is_paged(self) -> bool:
        return False

    @property
    def group_names(self) -> tuple[str, ...]:
        return tuple(g.name for g in self.groups)

    @property
    def state_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.states)

    def arrow(self) -> str:
        """One line: `sliding vllm_flash_attn_nhd x18, full vllm_flash_attn_nhd x18 | state linear x36`."""
        text = ", ".join(f"{g.name} {g.layout} x{len(g.layers)}" for g in self.groups)
        if self.states:
            text += " | state " + ", ".join(f"{s.name} x{len(s.layers)}" for s in self.states)
        return text


def layer_indices(value: Any, total: int, taken: set[int]) -> tuple[int, ...]:
    """A layer set as sorted indices: a list, `{from, every, count}`, or "others" (every index
    below `total` not in `taken`). Indices past `total` are kept, for a pass to report."""
    if value == OTHERS:
        return tuple(i for i in range(total) if i not in taken)
    if isinstance(value, list):
        return tuple(sorted(value))
    start, every = value.get("from", 0), value["every"]
    stop = start + every * value["count"] if "count" in value else total
    return tuple(range(start, stop, every))


def build_model(doc: Document, origin: str | None = None) -> ModelSpec:
    """Typed view of a model document that passed the model schema."""
    d = doc.data
    raw = [("group", name, body) for name, body in d["groups"].items()]
    raw += [("state", name, body) for name, body in d.get("state", {}).items()]
    # Explicit sets first, so that "others" is what they leave.
    taken: set[int] = set()
    resolved: dict[str, tuple[int, ...]] = {}
    for _, name, body in sorted(raw, key=lambda r: r[2]["layers"] == OTHERS):
        resolved[name] = layer_indices(body["layers"], d["layers"], taken)
        taken.update(resolved[name])
    groups = tuple(Group(name, body["layout"], resolved[name], _sizes(body.get("sizes", {})),
                         tuple(body.get("dtypes", ())), body.get("window"), body.get("tokens_per_slot", 1))
                   for kind, name, body in raw if kind == "group")
    states = tuple(StateGroup(name, resolved[name],
                              tuple(StateTensor(t["name"], tuple(t["shape"]), tuple(t["dtypes"]), t.get("split"),
                                                _sections(t.get("sections")))
                                    for t in body["tensors"]))
                   for kind, name, body in raw if kind == "state")
    return ModelSpec(version=d["kvgen"], name=d["name"], kind=ModelKind(d["kind"]), summary=d["summary"],
                     config=d.get("config"), layers=d["layers"], groups=groups, states=states,
                     engines=tuple(d.get("engines", ())), source=doc.file, origin=origin or doc.file,
                     digest=hashlib.sha256(doc.text).hexdigest(), overlaid=d.get("overlaid", False))


def _sections(given: list[int] | None) -> tuple[int, ...] | None:
    return tuple(given) if given is not None else None


def _sizes(data: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    order = {"N": 0, "H": 1, "C": 2}
    return tuple(sorted(data.items(), key=lambda kv: (order.get(kv[0], 3), kv[0])))


def model_facts(model: ModelSpec) -> dict[str, object]:
    """A model as plain data (`kvgen list --json`, `kvgen explain`)."""
    return {
        "name": model.name, "kind": str(model.kind), "summary": model.summary, "config": model.config,
        "layers": model.layers,
        "groups": [{"name": g.name, "layout": g.layout, "layers": list(g.layers), "sizes": dict(g.sizes),
                    "dtypes": list(g.dtypes), "window": g.window, "tokens_per_slot": g.tokens_per_slot}
                   for g in model.groups],
        "state": [{"name": s.name, "layers": list(s.layers),
                   "tensors": [{"name": t.name, "shape": list(t.shape), "dtypes": list(t.dtypes), "split": t.split,
                                "sections": list(t.sections) if t.sections else None}
                               for t in s.tensors]} for s in model.states],
    }
