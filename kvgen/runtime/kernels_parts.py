"""Launching the generated Triton kernels of format-2 connectors (caches of several planes).

The `_triton` twin of a format-2 connector holds one kernel per plane (kvgen.plan.kernel_parts)
and a `PlanesKernel` that moves a chunk with one launch per plane. Each plane moves as bytes
in the widest word (at most 8 bytes) that this call's object and the cache allow for it
(`runtime.plane_words`, the torch code's choice) and that divides the distance between its
leaves, so one table of leaf offsets in words reaches every layer.

Every plane's launch is prepared before the first one runs: a cache the kernels cannot
address raises Unsupported with nothing written, and the connector then moves the chunk
with its torch ops.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvgen.runtime.kernels import KERNEL_WORD, Kernel, Operands, leaf_words
from kvgen.runtime.layout import Geometry
from kvgen.runtime.planes import plane_words
from kvgen.runtime.slots import Chunk
from kvgen.runtime.words import Words, words

Leaves = Callable[[Any, Geometry, int], list[torch.Tensor]]


class PlanesKernel:
    """The kernels of one format-2 connector, one per plane, launched like one `Kernel`."""

    def __init__(self, leaves: Leaves, rows: bool, planes: Sequence[Kernel]):
        #: `leaves(kvcaches, g, plane)`: every layer's leaf holding the plane, in layer order.
        self.leaves, self.rows, self.planes = leaves, rows, tuple(planes)

    def __call__(self, store: bool, layer: int | None, tensor: torch.Tensor, call: Any, ck: Chunk, w: Words) -> None:
        """Move one chunk of `call` (of one layer, when layerwise): every plane, one launch each."""
        if not ck.has_blocks and not ck.has_tokens:
            return  # nothing moves, so neither do the planes without slots
        kvcaches, g = call.kvcaches, call.g
        wd = plane_words(g, tensor, self.rows)
        launches = []
        for i, kernel in enumerate(self.planes):
            tensors = self.leaves(kvcaches, g, i)
            pw = words(min(wd[i], KERNEL_WORD), 1, g.planes[i].C)
            pw = leaf_words(pw, 1, tensors, True)
            x, o = kernel.views(tensor, tensors[0], g, pw, ck.num_tokens)  # type: ignore[call-arg]
            launches.append((kernel, kernel.arguments(store, layer, Operands(x, o, tensors, g), ck, pw)))
        for kernel, (grid, args, device) in launches:
            kernel.launch(grid, args, device)
