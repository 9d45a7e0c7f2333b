"""Test helpers: the machinery lives in kvgen.oracle.scenarios, shared with `kvgen verify`."""

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
