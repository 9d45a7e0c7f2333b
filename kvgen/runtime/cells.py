"""Format-3 block fields whose cells are slot-major with the K and V sides outermost in the run:
vLLM 0.33's NVFP4 pages under an NHD KVCacheLayout (vllm/v1/attention/backends/flashinfer.py
`_nvfp4_kv_views`), stored [B, N, 2H, C] but read as the page's K half, then its V half, each
every (slot, head) cell's data, then every cell's scales."""

from __future__ import annotations

import torch

from kvgen.runtime.planes import cell_field


def slot_cell_field(t: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    """The field at `offset` (`nbytes` per cell) of `t`, which ends in (N, [KV, H], C) and whose
    (N, 2H, C) elements per block are one run of bytes: that run's halves are the K and V sides,
    each N x H cells slot-major. Returns [..., 2, N, H, nbytes], a view of `t` (the generated
    geometry reader has refused a cache whose runs are not dense, byte_rows(run=3), and the
    regrouping of N and 2H is a `view`, which raises rather than copies)."""
    n, slots, c = t.shape[-3:]
    return cell_field(t.view(*t.shape[:-3], 2 * n, slots // 2, c), offset, nbytes, True)
