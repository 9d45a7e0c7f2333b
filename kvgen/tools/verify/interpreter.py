"""Triton's interpreter as `kvgen verify --backend triton --device cpu` and the tests run it.

The interpreter runs every program instance of a launch in Python, one numpy call per Triton
operation. By default it also checks every 32-bit integer add, subtract and multiply for
overflow, which costs about 40% of its time on kvgen's kernels. Those checks cannot fire here:
every address kvgen's kernels compute is 64-bit (block ids, slots and token positions are
widened before they meet a stride), and the 32-bit values left (program ids, a tile's lanes, a
row's word offsets: a head or channel index times its stride inside one token's row) stay far
below 2**31 in the caches the scenarios build, a few kilobytes each. (What keeps a launch
inside its tensors is the connector's check of every cache and object against its storage,
kvgen.runtime.aliasing, before any mover runs; it runs as before.)
"""

from __future__ import annotations

import dataclasses
import importlib.util


def skip_overflow_checks() -> bool:
    """Switch the interpreter's 32-bit overflow checks off for this process; False when this
    Triton has no interpreter options to change (the checks then stay on)."""
    if importlib.util.find_spec("triton") is None:
        return False
    # triton: optional, and only where a kernel runs in its interpreter
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if not dataclasses.is_dataclass(options) or not hasattr(options, "sanitize_overflow"):
        return False
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True
