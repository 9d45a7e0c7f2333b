"""kvgen: declarative KV-cache layout specs and generated connectors.

The generator half (spec loading, planning, rendering) never imports torch; the
generated connectors import only torch and :mod:`kvgen.runtime`.
"""

import importlib

__version__ = "0.1.0"

#: Highest spec format version (`kvgen:` key) this release reads.
SPEC_FORMAT_VERSION = 3

__all__ = ["__version__", "SPEC_FORMAT_VERSION", "detect", "from_sglang", "from_vllm"]


def __getattr__(name: str) -> object:
    """`kvgen.detect`, `kvgen.from_sglang` and `kvgen.from_vllm` on first use, so `import kvgen` stays torch-free."""
    lazy = {"detect": "kvgen.integrations.detect", "from_sglang": "kvgen.integrations.sglang.pools",
            "from_vllm": "kvgen.integrations.vllm"}
    if name in lazy:
        return getattr(importlib.import_module(lazy[name]), name)
    raise AttributeError(f"module 'kvgen' has no attribute {name!r}")
