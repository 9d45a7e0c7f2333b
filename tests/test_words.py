"""Copy units: wide words move every bit pattern unchanged, NaNs included."""

from __future__ import annotations

import pytest
import torch

from kvgen.runtime import put_rows, take_rows
from kvgen.runtime.planes import as_words
from kvgen.runtime.words import widest, words


def every_pattern() -> torch.Tensor:
    """All 65536 16-bit patterns (every bf16/fp16 NaN and infinity among them), shuffled."""
    g = torch.Generator().manual_seed(0)
    raw = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    return raw[torch.randperm(raw.numel(), generator=g)]


@pytest.mark.parametrize("width", [2, 4, 8, 16])
def test_index_ops_keep_bits(width: int) -> None:
    raw = every_pattern().view(-1, 64)  # 1024 rows of 128 bytes
    w = words(width, 2, 64)
    src = raw.view(w.dtype)
    index = torch.randperm(src.shape[0])
    out = torch.empty_like(src)
    take_rows(src, index, out)
    assert torch.equal(out.view(torch.int16), raw[index])
    back = torch.empty_like(src)
    put_rows(back, index, out)
    assert torch.equal(back.view(torch.int16), raw)


def test_widest_respects_strides_and_content() -> None:
    t = torch.zeros(4, 8, 128, dtype=torch.bfloat16)
    assert widest([t], 128) == 16
    assert widest([t], 4) == 8            # 4 bf16 values per head: 8 bytes
    assert widest([t[:, :, 1:]], 127) == 2   # odd content: element by element
    assert widest([t.transpose(0, 2)], 128) == 2  # last dim not contiguous


@pytest.mark.parametrize(("offset", "width"), [(0, 16), (1, 2), (2, 4), (4, 8), (8, 16), (12, 8)])
def test_widest_respects_storage_offset(offset: int, width: int) -> None:
    """A view starting `offset` bf16 values into its storage allows words that divide its
    start; the chosen word view must exist and move the same bits."""
    buf = every_pattern()[: 4 * 8 * 128 + 16].view(torch.bfloat16)
    t = buf[offset:offset + 4 * 8 * 128].view(4, 8, 128)
    assert widest([t], 128) == width
    assert widest([torch.zeros(4, 8, 128, dtype=torch.bfloat16), t], 128) == width
    rows = t.view(32, 128)
    wide = rows.view(words(width, 2, 128).dtype)  # raises if the width does not fit the start
    index = torch.arange(31, -1, -1)
    out = torch.empty_like(wide)
    take_rows(wide, index, out)
    assert torch.equal(out.view(torch.int16), rows.view(torch.int16)[index])


def test_plane_words_view_a_single_row_with_an_odd_row_stride() -> None:
    """A one-token chunk of a row-packed object: its row stride (30 bytes) is no whole word,
    but a dim of one element addresses nothing, so the 4-byte view of its plane is allowed.
    (Found by test_planes_properties: the view raised.)"""
    from kvgen.runtime.planes import as_words

    big = torch.arange(60, dtype=torch.uint8)
    plane = big.as_strided((1, 4), (30, 1), 4)
    words = as_words(plane, 4)
    assert words.shape == (1, 1) and words.view(torch.uint8).tolist() == [[4, 5, 6, 7]]
    words.fill_(0)
    assert big[4:8].tolist() == [0, 0, 0, 0] and big[3] == 3 and big[8] == 8


def test_an_empty_chunk_of_rows_views_as_words_whatever_its_row_stride() -> None:
    """A plane of a rows object whose rows are not whole words (SGLang's 324-byte fp4 MLA rows):
    a chunk of no tokens addresses nothing, so its row stride does not stop the word view."""
    rows = torch.zeros(0, 324, dtype=torch.uint8).narrow(1, 0, 288)
    assert as_words(rows, 8).shape == (0, 36)
