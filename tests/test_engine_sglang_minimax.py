"""SGLang 0.5.23's MiniMax M3.1 NVFP4 pools as the oracle: MiniMaxM3Nvfp4MainKVPool (main K/V) and
MiniMaxM3Nvfp4IndexKPool (K-only sparse index), the two sub-pools of MiniMaxM3Nvfp4KVPool, built with
SGLang's classes on CPU (sglang/srt/mem_cache/minimax_m3_nvfp4_pool.py).

Each keeps one uint8 page row per (layer, page): [K | K scales | V | V scales] (main) or [K | K
scales] (index), each component every (head, token) cell's bytes. SGLang's quantizing write path
(`set_kv_buffer`, `set_k_buffer`) runs NVFP4KVQuantizeUtil.quantize, which asserts an SM90+ GPU, so
the values are written with the pools' own store functions, `set_quantized_kv_buffer` and
`set_quantized_k_buffer` (what the quantizer's packed fp4 bytes and fp8 e4m3 block scales go
through), and read with `get_quantized_rows`. Every fp4 code encodes its layer, K or V, slot, head
and position (two neighbouring codes differ, so a swapped nibble changes it); every scale its
layer, K or V, slot, head and group. Dequantizing is SGLang's own NVFP4KVQuantizeUtil.dequantize,
its pure-torch SM90 branch, run on the CPU by telling it the platform is SM90.

kvgen stores the rows as they are into kv_planes objects and loads them into a fresh pool at other
slots: every byte must equal a pool SGLang wrote at those slots itself, and SGLang's reads there
what it read at the original ones. A nibble swapped or a scale moved with another token in the
object, and a spec that reads the nibbles high first, fail those checks.

Runs in .venv-sglang (`scripts/dev engines`, or /work/main/.venv-sglang/bin/python -m pytest);
elsewhere it skips, saying why.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from harness import builtin_library, sglang_absent

try:
    from sglang.srt.layers.quantization import kvfp4_tensor
    from sglang.srt.mem_cache import minimax_m3_nvfp4_pool as mm
except Exception as exc:  # noqa: BLE001 - any failure of SGLang's import chain
    sglang_absent(exc, "MiniMax NVFP4 pools")

import kvgen  # noqa: E402
from kvgen.integrations.detect import detect  # noqa: E402
from kvgen.oracle.address import packed_value, plane_address, scale_index  # noqa: E402
from kvgen.runtime import KVLayoutError, MemoryObj  # noqa: E402
from kvgen.spec.model import Packing, Spec  # noqa: E402

LIBRARY = builtin_library()
L, H, PAGE, SIZE, HEAD = 2, 2, 128, 256, 128
PAGES = (SIZE + PAGE) // PAGE
SLOTS = torch.tensor([17, 300, 130, 5, 255, 383, 128, 64])
AGAIN = torch.tensor([200, 1, 383, 129, 40, 0, 310, 77])
T = len(SLOTS)
DATA, SCALES = HEAD // 2, HEAD // 16
MAIN, INDEX = "MiniMaxM3Nvfp4MainKVPool", "MiniMaxM3Nvfp4IndexKPool"


def main_pool() -> Any:
    return mm.MiniMaxM3Nvfp4MainKVPool(size=SIZE, page_size=PAGE, dtype=torch.bfloat16, head_num=H, head_dim=HEAD,
                                       layer_num=L, device="cpu", enable_memory_saver=False)


def index_pool() -> Any:
    return mm.MiniMaxM3Nvfp4IndexKPool(size=SIZE, page_size=PAGE, dtype=torch.bfloat16, head_num=1, head_dim=HEAD,
                                       layer_num=L, device="cpu", enable_memory_saver=False)


def packed(layer: int, kv: int, slots: torch.Tensor, heads: int) -> torch.Tensor:
    """[tokens, heads, 64] fp4 bytes: value c's code is (c + 3h + 5 slot + 7 kv + layer) % 16, value 2j
    in the low nibble (NVFP4KVQuantizeUtil's order), so the two nibbles of a byte always differ."""
    c = torch.arange(HEAD)
    h = torch.arange(heads)[:, None]
    codes = (c + 3 * h + 5 * slots[:, None, None] + 7 * kv + layer) % 16
    return (codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8)


def scales(layer: int, kv: int, slots: torch.Tensor, heads: int) -> torch.Tensor:
    """[tokens, heads, 8] fp8 e4m3 block scales as bytes, one per 16 values, distinct per token and group."""
    g = torch.arange(SCALES)
    h = torch.arange(heads)[:, None]
    step = (slots[:, None, None] + 2 * g + 3 * h + kv + layer) % 13 - 6
    return (2.0 ** step * (1 + (slots[:, None, None] + g) % 4 / 8)).to(torch.float8_e4m3fn).view(torch.uint8)


def write(pool: Any, slots: torch.Tensor, inputs_of: torch.Tensor) -> None:
    """The pool's own store function, with the bytes of tokens `inputs_of` at `slots`."""
    for layer in range(L):
        if type(pool).__name__ == MAIN:
            pool.set_quantized_kv_buffer(layer, slots, packed(layer, 0, inputs_of, H), packed(layer, 1, inputs_of, H),
                                         scales(layer, 0, inputs_of, H), scales(layer, 1, inputs_of, H))
        else:
            pool.set_quantized_k_buffer(layer, slots, packed(layer, 0, inputs_of, 1), scales(layer, 0, inputs_of, 1))


POOLS: dict[str, tuple[Callable[[], Any], str]] = {MAIN: (main_pool, "sglang_minimax_m3_nvfp4"),
                                                    INDEX: (index_pool, "sglang_minimax_m3_nvfp4_index")}


@pytest.fixture
def on_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVFP4KVQuantizeUtil.dequantize takes its pure-torch branch (SM90's) on this CPU."""
    platform = type("Sm90", (), {"is_sm100": False, "is_sm120": False, "is_sm90": True})()
    monkeypatch.setattr(kvfp4_tensor, "get_platform", lambda: platform)


def reads(pool: Any, layer: int, slots: torch.Tensor) -> list[torch.Tensor]:
    """SGLang's read path at `slots`: get_quantized_rows, dequantized by NVFP4KVQuantizeUtil (unit
    global scale, as the pools keep it), K (and V) as [tokens, heads, 128] float32."""
    rows = pool.get_quantized_rows(layer, slots)
    pairs = [(rows[0], rows[2]), (rows[1], rows[3])] if type(pool).__name__ == MAIN else [rows]
    out = []
    for data, scale in pairs:
        data = data.reshape(len(slots), -1, DATA)
        scale = scale.reshape(len(slots), -1)  # the SM90 branch takes a token's scales as one row, 16 values each
        values = kvfp4_tensor.NVFP4KVQuantizeUtil.dequantize(data, scale, pool.global_scale, torch.float32)
        out.append(values)
    return out


def move(pool: Any, fresh: Any, corrupt: Callable[[torch.Tensor], None] | None = None) -> None:
    """Store SLOTS of `pool` into a kv_planes object, optionally corrupt it, load it into `fresh` at AGAIN."""
    bound, target = kvgen.from_sglang(pool, part=PART[type(pool).__name__]), \
        kvgen.from_sglang(fresh, part=PART[type(fresh).__name__])
    assert bound.obj == "kv_planes"
    obj = torch.zeros(tuple(bound.connector.get_shape(T, bound.kvcaches)), dtype=torch.uint8)
    bound.connector.from_gpu(MemoryObj(obj), 0, T, kvcaches=bound.kvcaches, slot_mapping=SLOTS)
    if corrupt is not None:
        corrupt(obj)
    target.connector.to_gpu(MemoryObj(obj, bound.connector.format), 0, T, kvcaches=target.kvcaches,
                            slot_mapping=AGAIN)


PART = {MAIN: "kv", INDEX: "indexer"}


def agrees(pool: Any, fresh: Any, oracle: Any) -> bool:
    """`fresh` holds, byte for byte, what SGLang wrote into `oracle`, and SGLang reads at AGAIN what it
    read in `pool` at SLOTS."""
    if not torch.equal(fresh.slab, oracle.slab):  # every byte, moved and not moved
        return False
    return all(torch.equal(got, want) for layer in range(L)
               for got, want in zip(reads(fresh, layer, AGAIN), reads(pool, layer, SLOTS), strict=True))


def filled(make: Callable[[], Any]) -> tuple[Any, Any, Any]:
    pool, fresh, oracle = make(), make(), make()
    write(pool, SLOTS, SLOTS)
    write(oracle, AGAIN, SLOTS)  # SGLang itself stores the same tokens at AGAIN
    return pool, fresh, oracle


@pytest.mark.parametrize("cls", POOLS)
def test_the_pool_moves_both_ways_and_sglang_reads_the_same(cls: str, on_sm90: None) -> None:
    make, spec = POOLS[cls]
    pool, fresh, oracle = filled(make)
    assert kvgen.from_sglang(pool, part=PART[cls]).layout == spec
    assert int(pool.slab.count_nonzero()) > 0
    move(pool, fresh)
    assert agrees(pool, fresh, oracle)


def sides_and_heads(cls: str) -> tuple[int, int]:
    """K and V sides and heads of a pool's rows: the main pool's K and V of H heads, the index's one K head."""
    return (2, H) if cls == MAIN else (1, 1)


def _planes_regions(cls: str) -> tuple[int, int]:
    """The bytes per layer of a kv_planes object's two regions (kvgen's regions object): the values
    [KV T H 64], then the scales [KV T H 8] (which start at a multiple of 16, right after)."""
    sides, heads = sides_and_heads(cls)
    return sides * T * heads * DATA, sides * T * heads * SCALES


@pytest.mark.parametrize("cls", POOLS)
def test_a_nibble_swapped_or_a_scale_moved_with_another_token_fails_the_check(cls: str, on_sm90: None) -> None:
    """The object corrupted between store and load: the check of the move above must fail."""
    make, _ = POOLS[cls]
    values, scale = _planes_regions(cls)
    sides, heads = sides_and_heads(cls)

    def swap_nibbles(obj: torch.Tensor) -> None:
        region = obj.view(L, -1)[:, :values]
        region.copy_((region >> 4) | (region << 4))

    def roll_scales(obj: torch.Tensor) -> None:  # token t's scales travel with token t + 1's values
        region = obj.view(L, -1)[:, values:values + scale].view(L, sides, T, heads, SCALES)
        region.copy_(region.roll(1, 2))

    for corrupt in (swap_nibbles, roll_scales):
        pool, fresh, oracle = filled(make)
        move(pool, fresh, corrupt)
        assert not agrees(pool, fresh, oracle), corrupt.__name__


def decode(spec: Spec, pool: Any, layer: int, slot: int) -> list[torch.Tensor]:
    """Each side (K, V) at (layer, slot) dequantized from the spec's address arithmetic alone: the
    nibble packed_value names, times the fp8 scale scale_index names (unit global scale)."""
    tree = kvgen.from_sglang(pool, part=PART[type(pool).__name__]).kvcaches
    sides, heads = sides_and_heads(type(pool).__name__)
    ext = {"L": L, "B": PAGES, "N": PAGE, "H": heads, "KV": 2, "C": 0}
    data, scale = spec.moved_planes()
    e2m1 = torch.tensor(kvfp4_tensor.E2M1_VALUES, dtype=torch.float32)
    out = []
    for kv in range(sides):
        got = torch.zeros(heads, HEAD)
        for h in range(heads):
            for c in range(HEAD):
                unit, shift = packed_value(data.field, c)
                at = {"l": layer, "kv": kv, "slot": slot, "h": h}
                _, index, _ = plane_address(spec, data, {**at, "c": unit}, ext, 1)
                code = (int(tree[layer][index]) >> shift) & 0xF
                _, index, _ = plane_address(spec, scale, {**at, "c": scale_index(data.field, scale.field, c)}, ext, 1)
                factor = float(tree[layer][index].view(torch.float8_e4m3fn).float())
                got[h, c] = e2m1[code] * factor
        out.append(got)
    return out


def decodes_as_sglang(spec: Spec, pool: Any) -> bool:
    for layer, slot in ((0, 17), (1, 383)):
        theirs = reads(pool, layer, torch.tensor([slot]))
        if not all(torch.equal(mine, sg[0]) for mine, sg in zip(decode(spec, pool, layer, slot), theirs, strict=True)):
            return False
    return True


@pytest.mark.parametrize("cls", POOLS)
def test_the_specs_arithmetic_dequantizes_as_sglang_does_and_a_nibble_swap_does_not(cls: str, on_sm90: None) -> None:
    make, name = POOLS[cls]
    pool = make()
    write(pool, SLOTS, SLOTS)
    spec = LIBRARY[name]
    assert decodes_as_sglang(spec, pool)
    parts = tuple(dataclasses.replace(p, fields=tuple(dataclasses.replace(f, packing=Packing.HIGH_FIRST)
                                                      if f.is_sub_byte else f for f in p.fields)) for p in spec.parts)
    assert not decodes_as_sglang(dataclasses.replace(spec, parts=parts), pool)


def composite() -> Any:
    """MiniMaxM3Nvfp4KVPool over model layers 2 and 3: every layer sparse with a K-only index."""
    return mm.MiniMaxM3Nvfp4KVPool(size=SIZE, page_size=PAGE, dtype=torch.bfloat16, head_num=H, head_dim=HEAD,
                                   idx_head_dim=HEAD, dense_layer_ids=[], sparse_layer_ids=[2, 3],
                                   disable_value_sparse_layer_ids=[2, 3], device="cpu", start_layer=2, end_layer=4)


def test_the_minimax_pool_hands_over_its_main_and_index_rows_with_their_model_layers() -> None:
    pool = composite()
    main, index = kvgen.from_sglang(pool), kvgen.from_sglang(pool, part="indexer")
    assert (main.layout, main.layer_ids) == ("sglang_minimax_m3_nvfp4", (2, 3))
    assert (index.layout, index.layer_ids) == ("sglang_minimax_m3_nvfp4_index", (2, 3))
    for bound, sub in ((main, pool.main_pool), (index, pool.index_k_pool)):
        assert [t.data_ptr() for t in bound.kvcaches] == [r.data_ptr() for r in sub.rows]  # views, no copy
    with pytest.raises(KVLayoutError, match="MiniMaxM3Nvfp4KVPool has no part 'latent'; parts: kv, indexer"):
        kvgen.from_sglang(pool, part="latent")


def test_detection_takes_the_pool_class_and_refuses_where_two_readings_fit() -> None:
    main = kvgen.from_sglang(main_pool()).kvcaches
    index = kvgen.from_sglang(index_pool(), part="indexer").kvcaches
    assert detect(main, engine="sglang", pool=MAIN).layout == "sglang_minimax_m3_nvfp4"
    assert detect(index, engine="sglang", pool=INDEX).layout == "sglang_minimax_m3_nvfp4_index"
    assert detect(index, pool=INDEX).layout == "sglang_minimax_m3_nvfp4_index"  # the class is SGLang's word
    # Without the class: the main rows read as an SGLang HND buffer, whose order only the pool says;
    # the index rows as vLLM's MLA rows too (uint8 [B, N, 72]).
    with pytest.raises(KVLayoutError, match="sglang_minimax_m3_nvfp4 "):
        detect(main, engine="sglang")
    with pytest.raises(KVLayoutError, match="(?s)2 layouts fit.*sglang_minimax_m3_nvfp4_index.*vllm_mla"):
        detect(index)
    with pytest.raises(KVLayoutError, match="no layout fits"):
        detect(main, engine="sglang", pool="MHATokenToKVPoolFP4")
    with pytest.raises(KVLayoutError, match="no layout fits"):
        detect(index, engine="sglang", pool=MAIN)


# -- the HiCache host mirrors (pool_host/minimax_m3_nvfp4.py) -----------------------------------

HOST_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
HOST = {MAIN: "MiniMaxM3Nvfp4MainKVPoolHost", INDEX: "MiniMaxM3Nvfp4IndexKPoolHost"}
DEVICE_PAGES = torch.tensor([2, 0, 1])  # host page k + 1 holds device page DEVICE_PAGES[k]
HOST_PAGES = torch.arange(1, 4)


def pages_to_slots(pages: torch.Tensor) -> torch.Tensor:
    return (pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)


def mirror(pool: Any, layout: str, anchor: Any = None) -> Any:
    """SGLang's host mirror of a main (or, riding on the main one's `anchor`, an index) device pool, on CPU,
    its kv_buffer zeroed (SGLang allocates it uninitialized) so that bytes nothing wrote compare equal."""
    host_mod = pytest.importorskip("sglang.srt.mem_cache.pool_host.minimax_m3_nvfp4")
    info_cls = pytest.importorskip("sglang.srt.mem_cache.device_pool_info").PageRowBufferInfo
    info = info_cls(slab=pool.slab, rows=tuple(pool.rows), row_bytes=pool.row_bytes, page_size=PAGE,
                    num_pages=pool.num_pages)
    if anchor is None:
        host = host_mod.MiniMaxM3Nvfp4MainKVPoolHost(info, host_to_device_ratio=2.0, host_size=0, page_size=PAGE,
                                                     layout=layout, pin_memory=False, device="cpu",
                                                     device_capacity_tokens=SIZE, start_layer=0, end_layer=L)
    else:
        host = host_mod.MiniMaxM3Nvfp4IndexKPoolHost(info, anchor, layout, pin_memory=False, device="cpu",
                                                     start_layer=0, end_layer=L)
    host.kv_buffer.zero_()
    return host


def mirrors(cls: str, layout: str) -> tuple[Any, Any]:
    """A device pool of `cls` written at SLOTS and a host mirror SGLang backed its pages up into (its
    CPU copy path): host page k + 1 holds device page DEVICE_PAGES[k]."""
    anchor = None if cls == MAIN else mirror(main_pool(), layout)
    pool = POOLS[cls][0]()
    write(pool, SLOTS, SLOTS)
    host = mirror(pool, layout, anchor)
    host.backup_from_device_all_layer(pool, pages_to_slots(HOST_PAGES), pages_to_slots(DEVICE_PAGES), "kernel")
    return pool, host


def layer_offset(host: Any, layout: str, layer: int) -> int:
    """Where layer `layer`'s rows start in the host pool's one kv_buffer: [L, pages, row_bytes] or
    [pages, L, 1, row_bytes]."""
    return layer * (host.page_num if layout == "layer_first" else 1) * host.row_bytes


def stored(bound: Any, slots: torch.Tensor) -> torch.Tensor:
    obj = torch.zeros(tuple(bound.connector.get_shape(T, bound.kvcaches)), dtype=torch.uint8)
    bound.connector.from_gpu(MemoryObj(obj), 0, T, kvcaches=bound.kvcaches, slot_mapping=slots)
    return obj


#: SLOTS as the host mirror holds them (host page k + 1 is device page DEVICE_PAGES[k]), and as the device does.
HOST_SLOTS = SLOTS + PAGE * torch.argsort(DEVICE_PAGES)[torch.div(SLOTS, PAGE, rounding_mode="floor")] \
    - PAGE * torch.div(SLOTS, PAGE, rounding_mode="floor") + PAGE


@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("cls", POOLS)
def test_the_hicache_host_mirror_is_bound_as_views_of_its_one_buffer_and_moves_both_ways(cls: str,
                                                                                          layout: str) -> None:
    """from_sglang binds the host mirror's one kv_buffer as per-layer views to the device pool's spec: it
    stores from host slot s what it stores from the device slot SGLang backed up there, and its load
    into a fresh mirror is, page for page (SGLang's get_data_page), SGLang's own backup; SGLang loads
    that mirror back into a fresh device pool equal, byte for byte, to the first."""
    pool, host = mirrors(cls, layout)
    bound = kvgen.from_sglang(host, part=PART[cls])
    assert (bound.pool, bound.layout, bound.obj, bound.layer_ids) == (HOST[cls], POOLS[cls][1], "kv_planes", (0, 1))
    base = host.kv_buffer.data_ptr()
    assert [t.data_ptr() - base for t in bound.kvcaches] == [layer_offset(host, layout, i) for i in range(L)]
    assert all(t.untyped_storage().data_ptr() == host.kv_buffer.untyped_storage().data_ptr()
               for t in bound.kvcaches)  # views of SGLang's own buffer, no copy
    from_host = stored(bound, HOST_SLOTS)
    assert int(from_host.count_nonzero()) > 0
    assert torch.equal(from_host, stored(kvgen.from_sglang(pool, part=PART[cls]), SLOTS))

    device = POOLS[cls][0]()  # SGLang's mirror loads into the device rows it was built over
    fresh = mirror(device, layout, None if cls == MAIN else mirror(main_pool(), layout))
    target = kvgen.from_sglang(fresh, part=PART[cls])
    target.connector.to_gpu(MemoryObj(from_host, bound.connector.format), 0, T, kvcaches=target.kvcaches,
                            slot_mapping=HOST_SLOTS)
    for page in range(host.page_num):
        assert torch.equal(fresh.get_data_page(page * PAGE), host.get_data_page(page * PAGE)), page
    for layer in range(L):
        fresh.load_to_device_per_layer(device, pages_to_slots(HOST_PAGES), pages_to_slots(DEVICE_PAGES), layer,
                                       "kernel")
    assert torch.equal(device.slab, pool.slab)


def test_host_mirrors_kvgen_has_no_spec_for_are_refused_in_sglangs_words() -> None:
    """Refused before anything binds, naming the class and layout; the host buffer is left as it was."""
    prefix = "kvgen has no connector for SGLang's {} with layout {!r}: "
    cases = ((MAIN, "layout", "page_head", "no kvgen spec describes this layout"),
             (MAIN, "row_bytes", 2 * H * PAGE * 72 + 128, "its kv_buffer is "),
             (MAIN, "page_size", 64, "kvgen's spec for it is for uint8 rows, page_size 128"),
             (INDEX, "layout", "page_unified", "no kvgen spec describes this layout"),
             (INDEX, "layer_num", L + 1, "its kv_buffer is "))
    for cls, attr, value, why in cases:
        _, host = mirrors(cls, "page_first")
        setattr(host, attr, value)
        before = host.kv_buffer.clone()
        with pytest.raises(KVLayoutError, match=re.escape(prefix.format(HOST[cls], host.layout) + why)):
            kvgen.from_sglang(host, part=PART[cls])
        assert torch.equal(host.kv_buffer, before) and int(before.count_nonzero()) > 0


def test_a_pool_whose_rows_are_not_the_specs_is_refused_in_sglangs_words() -> None:
    pool = main_pool()
    pool.row_bytes += 128  # as if SGLang padded its components
    with pytest.raises(KVLayoutError, match=f"{MAIN}: kvgen's spec for it is for page_size 128 and rows of "
                                            f"{2 * H * PAGE * 72} bytes"):
        kvgen.from_sglang(pool)
