"""The Triton mover: launches the connector's generated kernel (its `_triton` twin, planned
by kvgen.plan.kernel from the same copy plan) over the views the connector's PROGRAM places,
imported on first use so kvgen needs Triton for nothing else. Where Triton runs is the device
registry's fact (kvgen.runtime.devices: the driver targets of each device type); on CPU
tensors only in Triton's interpreter (TRITON_INTERPRET=1, which the tests use), and auto never
picks it there.
"""

from __future__ import annotations

from typing import Any

import torch

from kvgen.runtime import kernels
from kvgen.runtime.movers.base import Unsupported
from kvgen.runtime.slots import Chunk


def generated_module(connector: Any) -> str:
    """The generated module a connector class comes from (a subclass of it may live elsewhere)."""
    for cls in type(connector).__mro__:
        if "program" in cls.__dict__:
            return cls.__module__
    return type(connector).__module__


class TritonMover:
    """Moves chunks with the connector's generated Triton kernel, as its PROGRAM places them."""

    name = "triton"
    stats = kernels.stats

    def prepare(self, connector: Any, device: torch.device) -> tuple[Any, Any]:
        why = kernels.unavailable(device)
        if why is not None:
            raise Unsupported(why)
        try:
            kernel = kernels.kernel_of(generated_module(connector))
        except ModuleNotFoundError as exc:
            raise Unsupported(f"no kernel module was generated for this connector ({exc}); run `kvgen build`") \
                from None
        if isinstance(kernel, kernels.Refused):
            raise Unsupported(f"no Triton kernel for this connector: {kernel.why}")
        return connector, kernel

    def move(self, prepared: tuple[Any, Any], store: bool, tensor: torch.Tensor, call: Any, ck: Chunk,
             layer: int | None) -> None:
        connector, kernel = prepared
        kernel(connector.program, kernels.Step(store, tensor, call, ck, layer, connector._words(tensor, call.binding)))
