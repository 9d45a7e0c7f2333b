"""The checks a model connector runs on its inputs before anything moves: the cache list, each
group's declared geometry, the state tensors, the slot mappings, the state slots and the
objects. Each refusal is a KVLayoutError naming the group, state group or cache-list entry.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvgen.runtime.errors import KVLayoutError
from kvgen.runtime.layout import Geometry, broadcast_dims, describe
from kvgen.runtime.memory import check_relabel, format_name
from kvgen.runtime.model.table import GroupTable, StateTable, dtype_name


def entries(model: str, layers: int, kvcaches: Any) -> tuple[Any, ...]:
    """The engine's cache list: one entry per layer of the model, in engine order."""
    if not isinstance(kvcaches, (list, tuple)):
        raise KVLayoutError(f"{model}: kvcaches must be the engine's list of {layers} per-layer cache entries, "
                            f"got {describe(kvcaches)}")
    if len(kvcaches) != layers:
        raise KVLayoutError(f"{model}: kvcaches must hold {layers} entries (one per layer, engine order), got "
                            f"{len(kvcaches)}")
    return tuple(kvcaches)


def group_where(g: GroupTable) -> str:
    shown = ", ".join(map(str, g.layers[:6])) + (", ..." if len(g.layers) > 6 else "")
    return f"group {g.name!r} (cache-list entries {shown})"


def check_declared(model: str, g: GroupTable, geometry: Geometry, tp: int, first_part: str | None) -> None:
    """A group's cache against what the model declares at TP 1 (heads divided by tp); C.PART
    against that part's plane (a part of fields has the width its spec fixes)."""
    have = {"H": geometry.H, "C": geometry.C, "N": geometry.N}
    parts = {p.name: p.values for p in geometry.planes if p.values is not None}
    for key, value in g.sizes:
        axis, _, part = key.partition(".")
        got = have.get(axis) if not part else parts.get(part)
        want = value // tp if axis == "H" else value
        if got is not None and got != want:
            at = f" (so {want} at tp={tp})" if want != value else ""
            raise KVLayoutError(f"{model}: {group_where(g)}: {key} is {got}, the model declares "
                                f"{key} = {value}{at}")
    if first_part is None and dtype_name(geometry.dtype) not in g.dtypes:
        raise KVLayoutError(f"{model}: {group_where(g)}: cache dtype {dtype_name(geometry.dtype)} is not one the "
                            f"model declares for it ({', '.join(g.dtypes)})")


@dataclass(frozen=True)
class StateFacts:
    """What the bound state tensors say: each tensor's dtype (per state group, layer, tensor) and S."""

    dtypes: tuple[tuple[tuple[torch.dtype, ...], ...], ...]
    slots: int | None


def _check_state_tensor(t: Any, spec: Any, tp: int, device: torch.device | None, label: str) -> None:
    """One state tensor: [S, *rank shape] of a declared dtype, with storage, on `device`, not expanded."""
    _, _, allowed, _ = spec
    shape = StateTable.rank_shape(spec, tp)
    want = f"[S, {', '.join(map(str, shape))}] {' or '.join(allowed)}"
    if not isinstance(t, torch.Tensor) or tuple(t.shape[1:]) != shape or t.dim() != len(shape) + 1:
        raise KVLayoutError(f"{label} must be {want}" + (f" at tp={tp}" if tp > 1 else "") + f", got {describe(t)}")
    if dtype_name(t.dtype) not in allowed:
        raise KVLayoutError(f"{label} must be {want}, got dtype {dtype_name(t.dtype)}")
    if t.device.type == "meta" or (device is not None and t.device != device):
        raise KVLayoutError(f"{label} must be on the caches' device {device}, got {t.device}")
    if broadcast_dims(t):
        raise KVLayoutError(f"{label} has dims {broadcast_dims(t)} with stride 0 (an expanded view); "
                            "each request needs its own state")


class _StateSlots:
    """The request slots every state tensor holds: the first tensor's count, which the others must match."""

    def __init__(self) -> None:
        self.slots: int | None = None
        self.first = ""

    def check(self, t: torch.Tensor, label: str) -> None:
        if self.slots is None:
            self.slots, self.first = t.shape[0], label
        elif t.shape[0] != self.slots:
            raise KVLayoutError(f"{label} has {t.shape[0]} request slots, {self.first} has {self.slots}: every "
                                "state tensor is indexed by the same request slots")


def check_states(model: str, states: Sequence[StateTable], items: tuple[Any, ...], tp: int,
                 device: torch.device | None) -> tuple[StateFacts, list[torch.Tensor], list[str]]:
    """Every carried state entry: a tuple of its tensors, each [S, *rank shape] of a declared
    dtype on the caches' device, one S for all. Returns the facts, the tensors and their names."""
    dtypes: list[tuple[tuple[torch.dtype, ...], ...]] = []
    tensors: list[torch.Tensor] = []
    names: list[str] = []
    slots = _StateSlots()
    for s in states:
        per_layer = []
        for layer in s.layers:
            entry = items[layer]
            where = f"{model}: state {s.name!r}, kvcaches[{layer}]"
            if not isinstance(entry, (list, tuple)) or len(entry) != len(s.tensors):
                raise KVLayoutError(f"{where} must be a tuple of {len(s.tensors)} state tensors "
                                    f"({', '.join(t[0] for t in s.tensors)}), got {describe(entry)}")
            for j, (spec, t) in enumerate(zip(s.tensors, entry, strict=True)):
                label = f"{where}[{j}] ({spec[0]})"
                _check_state_tensor(t, spec, tp, device, label)
                slots.check(t, label)
                device = t.device if device is None else device
                tensors.append(t)
                names.append(f"kvcaches[{layer}][{j}]")
            per_layer.append(tuple(t.dtype for t in entry))
        dtypes.append(tuple(per_layer))
    return StateFacts(tuple(dtypes), slots.slots), tensors, names


def _by_name(model: str, group_names: Sequence[str], carried: Sequence[str],
             slot_mappings: Mapping[str, Any]) -> dict[str, Any]:
    unknown = [k for k in slot_mappings if k not in group_names]
    if unknown:
        raise KVLayoutError(f"{model}: slot_mappings names {unknown[0]!r}, not a group of the model "
                            f"(groups: {', '.join(group_names)})")
    missing = [g for g in carried if g not in slot_mappings]
    if missing:
        raise KVLayoutError(f"{model}: slot_mappings lacks group {missing[0]!r}: give one slot mapping per "
                            f"group ({', '.join(group_names)}; all -1 moves nothing)")
    return {g: slot_mappings[g] for g in carried}


def _in_model_order(model: str, group_names: Sequence[str], carried: Sequence[str],
                    slot_mappings: Sequence[Any]) -> dict[str, Any]:
    if len(slot_mappings) != len(group_names):
        raise KVLayoutError(f"{model}: slot_mappings must hold {len(group_names)} slot mappings, one per group "
                            f"in model order ({', '.join(group_names)}), got {len(slot_mappings)}")
    return {g: slot_mappings[group_names.index(g)] for g in carried}


def mappings(model: str, group_names: Sequence[str], carried: Sequence[str], slot_mappings: Any,
             tokens_per_slot: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The slot mapping of each carried group: a mapping by group name, or a sequence in the
    model's group order. Lengths are checked with each group's tensor: all cover the same tokens,
    a group of `tokens_per_slot` k with one entry per k of them."""
    if isinstance(slot_mappings, Mapping):
        out = _by_name(model, group_names, carried, slot_mappings)
    elif isinstance(slot_mappings, (list, tuple)):
        out = _in_model_order(model, group_names, carried, slot_mappings)
    else:
        raise KVLayoutError(f"{model}: slot_mappings must be a dict of group name -> slot mapping, or a list in "
                            f"the model's group order ({', '.join(group_names)}), got {describe(slot_mappings)}")
    ratio = tokens_per_slot or {}
    lengths = {g: m.shape[0] for g, m in out.items() if isinstance(m, torch.Tensor) and m.dim() == 1}
    if len({n * ratio.get(g, 1) for g, n in lengths.items()}) > 1:
        shown = ", ".join(f"{g}: {n}" + (f" (x{ratio[g]} tokens)" if ratio.get(g, 1) != 1 else "")
                          for g, n in lengths.items())
        raise KVLayoutError(f"{model}: every group's slot mapping covers the same tokens; lengths differ ({shown})")
    return out


def state_slots(model: str, given: Any, chunks: int, slots: int | None, carries_state: bool,
                storing: bool = True) -> list[int | None]:
    """One request slot (or None) per chunk, each in range; a load writes each slot from one
    chunk at most (whichever came last would win)."""
    if given is None:
        return [None] * chunks
    if not isinstance(given, (list, tuple)) or len(given) != chunks:
        raise KVLayoutError(f"{model}: state_slots must hold one request slot (or None) per chunk ({chunks}), "
                            f"got {describe(given)}")
    out: list[int | None] = []
    for k, slot in enumerate(given):
        if slot is None:
            out.append(None)
            continue
        if isinstance(slot, bool):
            raise KVLayoutError(f"{model}: state slot of chunk {k} must be an integer, got {slot!r}")
        try:
            slot = operator.index(slot)
        except TypeError:
            raise KVLayoutError(f"{model}: state slot of chunk {k} must be an integer, got {slot!r}") from None
        if not carries_state:
            raise KVLayoutError(f"{model}: this object carries no state; pass state_slot=None")
        if slots is None or not 0 <= slot < slots:
            raise KVLayoutError(f"{model}: state slot {slot} of chunk {k} is out of range: the state tensors hold "
                                f"{slots} request slots (0..{(slots or 0) - 1})")
        if not storing and slot in out:
            raise KVLayoutError(f"{model}: state slot {slot} is loaded from chunks {out.index(slot)} and {k}: only "
                                "one would survive; give each chunk its own state slot, or None")
        out.append(slot)
    return out


def _labelled_bytes(obj: Any, k: int, memory: Any, storing: bool) -> Any:
    """The `.tensor` of a labelled memory object whose label `memory` allows (before a store:
    its own or one it accepts; for a load: its own)."""
    tensor = getattr(obj, "tensor", None)
    metadata = getattr(obj, "metadata", None)
    if not isinstance(tensor, torch.Tensor) or not hasattr(metadata, "fmt"):
        raise KVLayoutError(f"memory object for chunk {k} must be a tensor or have .tensor and .metadata.fmt, "
                            f"got {describe(obj)}")
    try:
        current = format_name(metadata.fmt)
    except TypeError:
        raise KVLayoutError(f"memory object format label must be None or have a .name (expected "
                            f"{memory.format}), got {metadata.fmt!r}") from None
    if storing and current != memory.format and current not in memory.accepts:
        raise KVLayoutError(f"cannot store {memory.format} into an object labelled {current}; allowed labels "
                            f"before a store: {', '.join([memory.format, *memory.accepts])}")
    if storing:
        check_relabel(metadata, f"memory object for chunk {k}")
    if not storing and current != memory.format:
        raise KVLayoutError(f"cannot load an object labelled {current}: this connector reads {memory.format}")
    return tensor


def object_bytes(obj: Any, k: int, memory: Any, nbytes: int, storing: bool) -> torch.Tensor:
    """Chunk k's object: a 1-D uint8 tensor of `nbytes` (plain, or as `.tensor` of a labelled
    memory object whose label `memory` allows)."""
    tensor = obj if isinstance(obj, torch.Tensor) else _labelled_bytes(obj, k, memory, storing)
    if tensor.dtype != torch.uint8 or tensor.dim() != 1 or tensor.shape[0] != nbytes:
        raise KVLayoutError(f"memory object for chunk {k} must be {memory.name} [{nbytes}] uint8 (bytes), got "
                            f"{describe(tensor)}")
    if tensor.device.type == "meta":
        raise KVLayoutError(f"memory object for chunk {k} must have storage, got a tensor on {tensor.device}")
    if nbytes > 1 and tensor.stride(0) != 1:
        raise KVLayoutError(f"memory object for chunk {k} must be contiguous bytes, got stride {tensor.stride(0)}")
    return tensor
