"""Memory-format converters: identities, composition, and store-by-one / load-by-another."""

from __future__ import annotations

import itertools

import pytest
import torch
from harness import EXT, clone_tree, make_cache, same_bits

from kvgen import generated
from kvgen.generated import formats
from kvgen.runtime import KVLayoutError, MemoryObj

L, T, H, C = 3, 5, 2, 4
SHAPES = {
    "kv_2ltd": (2, L, T, H * C), "kv_t2d": (T, 2, H * C), "kv_2td": (2, T, H * C),
    "kv_mla": (1, L, T, C), "kv_mla_layer": (T, C),
    "kv_1ltd": (1, L, T, H * C), "kv_1td": (T, H * C), "kv_mla_rows": (1, L, T, C), "kv_mla_rows_layer": (T, C),
    # format-2 regions objects: [L, R] bytes, R the bytes of one layer's regions
    "kv_planes": (L, 48), "kv_planes_layer": (48,),
}
PER_LAYER = {"kv_t2d", "kv_2td", "kv_mla_layer", "kv_1td", "kv_mla_rows_layer", "kv_planes_layer"}


def sample(name: str) -> object:
    if name in PER_LAYER:
        return [torch.randn(SHAPES[name]) for _ in range(L)]
    return torch.randn(SHAPES[name])


def equal(a: object, b: object) -> bool:
    if isinstance(a, list):
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    return torch.equal(a, b)


@pytest.mark.parametrize("pair", list(formats.CONVERSIONS), ids="->".join)
def test_there_and_back_is_identity(pair: tuple[str, str]) -> None:
    a, b = pair
    data = sample(a)
    assert equal(formats.convert(formats.convert(data, a, b), b, a), data)


TRIPLES = [(a, b, c) for a, b, c in itertools.permutations(["kv_2ltd", "kv_t2d", "kv_2td"], 3)]


@pytest.mark.parametrize("triple", TRIPLES, ids="->".join)
def test_composition_equals_direct(triple: tuple[str, str, str]) -> None:
    a, b, c = triple
    data = sample(a)
    assert equal(formats.convert(formats.convert(data, a, b), b, c), formats.convert(data, a, c))


def test_view_converter_shares_memory() -> None:
    assert formats.CONVERSIONS[("kv_mla", "kv_mla_layer")][1] == "view"
    whole = sample("kv_mla")
    layers = formats.convert(whole, "kv_mla", "kv_mla_layer")
    layers[1][0, 0] = 42.0
    assert whole[0, 1, 0, 0] == 42.0


def test_unknown_conversion_lists_known() -> None:
    with pytest.raises(KVLayoutError, match="known: "):
        formats.convert(sample("kv_2ltd"), "kv_2ltd", "kv_mla")


def test_stored_whole_loads_layerwise() -> None:
    """A chunk stored as KV_2LTD, converted to per-layer KV_T2D, loads like the original."""
    layout = "vllm_flash_attn_hnd"
    spec = generated.LAYOUTS[layout]
    assert spec["kind"] == "paged"
    from kvgen.spec.library import load_library

    paged = load_library()[layout]
    cache = make_cache(paged, torch.float32, "cpu")
    slots = torch.tensor([5, 6, 7, 8, 30, 31, 1, 2])
    whole = generated.get(layout, "kv_2ltd")()
    whole.bind(cache)
    obj = MemoryObj(torch.zeros(whole.get_shape(8)))
    whole.from_gpu(obj, 0, 8, kvcaches=cache, slot_mapping=slots)

    per_layer = formats.convert(obj.tensor, "kv_2ltd", "kv_t2d")
    target = clone_tree(cache)
    for t in target:
        t.zero_()
    expected = clone_tree(target)
    whole.to_gpu(obj, 0, 8, kvcaches=expected, slot_mapping=slots)

    layerwise = generated.get(layout, "kv_t2d")()
    gen = layerwise.batched_to_gpu([0], [8], kvcaches=target, slot_mapping=slots)
    next(gen)
    for layer in range(EXT["L"]):
        gen.send([MemoryObj(per_layer[layer], layerwise.format)])
    next(gen)
    assert same_bits(target, expected)
