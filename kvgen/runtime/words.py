"""Copy units: move KV as the widest integers the memory allows.

Index kernels on CPU spend their time per element, so viewing 2-byte values as
16-byte words cuts their work eightfold. A copy may use a word when each head's content (C
values) is a whole number of words and every tensor involved keeps its last dim
contiguous with all other strides in whole words.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

#: Word type per width. 16 bytes has no integer type; complex128 is moved by the same
#: copy kernels without arithmetic, so its bits pass through unchanged (tested with
#: every NaN pattern in tests/test_words.py).
_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.complex128}


@dataclass(frozen=True)
class Words:
    """The integer type a copy moves, and C (content per head) counted in it."""

    dtype: torch.dtype
    C: int


def widest(tensors: Iterable[torch.Tensor], c: int, limit: int = 16) -> int:
    """Bytes of the widest word (<= limit) that C values and all `tensors` allow."""
    tensors = list(tensors)
    size = tensors[0].element_size()
    width = limit
    while width > size:
        per = width // size
        if c % per == 0 and all(_fits(t, per) for t in tensors):
            return width
        width //= 2
    return size


def _fits(t: torch.Tensor, per: int) -> bool:
    if t.dim() == 0 or t.stride(-1) != 1 or t.shape[-1] % per:
        return False
    return all(s % per == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1], strict=True) if n > 1) \
        and t.storage_offset() % per == 0


def words(width: int, element_size: int, c: int) -> Words:
    return Words(_WORD[width], c * element_size // width)
