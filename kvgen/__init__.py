"""kvgen: declarative KV-cache layout specs and generated connectors.

The generator half (spec loading, planning, rendering) never imports torch; the
generated connectors import only torch and :mod:`kvgen.runtime`.
"""

__version__ = "0.1.0"

#: Highest spec format version (`kvgen:` key) this release reads.
SPEC_FORMAT_VERSION = 2

__all__ = ["__version__", "SPEC_FORMAT_VERSION"]
