"""One small backend per device type: streams, events, waits, synchronization, pinned memory.

Generated connectors talk only to this module, never to `torch.cuda` or `torch.xpu`,
so one connector serves every device. CPU work is synchronous, so its backend does
nothing. Intel XPU uses native `torch.xpu` (torch >= 2.5); intel-extension-for-pytorch
is imported only when installed, for older stacks that need it.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch


class Backend(Protocol):
    name: str

    def new_stream(self) -> Any: ...
    def current_stream(self) -> Any: ...
    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]: ...
    def wait_stream(self, waiter: Any, stream: Any) -> None: ...
    def synchronize(self, stream: Any) -> None: ...
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...
    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...


class CpuBackend:
    """Synchronous device: no streams, nothing to wait for."""

    name = "cpu"

    def new_stream(self) -> None:
        return None

    def current_stream(self) -> None:
        return None

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def wait_stream(self, waiter: Any, stream: Any) -> None:
        pass

    def synchronize(self, stream: Any) -> None:
        pass

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)


class StreamBackend:
    """CUDA and XPU: the same stream API under `torch.cuda` / `torch.xpu`."""

    def __init__(self, name: str, device: torch.device):
        self.name = name
        self.device = device
        self.api = getattr(torch, name)

    def new_stream(self) -> Any:
        return self.api.Stream(device=self.device)

    def current_stream(self) -> Any:
        return self.api.current_stream(self.device)

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return self.api.stream(stream)

    def wait_stream(self, waiter: Any, stream: Any) -> None:
        waiter.wait_stream(stream)

    def synchronize(self, stream: Any) -> None:
        stream.synchronize()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        # Host memory is pinned by the caller; the copy is ordered on the current stream.
        dst.copy_(src, non_blocking=True)

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)


def _load_ipex() -> None:
    """Import intel-extension-for-pytorch when torch lacks native XPU support and IPEX is
    installed (the `kvgen[ipex]` extra); native torch.xpu needs nothing."""
    if not hasattr(torch, "xpu") and importlib.util.find_spec("intel_extension_for_pytorch"):
        importlib.import_module("intel_extension_for_pytorch")


_FACTORIES: dict[str, Callable[[torch.device], Backend]] = {
    "cpu": lambda device: CpuBackend(),
    "cuda": lambda device: StreamBackend("cuda", device),
    "xpu": lambda device: (_load_ipex(), StreamBackend("xpu", device))[1],
}


def register_backend(device_type: str, factory: Callable[[torch.device], Backend]) -> None:
    """Add or replace the backend for a device type (tests use a recording fake)."""
    _FACTORIES[device_type] = factory


def backend_for(device: torch.device | str) -> Backend:
    device = torch.device(device)
    try:
        return _FACTORIES[device.type](device)
    except KeyError:
        raise ValueError(f"no kvgen backend for device type {device.type!r}; "
                         f"known: {', '.join(sorted(_FACTORIES))}") from None


def available_devices() -> list[str]:
    """Device types present here, CPU first: what `kvgen verify` and the tests run on."""
    found = ["cpu"]
    if torch.cuda.is_available():
        found.append("cuda")
    _load_ipex()
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        found.append("xpu")
    return found


@contextlib.contextmanager
def on_stream(backend: Backend, stream: Any) -> Iterator[None]:
    """Run on `stream` after the work already queued on the current stream."""
    backend.wait_stream(stream, backend.current_stream())
    with backend.use_stream(stream):
        yield
