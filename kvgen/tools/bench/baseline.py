"""What a generated connector is measured against: a plain copy of the same bytes, and the
naive connector a developer would write by hand.

The naive connector reads only the spec facts (`kvgen.spec`), never the planner or the
generated code: per layer and per K/V plane it views the cache leaf as [B, N, H, C] (or
[S, H, C] for SGLang's folded slot axis), gathers the chunk's tokens with
`view[slot // N, slot % N]` (`index_select` over S), `torch.stack`s the planes and layers
into a temporary and copies that into the object; a load `index_put_`s (`index_copy_`
over S) each layer's plane of the object back at the same slots.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvgen.errors import KVLayoutError

Axes = tuple[tuple[str, ...], ...]


def memcpy(nbytes: int, device: Any) -> Callable[[], None]:
    """A flat `dst.copy_(src)` of `nbytes`: the speed limit of any connector on `device`."""
    # Both buffers are written first: reading never-touched memory maps the zero page and
    # would make the plain copy look faster than any real copy can be.
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)

    def copy() -> None:
        dst.copy_(src)

    return copy


def _names(dims: Axes) -> list[str]:
    out = []
    for axes in dims:
        if not axes:
            out.append("1")
        elif axes == ("B", "N"):
            out.append("S")
        else:
            out.extend(axes)
    return out


def axes_view(dims: Axes, tensor: torch.Tensor, ext: dict[str, int], fix: dict[str, int],
              order: Sequence[str]) -> torch.Tensor:
    """`tensor` (dims as declared) as a view with one dim per axis of `order`: fused dims
    split, singletons and the axes in `fix` selected away, absent axes (KV, H) as size 1."""
    t = tensor
    for i in reversed(range(len(dims))):
        if len(dims[i]) > 1 and dims[i] != ("B", "N"):
            t = t.unflatten(i, tuple(ext[a] for a in dims[i]))
    names = _names(dims)
    for i in reversed(range(len(names))):
        if names[i] == "1" or names[i] in fix:
            t = t.select(i, fix.get(names[i], 0))
            del names[i]
    for axis in order:
        if axis not in names:
            t = t.unsqueeze(-1)
            names.append(axis)
    if sorted(names) != sorted(order):
        raise KVLayoutError(f"naive baseline: cannot view axes {names} as {list(order)}")
    return t.permute(*[names.index(a) for a in order])


class NaiveConnector:
    """The usual hand-written connector, generic over layouts through their spec facts."""

    def __init__(self, paged: Any, obj: Any, ext: dict[str, int]):
        if any(a not in ("L", "KV") for a in paged.lists):
            raise KVLayoutError(f"naive baseline: list level of {paged.lists} not supported")
        self.paged, self.obj, self.ext = paged, obj, ext
        self.pdims: Axes = tuple(d.axes for d in paged.dims)
        self.odims: Axes = tuple(d.axes for d in obj.dims)
        self.folded = any(d.is_slot for d in paged.dims)
        self.layerwise = "L" in obj.lists
        self.L, self.KV = ext["L"], ext["KV"] if paged.has("KV") else 1

    def _cache_view(self, kvcaches: Any, layer: int, kv: int) -> torch.Tensor:
        fix = {"L": layer, "KV": kv}
        leaf = kvcaches
        for axis in self.paged.lists:
            leaf = leaf[fix[axis]]
        order = ("S", "H", "C") if self.folded else ("B", "N", "H", "C")
        return axes_view(self.pdims, leaf, self.ext, fix, order)

    def _object_view(self, tensor: torch.Tensor, num_tokens: int, per_layer: bool) -> torch.Tensor:
        ext = {**self.ext, "T": num_tokens}
        order = ("KV", "T", "H", "C") if per_layer else ("L", "KV", "T", "H", "C")
        return axes_view(self.odims, tensor, ext, {}, order)

    def _gather(self, view: torch.Tensor, slots: torch.Tensor, blk: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
        return view.index_select(0, slots) if self.folded else view[blk, off]

    def _scatter(self, view: torch.Tensor, slots: torch.Tensor, blk: torch.Tensor, off: torch.Tensor,
                 rows: torch.Tensor) -> None:
        if self.folded:
            view.index_copy_(0, slots, rows)
        else:
            view.index_put_((blk, off), rows)

    def _index(self, slot_mapping: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, ...]:
        slots = slot_mapping[start:end].long()
        n = self.ext["N"]
        return slots, slots // n, slots % n

    def store(self, objects: Any, start: int, end: int, kvcaches: Any, slot_mapping: torch.Tensor) -> None:
        """`objects`: one tensor, or a per-layer list of tensors (layerwise objects)."""
        slots, blk, off = self._index(slot_mapping, start, end)
        layers = []
        for layer in range(self.L):
            planes = [self._gather(self._cache_view(kvcaches, layer, kv), slots, blk, off) for kv in range(self.KV)]
            stacked = torch.stack(planes)  # [KV T H C]
            if self.layerwise:
                self._object_view(objects[layer], end - start, True).copy_(stacked)
            else:
                layers.append(stacked)
        if not self.layerwise:
            self._object_view(objects, end - start, False).copy_(torch.stack(layers))  # [L KV T H C]

    def load(self, objects: Any, start: int, end: int, kvcaches: Any, slot_mapping: torch.Tensor) -> None:
        slots, blk, off = self._index(slot_mapping, start, end)
        whole = None if self.layerwise else self._object_view(objects, end - start, False)
        for layer in range(self.L):
            part = self._object_view(objects[layer], end - start, True) if whole is None else whole[layer]
            for kv in range(self.KV):
                self._scatter(self._cache_view(kvcaches, layer, kv), slots, blk, off, part[kv])
