"""A generated package, imported from its folder under a name of its own (verify and detect read
packages other than kvgen.generated)."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from kvgen.errors import KVGenError, display_path

_PREFIX = "_kvgen_verified_"


def import_package(out: Path) -> ModuleType:
    """The package at `out`, imported under a name of its own: the folder's name need not be
    an identifier, and two packages with the same folder name never shadow each other."""
    shown = display_path(out)
    if not out.exists():
        raise KVGenError(f"--out {shown} does not exist; write a package there with `kvgen build --out {shown}`")
    if not out.is_dir():
        raise KVGenError(f"--out {shown} is not a folder; give the folder `kvgen build --out` wrote")
    init = out / "__init__.py"
    if not init.is_file():
        raise KVGenError(f"--out {shown} is not a Python package (no __init__.py); "
                         "give the folder `kvgen build --out` wrote")
    out = out.resolve()
    name = _PREFIX + hashlib.sha256(str(out).encode()).hexdigest()[:16]
    for stale in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[stale]  # a package rebuilt since it was last verified in this process
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(out)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise KVGenError(f"cannot import the package at {shown}: {type(exc).__name__}: {exc}") from None
    if not isinstance(getattr(module, "CONNECTORS", None), dict) or not callable(getattr(module, "get", None)):
        raise KVGenError(f"--out {shown} is not a package written by kvgen build (it has no CONNECTORS table)")
    return module
