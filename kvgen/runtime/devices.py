"""The device registry: per device type, one `DeviceKind` with its backend (streams, events,
waits, synchronization, pinned memory), its presence probe, the widest copy word, the Triton
targets that run on it and the movers auto tries there. A device is one registration.

Generated connectors talk only to this module, never to `torch.cuda` or `torch.xpu`,
so one connector serves every device. CPU work is synchronous, so its backend does
nothing. Intel XPU uses native `torch.xpu` (torch >= 2.5); intel-extension-for-pytorch
is imported only when installed, for older stacks that need it.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from kvgen.runtime.errors import KVLayoutError


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


def _stream_device_missing(kind: str, label: str) -> Callable[[torch.device], str | None]:
    """A probe for CUDA or XPU: None when `device` is there, else what is missing."""

    def probe(device: torch.device) -> str | None:
        if kind == "xpu":
            _load_ipex()
        api = getattr(torch, kind, None)
        if api is None:
            return f"this torch ({torch.__version__}) has no {label} support (torch.{kind} is missing)"
        if kind == "cuda" and torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            return f"this torch ({torch.__version__}) was built without CUDA"
        if not api.is_available():
            return (f"torch finds no {label} device (torch.{kind}.is_available() is False: no device, no driver, "
                    f"or the devices are hidden from this process)")
        count = api.device_count()
        if device.index is not None and device.index >= count:
            return f"there is no {device}: {count} {label} device{'s' if count != 1 else ''} present"
        return None

    return probe


def _present(device: torch.device) -> str | None:
    return None


@dataclass(frozen=True)
class DeviceKind:
    """Everything kvgen knows of one device type: adding a device is one `register_device`."""

    type: str
    #: Its streams, copies and synchronization, for a device of this type.
    backend: Callable[[torch.device], Backend]
    #: None when a device is present, else what is missing.
    probe: Callable[[torch.device], str | None] = _present
    #: Widest copy word of the torch path: 16-byte words are complex128, which Intel GPUs
    #: without native FP64 may not index, so devices stop at 8-byte integers unless told.
    word: int = 8
    #: The Triton driver targets whose kernels run on it (kvgen.runtime.kernels.unavailable).
    triton: tuple[str, ...] = ()
    #: The movers auto tries, in order (kvgen.runtime.movers.choose); the last always runs.
    movers: tuple[str, ...] = ("torch",)


_DEVICES: dict[str, DeviceKind] = {
    # Triton runs CPU tensors only in its interpreter, which auto never picks: native, then torch.
    "cpu": DeviceKind("cpu", lambda device: CpuBackend(), word=16, movers=("native", "torch")),
    "cuda": DeviceKind("cuda", lambda device: StreamBackend("cuda", device), _stream_device_missing("cuda", "CUDA"),
                       word=16, triton=("cuda", "hip"), movers=("triton", "torch")),
    "xpu": DeviceKind("xpu", lambda device: (_load_ipex(), StreamBackend("xpu", device))[1],
                      _stream_device_missing("xpu", "XPU"), triton=("xpu",), movers=("triton", "torch")),
}


def register_device(kind: DeviceKind) -> None:
    """Add or replace a device type."""
    _DEVICES[kind.type] = kind


def register_backend(device_type: str, factory: Callable[[torch.device], Backend],
                     probe: Callable[[torch.device], str | None] | None = None) -> None:
    """Add or replace the backend of a device type (tests use a recording fake), keeping its
    other facts; `probe` says whether a device of that type is present (None) or what is missing."""
    old = _DEVICES.get(device_type)
    kind = DeviceKind(device_type, factory) if old is None else replace(old, backend=factory)
    register_device(replace(kind, probe=probe or _present))


def device_kind(device_type: str) -> DeviceKind | None:
    """The facts of a device type; None for one kvgen has no backend for."""
    return _DEVICES.get(device_type)


def backend_for(device: torch.device | str) -> Backend:
    device = torch.device(device)
    try:
        return _DEVICES[device.type].backend(device)
    except KeyError:
        raise KVLayoutError(f"no kvgen backend for device type {device.type!r}; "
                            f"known: {', '.join(sorted(_DEVICES))}") from None


def check_device(device: torch.device | str | int) -> torch.device:
    """`device` as a torch.device, refused with KVLayoutError (before any transfer) when it
    names no device type, one kvgen has no backend for, or one that is not present here."""
    known = ", ".join(sorted(_DEVICES))
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        hint = " (an NVIDIA GPU is 'cuda', an Intel GPU 'xpu')" if str(device).lower().startswith("gpu") else ""
        raise KVLayoutError(f"device {device!r} is not a device torch knows{hint}; kvgen connectors run on: {known} "
                            f"(present here: {', '.join(available_devices())})") from None
    if parsed.type not in _DEVICES:
        raise KVLayoutError(f"device {str(parsed)!r}: kvgen has no backend for device type {parsed.type!r}; "
                            f"known: {known}")
    missing = _DEVICES[parsed.type].probe(parsed)
    if missing:
        raise KVLayoutError(f"device {str(parsed)!r} is not available here: {missing} "
                            f"(present here: {', '.join(available_devices())})")
    return parsed


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
