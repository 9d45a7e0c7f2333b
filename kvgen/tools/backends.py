"""What `kvgen list` and `kvgen explain` say about copy backends, told without importing torch."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil


def backends() -> dict[str, str]:
    """What a connector moves data with on each device type by default (backend=None), told
    without importing torch or triton: the generated Triton kernel on GPUs when triton is
    installed, torch ops otherwise; on the CPU the compiled CPU kernel where a C compiler is
    found (kvgen.runtime.native), torch ops otherwise."""
    gpu = "torch"
    if importlib.util.find_spec("triton") is not None:
        gpu = f"triton {importlib.metadata.version('triton')}"
    # The compiler kvgen.runtime.native would take: KVGEN_CC alone when set, else cc, gcc, clang.
    wanted = os.environ.get("KVGEN_CC")
    compiler = shutil.which(wanted) if wanted else next(filter(None, map(shutil.which, ("cc", "gcc", "clang"))), None)
    cpu = "native" if compiler and os.environ.get("KVGEN_NATIVE", "1") not in ("0", "", "off", "no") else "torch"
    if wanted and compiler is None:  # the user named a compiler: say that one is missing
        cpu = f"torch (KVGEN_CC={wanted}: no such compiler on PATH)"
    return {"cpu": cpu, "cuda": gpu, "xpu": gpu}


def backend_line(refused: bool = False) -> str:
    """One line for `kvgen list` and `kvgen explain`; `refused`: some of the connectors told of
    have a PROGRAM the compiled CPU kernel cannot run (each says why), so those use torch ops."""
    found = backends()
    if found["cpu"] == "native" and refused:
        found["cpu"] = "native (torch where a connector's PROGRAM says why not)"
    note = "" if found["cuda"] != "torch" else " (triton is not installed: pip install 'kvgen[triton]')"
    return ("copy backend (backend=None): " + ", ".join(f"{d} {b}" for d, b in found.items()) + note
            + "; backend='triton', 'native' or 'torch' forces one")
