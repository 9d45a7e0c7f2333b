"""What every mover is: the protocol the connectors call, and the one refusal they share.

A mover moves one chunk (or one layer of it) between a memory object's tensor and a bound
cache by executing the connector's planned copy: the generated module's PROGRAM (for the torch
mover through the generated `_store` / `_load`, written from the same plan, whose views PROGRAM
places; for the Triton mover with the kernel and launch facts of the module's `_triton` twin). It is chosen once
per (connector, device) by kvgen.runtime.movers.choose; `prepare` does, once, what does not
depend on a call (is the mover here, does it move this connector, its kernel), and `move`
runs a call with the live tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:  # slots needs the compiled kernel's module, which needs this one
    from kvgen.runtime.slots import Chunk


class Unsupported(Exception):
    """A mover that cannot run a connector here, or a cache or chunk it cannot move; raised
    before anything is written, so the torch mover can move it instead."""


class Mover(Protocol):
    #: The name `backend=` asks for it by.
    name: str
    #: Counters tests read: calls (or launches) and fallbacks to the torch mover.
    stats: dict[str, int]

    def prepare(self, connector: Any, device: torch.device) -> Any:
        """What `move` needs for this connector on `device`; Unsupported (saying why) when this
        mover cannot run it there."""
        ...

    def move(self, prepared: Any, store: bool, tensor: torch.Tensor, call: Any, ck: Chunk,
             layer: int | None) -> None:
        """Move chunk `ck` of `call` (the connector's binding, frozen cache tree and geometry)
        into `tensor` (store) or out of it (load); one layer of a per-layer object when
        `layer` is given. Unsupported, with nothing written, when it cannot."""
        ...
