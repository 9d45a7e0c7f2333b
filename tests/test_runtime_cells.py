"""runtime.slot_cell_field: the field view of block runs whose cells are slot-major with the K and V
sides outermost (vLLM NVFP4 under NHD): a view of the cache that writes through."""

from __future__ import annotations

import torch

from kvgen.runtime import slot_cell_field

B, N, H, CELL, DATA = 3, 4, 2, 9, 8  # cells of 8 data bytes then 1 scale byte


def page_bytes() -> torch.Tensor:
    """[B, N, 2H, CELL] uint8 whose byte at (b, i) of a page's run is (b * 64 + i) % 256."""
    run = N * 2 * H * CELL
    return ((torch.arange(B).reshape(-1, 1) * 64 + torch.arange(run)) % 256).to(torch.uint8).reshape(B, N, 2 * H, CELL)


def test_each_side_is_a_half_of_the_run_and_its_cells_are_slot_major() -> None:
    t = page_bytes()
    data, scale = slot_cell_field(t, 0, DATA), slot_cell_field(t, DATA, 1)
    assert data.shape == (B, 2, N, H, DATA) and scale.shape == (B, 2, N, H, 1)
    side, cells = N * H * CELL, N * H
    for b, kv, n, h in ((0, 0, 0, 0), (1, 1, 3, 1), (2, 0, 2, 1), (2, 1, 1, 0)):
        cell = n * H + h  # slot-major
        first = kv * side + cell * DATA
        assert int(data[b, kv, n, h, 0]) == (b * 64 + first) % 256
        assert int(scale[b, kv, n, h, 0]) == (b * 64 + kv * side + DATA * cells + cell) % 256


def test_the_view_writes_into_the_cache() -> None:
    t = page_bytes()
    slot_cell_field(t, DATA, 1)[1, 1, 2, 0] = 255
    assert int(t.flatten(1)[1, N * H * CELL + DATA * N * H + 2 * H]) == 255

