"""kvgen: declarative KV-cache layout specs and generated connectors.

The generator half (spec loading, planning, rendering) never imports torch; the
generated connectors import only torch and :mod:`kvgen.runtime`.
"""

__version__ = "0.1.0"

#: Highest spec format version (`kvgen:` key) this release reads.
SPEC_FORMAT_VERSION = 2

__all__ = ["__version__", "SPEC_FORMAT_VERSION", "detect"]


def __getattr__(name: str) -> object:
    """`kvgen.detect` on first use, so `import kvgen` stays torch-free."""
    if name == "detect":
        import importlib  # a lazy attribute, not an import of kvgen's root: the root stays torch-free

        return importlib.import_module("kvgen.integrations.detect").detect
    raise AttributeError(f"module 'kvgen' has no attribute {name!r}")
