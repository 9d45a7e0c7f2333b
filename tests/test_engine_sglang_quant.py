"""SGLang 0.5.23's quantized pools as the oracle: MHATokenToKVPoolFP4 and MLATokenToKVPoolFP4,
built with SGLang's classes on CPU and written with the pool's own write path (`set_kv_buffer`,
which quantizes through FP4MXBlock16KVQuantizeUtil: packed fp4 values, one UE8M0 scale per 16).

kvgen stores the pool's packed bytes and scales as they are into kv_planes objects and loads them
into a fresh pool at other slots; SGLang's own read path (`get_key_buffer` / `get_value_buffer`,
which dequantize) must then read there what it reads at the original slots, and the raw bytes
must agree with a pool SGLang wrote at those slots itself. The spec's own address arithmetic
(kvgen.oracle.address) decodes every value, and with the scale SGLang's source assigns it (byte
16-group of the token's flattened row) must give what SGLang's dequantization gives; a nibble
swap in the spec fails that. Values grow with their token (a scale per token and group), and
differ with head and position, so a scale moved with another token changes what SGLang reads.

Runs in .venv-sglang (`scripts/dev engines`, or /work/main/.venv-sglang/bin/python -m pytest);
elsewhere it skips, saying why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from harness import builtin_library, sglang_absent

try:
    from sglang.srt.mem_cache import memory_pool as mp
    from sglang.srt.runtime_context import get_parallel
except Exception as exc:  # noqa: BLE001 - any failure of SGLang's import chain
    sglang_absent(exc, "memory pools")

import kvgen  # noqa: E402
from kvgen.oracle.address import packed_value, plane_address  # noqa: E402
from kvgen.runtime import KVLayoutError, MemoryObj  # noqa: E402
from kvgen.spec.model import Packing, Spec  # noqa: E402

LIBRARY = builtin_library()
L, H, PAGE, SIZE, HEAD, LATENT = 2, 3, 16, 48, 128, 576
ROWS = SIZE + PAGE
SLOTS = torch.tensor([17, 3, 40, 16, 31, 63, 50, 5])
AGAIN = torch.tensor([60, 1, 33, 20, 7, 45, 28, 12])
T = len(SLOTS)
#: e2m1 magnitudes of codes 0..7 (bit 3 is the sign), as FP4MXBlock16KVQuantizeUtil decodes them.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


class Layer:
    """What set_kv_buffer reads of SGLang's RadixAttention: the layer id."""

    def __init__(self, layer_id: int):
        self.layer_id = layer_id


@pytest.fixture(autouse=True, scope="module")
def eager_quantizer() -> Iterator[None]:
    """SGLang's quantize and dequantize functions are torch.compile'd. On a CPU, compiling them is
    Dynamo's trace and an Inductor build of C++ for each pool class (3 s of this module's 10),
    for the same element-wise ops on the same tensors: here they run eagerly."""
    import torch._dynamo

    with torch._dynamo.config.patch(disable=True):
        yield


@contextmanager
def one_rank() -> Iterator[None]:
    with get_parallel().override(attn_dcp_size=1, dcp_enabled=False):
        yield


def values(layer: int, kv: int, slots: torch.Tensor, heads: int, width: int) -> torch.Tensor:
    """Inputs whose fp4 codes vary with head and position and whose scales grow with the token."""
    c = torch.arange(width)
    out = []
    for s in slots.tolist():
        magnitude = 2.0 ** ((s + layer + kv) % 9 - 4)
        row = [E2M1[(c_ + 3 * h + s) % 8] * (-1) ** ((c_ // 5 + h + kv) % 2) for h in range(heads) for c_ in c.tolist()]
        out.append(torch.tensor(row).reshape(heads, width) * magnitude)
    return torch.stack(out)


def mha_pool() -> Any:
    return mp.MHATokenToKVPoolFP4(size=SIZE, page_size=PAGE, dtype=torch.float4_e2m1fn_x2, head_num=H, head_dim=HEAD,
                                  layer_num=L, device="cpu", enable_memory_saver=False, enable_alt_stream=False)


def mla_pool() -> Any:
    with one_rank():
        return mp.MLATokenToKVPoolFP4(size=SIZE, page_size=PAGE, dtype=torch.float4_e2m1fn_x2, kv_lora_rank=512,
                                      qk_rope_head_dim=64, layer_num=L, device="cpu", enable_memory_saver=False)


def write(pool: Any, slots: torch.Tensor, inputs_of: torch.Tensor) -> None:
    mla = type(pool).__name__.startswith("MLA")
    for layer in range(L):
        if mla:
            pool.set_kv_buffer(Layer(layer), slots, values(layer, 0, inputs_of, 1, LATENT), None)
        else:
            pool.set_kv_buffer(Layer(layer), slots, values(layer, 0, inputs_of, H, HEAD),
                               values(layer, 1, inputs_of, H, HEAD))


POOLS = {"MHATokenToKVPoolFP4": (mha_pool, "sglang_mha_fp4"), "MLATokenToKVPoolFP4": (mla_pool, "sglang_mla_fp4")}


def reads(pool: Any, layer: int, slots: torch.Tensor) -> list[torch.Tensor]:
    """What SGLang's own read path gives at `slots`: dequantized K (and V)."""
    with one_rank():
        out = [pool.get_key_buffer(layer)[slots]]
        if not type(pool).__name__.startswith("MLA"):
            out.append(pool.get_value_buffer(layer)[slots])
    return out


def raw(pool: Any) -> list[torch.Tensor]:
    names = ("kv_buffer", "kv_scale_buffer") if type(pool).__name__.startswith("MLA") else \
        ("k_buffer", "v_buffer", "k_scale_buffer", "v_scale_buffer")
    return [b for n in names for b in getattr(pool, n)]


@pytest.mark.parametrize("cls", POOLS)
def test_the_pool_moves_both_ways_and_sglang_reads_the_same(cls: str) -> None:
    make, spec = POOLS[cls]
    pool, fresh, oracle = make(), make(), make()
    write(pool, SLOTS, SLOTS)
    write(oracle, AGAIN, SLOTS)  # SGLang itself writes the same inputs at AGAIN
    bound = kvgen.from_sglang(pool)
    assert (bound.layout, bound.obj) == (spec, "kv_planes")
    obj = MemoryObj(torch.zeros(tuple(bound.connector.get_shape(T, bound.kvcaches)), dtype=torch.uint8))
    bound.connector.from_gpu(obj, 0, T, kvcaches=bound.kvcaches, slot_mapping=SLOTS)
    target = kvgen.from_sglang(fresh)
    target.connector.to_gpu(obj, 0, T, kvcaches=target.kvcaches, slot_mapping=AGAIN)
    for a, b in zip(raw(fresh), raw(oracle), strict=True):
        assert torch.equal(a, b)  # every byte, moved and not moved
    for layer in range(L):
        for got, want in zip(reads(fresh, layer, AGAIN), reads(pool, layer, SLOTS), strict=True):
            assert torch.equal(got, want)


def decode(spec: Spec, pool: Any, layer: int, slot: int) -> list[torch.Tensor]:
    """Each plane of values at (layer, slot), dequantized from the spec's address arithmetic and
    the scale SGLang's source gives value c of head h: its token's scale byte (h * width + c) // 16."""
    mla = type(pool).__name__.startswith("MLA")
    heads, width = (1, LATENT) if mla else (H, HEAD)
    ext = {"L": L, "B": ROWS // PAGE, "N": PAGE, "H": heads, "C": 0}
    data_planes = [p for p in spec.moved_planes() if p.field is not None]
    scale_planes = [p for p in spec.moved_planes() if p.field is None]
    out = []
    for kv, (plane, scales) in enumerate(zip(data_planes, scale_planes, strict=True)):
        data = raw_leaf(pool, plane.index, layer)
        scale = raw_leaf(pool, scales.index, layer)
        got = torch.zeros(heads, width)
        for h in range(heads):
            for c in range(width):
                unit, shift = packed_value(plane.field, c)
                _, index, _ = plane_address(spec, plane, {"l": layer, "kv": kv, "slot": slot, "h": h, "c": unit},
                                            ext, 1)
                code = (int(data[index]) >> shift) & 0xF
                exponent = int(scale[slot, (h * width + c) // 16]) - 127
                got[h, c] = E2M1[code & 7] * (-1 if code & 8 else 1) * 2.0 ** exponent
        out.append(got)
    return out


def raw_leaf(pool: Any, part: int, layer: int) -> torch.Tensor:
    names = ("kv_buffer", "kv_scale_buffer") if type(pool).__name__.startswith("MLA") else \
        ("k_buffer", "v_buffer", "k_scale_buffer", "v_scale_buffer")
    return getattr(pool, names[part])[layer]


def decodes_as_sglang(spec: Spec, pool: Any) -> bool:
    for layer, slot in ((0, 17), (1, 63)):
        for mine, theirs in zip(decode(spec, pool, layer, slot), reads(pool, layer, torch.tensor([slot])), strict=True):
            if not torch.equal(mine, theirs[0].reshape(mine.shape).float()):
                return False
    return True


@pytest.mark.parametrize("cls", POOLS)
def test_the_specs_arithmetic_dequantizes_as_sglang_does_and_a_nibble_swap_does_not(cls: str) -> None:
    make, name = POOLS[cls]
    pool = make()
    write(pool, SLOTS, SLOTS)
    spec = LIBRARY[name]
    assert decodes_as_sglang(spec, pool)
    parts = tuple(dataclasses.replace(p, fields=tuple(dataclasses.replace(f, packing=Packing.HIGH_FIRST)
                                                      for f in p.fields)) for p in spec.parts)
    assert not decodes_as_sglang(dataclasses.replace(spec, parts=parts), pool)


def test_a_scale_moved_with_another_token_changes_what_sglang_reads() -> None:
    """The K scales of the pool's slots moved with the next token's data: SGLang reads other values."""
    pool, fresh = mha_pool(), mha_pool()
    write(pool, SLOTS, SLOTS)
    bound, target = kvgen.from_sglang(pool), kvgen.from_sglang(fresh)
    obj = MemoryObj(torch.zeros(tuple(bound.connector.get_shape(T, bound.kvcaches)), dtype=torch.uint8))
    bound.connector.from_gpu(obj, 0, T, kvcaches=bound.kvcaches, slot_mapping=SLOTS)
    target.connector.to_gpu(obj, 0, T, kvcaches=target.kvcaches, slot_mapping=AGAIN)
    for layer in range(L):
        rolled = fresh.k_scale_buffer[layer][AGAIN].roll(1, 0)
        fresh.k_scale_buffer[layer][AGAIN] = rolled
    assert not torch.equal(reads(fresh, 0, AGAIN)[0], reads(pool, 0, SLOTS)[0])


def test_an_fp4_pool_of_another_head_size_is_refused_in_sglangs_words() -> None:
    pool = mp.MHATokenToKVPoolFP4(size=SIZE, page_size=PAGE, dtype=torch.float4_e2m1fn_x2, head_num=H, head_dim=64,
                                  layer_num=L, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    with pytest.raises(KVLayoutError, match="MHATokenToKVPoolFP4 with kv_cache_layout 'nhd'.*head_dim 128, not 64"):
        kvgen.from_sglang(pool)
