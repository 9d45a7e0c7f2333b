"""The cost model a remote plan chooses its strategy by: direct descriptors or staged blocks.

A read of `count` descriptors moving `nbytes` costs `count * per_descriptor + nbytes / wire`;
a staged plan adds the local permute, `nbytes_permuted / local + calls * per_permute`. The
defaults were measured on the development machine (one process, two NIXL agents, UCX,
DRAM) with `kvgen bench --remote --costs`, which prints the constants of the machine it runs
on; pass them as `Costs(...)` to `kvgen.remote.plan`, or set KVGEN_REMOTE_COSTS to a JSON
object of the same fields.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields

from kvgen.runtime.errors import KVLayoutError


@dataclass(frozen=True)
class Costs:
    #: Seconds NIXL spends per descriptor beyond moving its bytes.
    per_descriptor: float = 2.5e-6
    #: Bytes per second of a NIXL read in long descriptors.
    wire: float = 6.0e9
    #: Bytes per second of kvgen's compiled local transfer (the staging permute).
    local: float = 4.0e9
    #: Seconds per staging permute call (checks, description, kernel launch).
    per_permute: float = 2.0e-4

    def read(self, count: int, nbytes: int) -> float:
        return count * self.per_descriptor + nbytes / self.wire

    def permute(self, calls: int, nbytes: int) -> float:
        return calls * self.per_permute + nbytes / self.local


def costs() -> Costs:
    """The defaults, or KVGEN_REMOTE_COSTS's JSON fields over them."""
    raw = os.environ.get("KVGEN_REMOTE_COSTS")
    if not raw:
        return Costs()
    try:
        given = json.loads(raw)
        known = {f.name for f in fields(Costs)}
        unknown = set(given) - known
        if unknown:
            raise ValueError(f"unknown fields {sorted(unknown)} (known: {sorted(known)})")
        return Costs(**{k: float(v) for k, v in given.items()})
    except (ValueError, TypeError, AttributeError) as why:
        raise KVLayoutError(f"KVGEN_REMOTE_COSTS must be a JSON object of Costs fields: {why}") from why


__all__ = ["Costs", "costs"]
