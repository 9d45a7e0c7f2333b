"""Which mover moves a connector's chunks on a device: chosen once per (connector, device).

`backend=` names a mover ("native", "triton", "torch"; None: auto). Auto tries the movers
the device registry lists for the device type (kvgen.runtime.devices: native then torch on
the CPU, Triton then torch on GPUs) and takes the first whose `prepare` accepts the
connector there; a named one that cannot run is refused with the reason. At run time a
mover that meets a cache it cannot move (found before anything is written) hands the chunk
to the torch mover, unless it was named.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvgen.runtime import kernels, native
from kvgen.runtime.devices import device_kind
from kvgen.runtime.errors import KVLayoutError
from kvgen.runtime.movers.base import Mover, Unsupported
from kvgen.runtime.movers.native import NativeMover
from kvgen.runtime.movers.torch import TORCH
from kvgen.runtime.movers.triton import TritonMover

#: Every mover by the name `backend=` gives it: the one place names map to movers.
MOVERS: dict[str, Mover] = {m.name: m for m in (TritonMover(), NativeMover(), TORCH)}
#: What `backend=` accepts besides None (auto).
BACKENDS = tuple(MOVERS)


@dataclass(frozen=True)
class Chosen:
    """A connector's mover on one device, what it prepared, and whether `backend=` named it."""

    mover: Mover
    prepared: Any
    named: bool


def check_backend(requested: str | None, device: torch.device | None) -> None:
    """Refuse, when the connector is made, a `backend=` that names no mover, or a named mover
    that cannot run at all here (on `device`, where one is given)."""
    if requested is None:
        return
    if requested not in MOVERS:
        raise KVLayoutError(f"backend must be one of {', '.join(map(repr, BACKENDS))} or None (auto), "
                            f"got {requested!r}")
    why = _unavailable(requested, device)
    if why:
        raise KVLayoutError(f"backend={requested!r} cannot run here: {why}")


def _unavailable(name: str, device: torch.device | None) -> str | None:
    from_kind = {"native": _native_here, "triton": _triton_here}.get(name)
    return from_kind(device) if from_kind else None


def _native_here(device: torch.device | None) -> str | None:
    if device is not None and device.type != "cpu":
        return f"the compiled kernel moves CPU tensors only, not {device.type}"
    return native.unavailable()


def _triton_here(device: torch.device | None) -> str | None:
    if not kernels.triton_installed():
        return "triton is not installed (pip install 'kvgen[triton]')"
    return kernels.unavailable(device) if device is not None else None


def choose(connector: Any, device: torch.device, requested: str | None) -> Chosen:
    """The mover of `connector` on `device`: the named one, else the first the device's
    registry entry lists that accepts it (torch always does)."""
    if requested is not None:
        try:
            return Chosen(MOVERS[requested], MOVERS[requested].prepare(connector, device), True)
        except Unsupported as why:
            raise KVLayoutError(f"backend={requested!r} cannot run on {device}: {why}") from None
    kind = device_kind(device.type)
    for name in (kind.movers if kind is not None else ("torch",)):
        try:
            return Chosen(MOVERS[name], MOVERS[name].prepare(connector, device), False)
        except Unsupported:
            continue
    return Chosen(TORCH, TORCH.prepare(connector, device), False)


class MoverChoice:
    """The mover choice of a connector (mixed into ConnectorBase): cached per device."""

    copy_backend: str | None
    _movers: dict[torch.device, Chosen]

    def _init_movers(self, requested: str | None, device: torch.device | None) -> None:
        check_backend(requested, device)
        self.copy_backend = requested
        self._movers = {}

    def _mover_for(self, device: torch.device) -> Chosen:
        found = self._movers.get(device)
        if found is None:
            found = self._movers.setdefault(device, choose(self, device, self.copy_backend))
        return found

    def _pin(self, device: torch.device, name: str, prepared: Any) -> None:
        """Make mover `name`, with `prepared`, this connector's on `device` as auto would have
        chosen it (tools and tests hand it a kernel to launch or refuse)."""
        self._movers[device] = Chosen(MOVERS[name], prepared, False)

    def copy_backend_for(self, device: torch.device | str) -> str:
        """"triton", "native" or "torch": what this connector moves data with on `device`."""
        return self._mover_for(torch.device(device)).mover.name

    def _move(self, store: bool, tensor: torch.Tensor, call: Any, ck: Any, layer: int | None = None) -> None:
        """Move one chunk (one layer of it, when `layer` is given) with this device's mover;
        what it cannot move (nothing written yet) goes to the torch mover, unless it was named."""
        chosen = self._mover_for(call.g.device)
        try:
            chosen.mover.move(chosen.prepared, store, tensor, call, ck, layer)
        except Unsupported as why:
            if chosen.named:
                raise KVLayoutError(f"backend={chosen.mover.name!r} cannot move this cache: {why}") from None
            chosen.mover.stats["fallbacks"] = chosen.mover.stats.get("fallbacks", 0) + 1
            TORCH.move(self, store, tensor, call, ck, layer)
