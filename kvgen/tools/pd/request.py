"""What `kvgen pd` moves: the two sides (layout, TP size, block size) and the request, shared by
the command line (kvgen.tools.pd.command, torch-free) and the processes that run it (kvgen.tools.pd.run)."""

from __future__ import annotations

from dataclasses import dataclass

#: Descriptor size of the plain NIXL copy the transfer is measured against.
PLAIN = 4 << 20


@dataclass(frozen=True)
class WorkerSide:
    layout: str
    tp: int
    N: int
    #: Heads per group, for a cache that holds its heads in groups (SGLang's page_unified pool in
    #: head groups: head_num / head_group_num); 1 elsewhere.
    g: int = 1


@dataclass(frozen=True)
class Request:
    src: WorkerSide
    dst: WorkerSide
    tokens: int
    layers: int = 32
    heads: int = 8
    head_size: int = 128
    dtype: str = "bfloat16"
    seed: int = 0
    strategy: str | None = None
    repeats: int = 3
    #: Send each decode rank's cache back with its result (small requests: tests check them).
    keep: bool = False
