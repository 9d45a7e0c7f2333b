"""kvgen inside other systems.

- :mod:`kvgen.integrations.detect`: which kvgen layout a live cache is (also `kvgen.detect`
  and `kvgen detect`), from the specs' own facts, refusing rather than guessing.
- :mod:`kvgen.integrations.lmcache`: drop-in replacements for LMCache's GPU connectors
  (`kvgen[lmcache]`), built on the generated connectors.
"""
