"""The checks can see what a broken compiled path would do. Each mutant below changes the
native mover (or the compiled transfer) the way a planning or kernel bug would (a layer, a
plane or the tail of a chunk left unmoved); the reference comparisons every connector and
transfer test and `kvgen verify` make (oracle.scenarios.check_pair,
oracle.scenarios.transfers.check_transfer) must then fail on every case of that kind, and
pass on the same cases without the mutant."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from harness import SCENARIOS, builtin_library

from kvgen import generated
from kvgen.oracle.scenarios import check_pair
from kvgen.oracle.scenarios.transfers import SCENARIOS as TRANSFER_SCENARIOS
from kvgen.oracle.scenarios.transfers import TransferRun, check_transfer
from kvgen.runtime import native
from kvgen.runtime.movers.native import NativeMover
from kvgen.runtime.transfer import compiled

LIBRARY = builtin_library()

pytestmark = pytest.mark.skipif(bool(native.unavailable()), reason=f"no compiled kernel: {native.unavailable()}")


def _drop_last_layer(move: Callable[..., None]) -> Callable[..., None]:
    def mutant(self: Any, prepared: Any, store: bool, tensor: Any, call: Any, ck: Any, layer: int | None) -> None:
        if layer is not None and layer == call.g.L - 1:
            return
        move(self, prepared, store, tensor, call, ck, layer)
    return mutant


def _drop_tail(move: Callable[..., None]) -> Callable[..., None]:
    def mutant(self: Any, prepared: Any, store: bool, tensor: Any, call: Any, ck: Any, layer: int | None) -> None:
        if ck.has_tokens and not isinstance(ck.slots, slice) and len(ck.slots) > 0:
            cut = {k: getattr(ck, k)[:-1] for k in ("tok", "slots", "blk", "off") if getattr(ck, k) is not None}
            ck = dataclasses.replace(ck, moved=ck.moved - 1, **cut)
        move(self, prepared, store, tensor, call, ck, layer)
    return mutant


def _drop_last_plane(planes: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
    def mutant(*args: Any) -> list[Any]:
        return planes(*args)[:-1]
    return staticmethod(mutant)  # type: ignore[return-value]


#: mutant -> (the NativeMover attribute it replaces, how, connectors and scenarios it must be seen on)
MUTANTS: dict[str, tuple[str, Callable[[Any], Any], list[tuple[str, str, str]]]] = {
    "drops the last layer": ("move", _drop_last_layer,
                             [("vllm_flash_attn_nhd", "kv_t2d", "whole_blocks"),
                              ("vllm_mla", "kv_mla_layer", "partial_blocks"),
                              ("vllm_fp8_tensor_scales", "kv_planes_layer", "whole_blocks")]),
    "drops the tail of the chunk": ("move", _drop_tail,
                                    [("vllm_flash_attn_nhd", "kv_2ltd", "partial_blocks"),
                                     ("vllm_flash_attn_hnd", "kv_2ltd", "random_slots"),
                                     ("vllm_mla_fp8", "kv_mla_rows", "partial_blocks")]),
    "drops the last plane": ("_planes", _drop_last_plane,
                             [("vllm_fp8_tensor_scales", "kv_planes", "whole_blocks"),
                              ("vllm_mla_fp8", "kv_mla_rows", "partial_blocks"),
                              ("vllm_nvfp4", "kv_planes", "random_slots")]),
}


def _results(cases: list[tuple[str, str, str]]) -> Iterator[tuple[str, tuple[bool, bool]]]:
    for layout, obj, scenario in cases:
        connector = generated.get(layout, obj)(device="cpu")
        yield f"{layout}/{obj}/{scenario}", check_pair(connector, LIBRARY[layout], LIBRARY[obj], SCENARIOS[scenario])


@pytest.mark.parametrize("name", MUTANTS)
def test_the_reference_check_fails_every_case_of_a_mutant(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    attr, mutate, cases = MUTANTS[name]
    assert all(ok == (True, True) for _, ok in _results(cases)), "the cases must pass without the mutant"
    monkeypatch.setattr(NativeMover, attr, mutate(getattr(NativeMover, attr)))  # the plain function of either kind
    calls = native.stats["calls"]
    seen = dict(_results(cases))
    assert native.stats["calls"] > calls, "the mutated compiled path did not run"
    missed = [case for case, ok in seen.items() if ok == (True, True)]
    assert not missed, f"{name}: the reference check passed {missed}"


# ---------------------------------------------------------------- layout-to-layout transfers

TRANSFER_PAIRS = [("vllm_flash_attn_hnd", "vllm_flash_attn_nhd"), ("vllm_flash_attn_nhd", "hicache_page_first"),
                  ("vllm_mla", "sglang_mla")]


def _transfer_mutant(name: str, move: Callable[..., None]) -> Callable[..., None]:
    def mutant(d: Any, layer: int | None) -> None:
        if name == "drops a layer" and layer == 1:
            return
        if name == "drops the token path" and len(d.parts) > 1:
            d = dataclasses.replace(d, parts=d.parts[:-1])
        move(d, layer)
    return mutant


@pytest.mark.parametrize(("name", "scenario", "layerwise"), [("drops a layer", "whole_blocks", True),
                                                            ("drops the token path", "partial_ends", False)])
def test_the_transfer_reference_check_fails_every_pair_under_a_mutant(name: str, scenario: str, layerwise: bool,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    run = TransferRun(layerwise=layerwise)
    sc = TRANSFER_SCENARIOS[scenario]

    def results() -> dict[tuple[str, str], bool]:
        return {(s, d): check_transfer(generated, LIBRARY[s], LIBRARY[d], "cpu", sc, run) for s, d in TRANSFER_PAIRS}

    assert all(results().values()), "the pairs must pass without the mutant"
    monkeypatch.setattr(compiled, "move", _transfer_mutant(name, compiled.move))
    calls = native.stats["calls"]
    missed = [pair for pair, ok in results().items() if ok]
    assert native.stats["calls"] > calls, "the mutated compiled transfer did not run"
    assert not missed, f"{name}: the reference check passed {missed}"
