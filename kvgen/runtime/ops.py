"""Tiny tensor helpers the generated copies share."""

from __future__ import annotations

import torch

_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t` viewed as integers of the same width: copies then move bits exactly, and dtypes
    without index kernels on some devices (float8 on CPU) take the same path."""
    if not t.dtype.is_floating_point and not t.dtype.is_complex:
        return t
    return t.view(_SAME_WIDTH_INT[t.element_size()])


def put_tokens(dst: torch.Tensor, dim: int, tok: torch.Tensor | None, src: torch.Tensor) -> None:
    """Write `src` into `dst` at token positions `tok` along `dim` (all of them when None)."""
    if tok is None:
        dst.copy_(src)
    else:
        dst.index_copy_(dim, tok, src)


def take_tokens(src: torch.Tensor, dim: int, tok: torch.Tensor | None) -> torch.Tensor:
    """The token positions `tok` of `src` along `dim` (all of them when None)."""
    return src if tok is None else src.index_select(dim, tok)
