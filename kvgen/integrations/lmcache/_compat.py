"""What kvgen takes from LMCache when it is installed, and stand-ins when it is not.

Only LMCache's pure-Python parts are imported (never its compiled transfer ops), so this
works on a CPU-only machine with `lmcache` installed without its dependencies.
"""

from __future__ import annotations

import abc
import importlib
from typing import Any

try:  # pragma: no cover - exercised by whichever environment runs the tests
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface as _Interface

    LMCACHE_AVAILABLE = True
    LMCACHE_IMPORT_ERROR: str | None = None
except Exception as exc:  # ImportError, or a missing dependency of LMCache's modules
    LMCACHE_AVAILABLE = False
    LMCACHE_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

    class _Interface:  # type: ignore[no-redef]
        """Stand-in for LMCache's GPUConnectorInterface when LMCache is not installed."""

#: The base every adapter subclasses: LMCache's own interface when importable.
GPUConnectorInterface: Any = _Interface


def lmcache_module(name: str) -> Any | None:
    """An LMCache module by dotted name, or None when LMCache (or that module) is absent."""
    if not LMCACHE_AVAILABLE:
        return None
    try:
        return importlib.import_module(name)
    except Exception:
        return None


def register_virtual_subclass(ours: type, module: str, name: str) -> None:
    """Make `isinstance(connector, lmcache.<module>.<name>)` hold for our class, so LMCache's
    own checks (e.g. `assert_layerwise_gpu_connector`) accept kvgen's connectors. LMCache's
    connector classes are ABCs, so this only adds to their isinstance answer."""
    found = lmcache_module(module)
    theirs = getattr(found, name, None) if found is not None else None
    if isinstance(theirs, abc.ABCMeta):
        theirs.register(ours)
