"""What the scenarios of every kind share: tensors allocated as engines hand them out (strided,
or one element into their storage), trees of tensors cloned and compared bit for bit, and the
vLLM-style block-table slot mapping.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import torch

from kvgen.runtime.binding import leaves
from kvgen.runtime.ops import bits


def block_table_mapping(seq_len: int, rng: random.Random, ext: dict[str, int]) -> list[int]:
    """vLLM-style: the sequence fills blocks in random order, N slots each."""
    blocks = rng.sample(range(ext["B"]), ext["B"])
    return [blocks[i // ext["N"]] * ext["N"] + i % ext["N"] for i in range(seq_len)]


def allocate(shape: Sequence[int], dtype: torch.dtype, device: str, strided: bool,
             odd_offset: bool = False) -> torch.Tensor:
    """A tensor of `shape`; when strided, a view into a larger buffer with every dim
    permuted and a storage offset, as engines hand out per-layer views; with odd_offset,
    contiguous but starting one element into its storage (so no wider word fits it)."""
    if odd_offset:
        flat = torch.zeros(math.prod(shape) + 1, dtype=dtype, device=device)
        return flat[1:].view(tuple(shape))
    if not strided:
        return torch.zeros(tuple(shape), dtype=dtype, device=device)
    rev = tuple(reversed(shape))
    big = torch.zeros((rev[0] + 1, *rev[1:]), dtype=dtype, device=device)[1:]
    return big.permute(*reversed(range(len(shape))))


def clone_tree(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    return type(tree)(clone_tree(t) for t in tree)


#: Every tensor of a cache or object tree, in order (the runtime's own walk).
tensors_of = leaves


def same_bits(a: Any, b: Any) -> bool:
    return all(torch.equal(bits(x).cpu(), bits(y).cpu()) for x, y in zip(tensors_of(a), tensors_of(b), strict=True))
