"""Scenarios shared by the test suite and `kvgen verify`: coordinate-coded caches and objects,
slot mappings, and one run through a connector and through the reference (kvgen.oracle.reference),
one module per kind, as the reference has:

- `layouts`: connectors of a (layout, object) pair, both kinds PAIR_KINDS names (caches of one
  tensor tree, and caches of several parts or fields, whose caches and objects reference.planes
  codes byte by byte): `SCENARIOS`, `check_pair`, `move_pair`, `check_connector`, `fitted` (a scenario's extents
  fitted to a spec's split factors and slots per token), `manager_extents` (the blocks a slot mapping addresses);
- `transfers`: layout-to-layout transfers: `SCENARIOS`, `check_transfer`;
- `models`: model connectors: `SCENARIOS`, `check_model`;
- `common`: what they share: allocation as engines hand tensors out, bitwise comparison of trees.

This package exports the layouts kind's names and the common ones; the other kinds' are imported
from their modules (`kvgen.oracle.scenarios.transfers`, `kvgen.oracle.scenarios.models`).
"""

from kvgen.oracle.scenarios.common import allocate, block_table_mapping, clone_tree, same_bits, tensors_of
from kvgen.oracle.scenarios.layouts import (
    EXT,
    SCENARIOS,
    Scenario,
    at_odd_offsets,
    check_backends,
    check_connector,
    check_pair,
    connector_load,
    connector_store,
    fitted,
    make_cache,
    make_objects,
    manager_extents,
    move_pair,
    obj_tensors,
    reference_load,
    reference_store,
)

__all__ = ["EXT", "SCENARIOS", "Scenario", "allocate", "at_odd_offsets", "block_table_mapping",
           "check_backends", "check_connector", "check_pair", "clone_tree", "connector_load",
           "connector_store", "fitted", "make_cache", "make_objects", "manager_extents", "move_pair",
           "obj_tensors", "reference_load", "reference_store", "same_bits", "tensors_of"]
