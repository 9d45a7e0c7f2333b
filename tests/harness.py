"""Test helpers: the machinery lives in kvgen.oracle.scenarios, shared with `kvgen verify`."""

from functools import cache

from kvgen.oracle.scenarios import (  # noqa: F401
    EXT,
    SCENARIOS,
    Scenario,
    allocate,
    at_odd_offsets,
    block_table_mapping,
    clone_tree,
    connector_load,
    connector_store,
    make_cache,
    make_objects,
    obj_tensors,
    reference_load,
    reference_store,
    same_bits,
    tensors_of,
)
from kvgen.spec.library import Library, load_library


@cache
def builtin_library() -> Library:
    """The built-in specs, loaded and checked once per test process and shared by the modules
    that read them at import (a Library and its specs are frozen). A load reads and
    schema-checks every YAML file: ~0.2 s, paid by each of ~35 modules at collection, in
    each xdist worker. Tests of loading itself call load_library."""
    return load_library()
