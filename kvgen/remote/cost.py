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
    # Measured 2026-12-01 by `kvgen bench --costs` on the development machine (2 busy cores,
    # UCX over shared memory): 1.66e-5 and 1.76e-5 s, 0.92e9 and 1.01e9 B/s, 1.25e9 and
    # 1.00e9 B/s, 8.7e-4 and 9.4e-4 s in two runs.
    #: Seconds NIXL spends per descriptor beyond moving its bytes.
    per_descriptor: float = 1.7e-5
    #: Bytes per second of a NIXL read in long descriptors.
    wire: float = 1.0e9
    #: Bytes per second of kvgen's compiled local transfer (the staging permute).
    local: float = 1.1e9
    #: Seconds per staging permute call (checks, description, kernel launch).
    per_permute: float = 9.0e-4

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
