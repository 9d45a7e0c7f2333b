"""Which copy path a transfer takes: the compiled CPU kernel by default where it runs, the
generated torch copies where it cannot describe the caches (and refused, before any write,
when copy_backend='native' was asked for), a wrong copy_backend refused by name."""

from __future__ import annotations

import pytest
import torch
from harness import builtin_library

from kvgen import generated
from kvgen.errors import KVLayoutError
from kvgen.oracle.reference import transfers
from kvgen.oracle.scenarios import clone_tree, same_bits
from kvgen.oracle.scenarios.transfers import DST_EXT, SRC_EXT, make_cache
from kvgen.runtime import native

LIBRARY = builtin_library()
HND, NHD = LIBRARY["vllm_flash_attn_hnd"], LIBRARY["vllm_flash_attn_nhd"]
T = generated.transfer("vllm_flash_attn_hnd", "vllm_flash_attn_nhd")
S, D = torch.tensor([0, 1, 2, 3, 9, 17]), torch.tensor([4, 5, 6, 7, 0, 30])

pytestmark = pytest.mark.skipif(bool(native.unavailable()), reason=f"no compiled kernel: {native.unavailable()}")


def _caches(mixed: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    src = make_cache(HND, SRC_EXT, torch.float32, "cpu")
    dst = make_cache(NHD, DST_EXT, torch.float32, "cpu", 10000)
    if mixed:  # layer 1 of the source with other strides than layer 0: one description cannot serve both
        t = src[1]
        big = torch.zeros(t.shape[0], t.shape[1] + 1, *t.shape[2:])
        src[1] = big[:, 1:]
        src[1].copy_(t)
    return src, dst


def _want(src: list[torch.Tensor], dst: list[torch.Tensor]) -> list[torch.Tensor]:
    want = clone_tree(dst)
    transfers.transfer(transfers.TransferSide(HND, SRC_EXT, src, S.tolist()),
        transfers.TransferSide(NHD, DST_EXT, want, D.tolist()))
    return want


@pytest.mark.parametrize("layerwise", [False, True])
def test_auto_moves_cpu_caches_with_the_compiled_kernel(layerwise: bool) -> None:
    src, dst = _caches()
    want = _want(src, dst)
    calls = native.stats["calls"]
    t = T()
    if layerwise:
        assert sum(1 for _ in t.copy_layers(src, S, dst, D)) == SRC_EXT["L"] + 1
    else:
        t.copy(src, S, dst, D)
    assert native.stats["calls"] > calls and same_bits(dst, want)


def test_caches_the_kernel_cannot_describe_fall_back_to_torch() -> None:
    src, dst = _caches(mixed=True)
    want = _want(src, dst)
    fallbacks = native.stats["fallbacks"]
    T().copy(src, S, dst, D)
    assert native.stats["fallbacks"] == fallbacks + 1 and same_bits(dst, want)


def test_a_forced_compiled_copy_refuses_them_before_writing() -> None:
    src, dst = _caches(mixed=True)
    before = clone_tree(dst)
    with pytest.raises(KVLayoutError, match="copy_backend='native' cannot move these caches: cache tensors differ"):
        T(copy_backend="native").copy(src, S, dst, D)
    with pytest.raises(KVLayoutError, match="copy_backend='native'"):
        next(T(copy_backend="native").copy_layers(src, S, dst, D))
    assert same_bits(dst, before)


def test_torch_is_taken_when_asked_for() -> None:
    src, dst = _caches()
    want = _want(src, dst)
    calls = native.stats["calls"]
    T(copy_backend="torch").copy(src, S, dst, D)
    assert native.stats["calls"] == calls and same_bits(dst, want)


def test_an_unknown_copy_backend_is_refused() -> None:
    with pytest.raises(KVLayoutError, match="one of 'torch', 'native' or None .auto., got 'triton'"):
        T(copy_backend="triton")


def test_a_layerwise_transfer_picks_its_threads_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading the host's load once per call, not once per layer (it costs a /proc read)."""
    from kvgen.runtime.transfer import compiled

    asked: list[int] = []

    def counting(nbytes: int, *args: int) -> int:
        asked.append(nbytes)
        return 1

    monkeypatch.setattr(compiled, "cpu_threads", counting)
    src, dst = _caches()
    want = _want(src, dst)
    assert sum(1 for _ in T().copy_layers(src, S, dst, D)) == SRC_EXT["L"] + 1
    assert SRC_EXT["L"] > 1 and len(asked) == 1 and same_bits(dst, want)


@pytest.mark.parametrize("layerwise", [False, True])
def test_threads_share_a_transfer_and_move_exactly_what_one_does(layerwise: bool,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Three threads, each a share of the first dim, on a team of four: the description puts
    a dim of at least four entries first (a layer's KV pair alone would idle two threads), and
    every slot pair still arrives once."""
    from kvgen.runtime.transfer import compiled

    monkeypatch.setattr(compiled, "cpu_threads", lambda nbytes, *args: 3)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    src, dst = _caches()
    want = _want(src, dst)
    t = T(copy_backend="native")
    if layerwise:
        assert sum(1 for _ in t.copy_layers(src, S, dst, D)) == SRC_EXT["L"] + 1
    else:
        t.copy(src, S, dst, D)
    assert same_bits(dst, want)
