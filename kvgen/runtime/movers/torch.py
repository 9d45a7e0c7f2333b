"""The torch mover: runs the generated module's own `_store` / `_load` (or `_store_layer` /
`_load_layer`), the torch ops the planner wrote from the same plan as PROGRAM, which view the
cache and the object at PROGRAM's places (`runtime.placed`; a format-2 cache's planes: the
byte views the module writes, each at its plane program's places, `PROGRAM.planes[i]`), so an
altered PROGRAM moves other bytes here too. It is the
readable reference a reviewer checks against the spec, the path of every device without a
kernel, and the fallback of the other movers for a cache they cannot move.

On the CPU the ops run with the intra-op threads `cpu_threads` picks for their size (each op
is a parallel region whose barrier costs a scheduling slice on a busy host).
"""

from __future__ import annotations

from typing import Any

import torch

from kvgen.runtime.slots import Chunk
from kvgen.runtime.threads import cpu_threads, intra_op_threads


class TorchMover:
    """Moves chunks with the connector's generated torch ops."""

    name = "torch"
    stats = {"calls": 0, "fallbacks": 0}

    def prepare(self, connector: Any, device: torch.device) -> Any:
        return connector

    def move(self, connector: Any, store: bool, tensor: torch.Tensor, call: Any, ck: Chunk,
             layer: int | None) -> None:
        self.stats["calls"] += 1
        g = call.g
        w = connector._words(tensor, call.binding)
        if layer is None:
            copy = connector._store if store else connector._load
            args: tuple[Any, ...] = (tensor, call.kvcaches, g, ck, w)
        else:
            copy = connector._store_layer if store else connector._load_layer
            args = (layer, tensor, call.kvcaches, g, ck, w)
        if tensor.device.type != "cpu":
            copy(*args)
            return
        op_bytes = tensor.numel() * tensor.element_size() // (1 if layer is not None else g.L)
        with intra_op_threads(cpu_threads(op_bytes)):
            copy(*args)


TORCH = TorchMover()
