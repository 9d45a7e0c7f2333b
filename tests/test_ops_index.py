"""take_index / put_index, the block copies of every generated connector's torch path (and of
the transfers' block path): the same values as index_select / index_copy_ over any dim of a
strided view, and always asked of torch over dim 0 (its CPU kernels go element by element
over another dim of a strided view: ~200x slower on a HiCache page-first layer view)."""

from __future__ import annotations

import pytest
import torch

from kvgen.runtime import ops


def coded(shape: tuple[int, ...]) -> torch.Tensor:
    """Values that encode their coordinates (a transposition or a wrong row shows)."""
    t = torch.zeros(shape, dtype=torch.int64)
    for d, n in enumerate(shape):
        t += torch.arange(n).view(*([1] * d), n, *([1] * (len(shape) - d - 1))) * 10 ** (len(shape) - 1 - d)
    return t


def layer_view() -> torch.Tensor:
    """[KV S H C] of one layer of a [KV S L H C] cache: dims 0 and 1 strided."""
    return coded((2, 9, 3, 4, 5))[:, :, 1]


INDEXES = [torch.tensor([7, 0, 3, 8]), torch.tensor([2]), slice(3, 7)]


@pytest.mark.parametrize("index", INDEXES, ids=["tensor", "one", "slice"])
@pytest.mark.parametrize("dim", [0, 1, 2, 3])
def test_take_index_matches_index_select_on_a_strided_view(dim: int, index: torch.Tensor | slice) -> None:
    x = layer_view()
    if isinstance(index, torch.Tensor):
        index = index[index < x.shape[dim]]
        want = torch.index_select(x, dim, index)
    else:
        index = slice(min(index.start, x.shape[dim] - 1), min(index.stop, x.shape[dim]))
        want = x.narrow(dim, index.start, index.stop - index.start)
    out = torch.full(want.shape, -1, dtype=x.dtype)
    ops.take_index(x, dim, index, out)
    assert torch.equal(out, want)


@pytest.mark.parametrize("index", INDEXES, ids=["tensor", "one", "slice"])
@pytest.mark.parametrize("dim", [0, 1, 2, 3])
def test_put_index_matches_index_copy_on_a_strided_view(dim: int, index: torch.Tensor | slice) -> None:
    base = coded((2, 9, 3, 4, 5))
    want_base = base.clone()
    x, want = base[:, :, 1], want_base[:, :, 1]
    if isinstance(index, torch.Tensor):
        index = index[index < x.shape[dim]]
        n = index.numel()
    else:
        index = slice(min(index.start, x.shape[dim] - 1), min(index.stop, x.shape[dim]))
        n = index.stop - index.start
    shape = list(x.shape)
    shape[dim] = n
    src = -coded(tuple(shape)) - 1
    if isinstance(index, torch.Tensor):
        want.index_copy_(dim, index, src)
    else:
        want.narrow(dim, index.start, n).copy_(src)
    ops.put_index(x, dim, index, src)
    assert torch.equal(base, want_base)  # the other layers untouched too


def test_index_ops_are_asked_of_torch_over_dim_0_only(monkeypatch: pytest.MonkeyPatch) -> None:
    dims: list[int] = []
    select, copy = torch.index_select, torch.Tensor.index_copy_

    def spy_select(t: torch.Tensor, dim: int, index: torch.Tensor, **kw: object) -> torch.Tensor:
        dims.append(dim)
        return select(t, dim, index, **kw)

    def spy_copy(self: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        dims.append(dim)
        return copy(self, dim, index, src)

    monkeypatch.setattr(torch, "index_select", spy_select)
    monkeypatch.setattr(torch.Tensor, "index_copy_", spy_copy)
    x, index = layer_view(), torch.tensor([3, 0, 2])
    for dim in (1, 2):
        shape = list(x.shape)
        shape[dim] = 3
        ops.take_index(x, dim, index, torch.empty(shape, dtype=x.dtype))
        ops.put_index(x, dim, index, torch.zeros(shape, dtype=x.dtype))
    assert dims and set(dims) == {0}
