"""SGLang 0.5.23's MHATokenToKVPoolMXFP8 as the oracle: fp8 K and V rows with one UE8M0 exponent per 32
values of a head, in scale tensors of their own (float8_e8m0fnu).

The pool is built with SGLang's class on CPU. Its values come from SGLang's own quantizing write path
(`set_kv_buffer` with bf16 K and V runs quant_store_kv_mxfp8, a Triton kernel, here in Triton's
interpreter), which exists only for page_size 128, where the scales are interleaved in FA4's atoms
(specs/sglang/quant/mha_mxfp8_interleaved.yaml, a split slot axis: its connector moves that kernel's
output both ways). For any other page_size the scales are flat per slot (specs/sglang/quant/mha_mxfp8.yaml, with
connectors), and SGLang writes that pool only on CUDA (`set_kv_buffer` asserts `_is_cuda`; its
`_write_scales` is an index_put, which torch has no CPU kernel for on float8_e8m0fnu): the flat pool
gets what SGLang's own read path (`get_cpu_copy`) reads out of a page-128 pool the kernel wrote,
placed by slot as `_write_scales` places it. kvgen then moves it both ways, and SGLang's read path
must read at the new slots what it read at the old ones.

Every value is exact in fp8 after its block's scale, so decoding the pool through the spec's address
arithmetic, with the scale of byte c // 32 of the token's head, gives back the input; values grow
with their token and block (a scale moved with another token, or to another block, decodes wrong).

Runs in .venv-sglang (`scripts/dev engines`, or /work/main/.venv-sglang/bin/python -m pytest);
elsewhere it skips, saying why.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import builtin_library, sglang_absent, tiled_connector

try:
    from sglang.srt.mem_cache import memory_pool as mp
except Exception as exc:  # noqa: BLE001 - any failure of SGLang's import chain
    sglang_absent(exc, "memory pools")

import kvgen  # noqa: E402
from kvgen.oracle.address import plane_address  # noqa: E402
from kvgen.runtime import KVLayoutError, MemoryObj, kernels, native  # noqa: E402
from kvgen.spec.model import Spec  # noqa: E402

LIBRARY = builtin_library()
FLAT = LIBRARY["sglang_mha_mxfp8"]
TILED = LIBRARY["sglang_mha_mxfp8_interleaved"]
L, H, HEAD, BLOCK = 2, 3, 128, 32
PAGE, SIZE = 16, 48  # the flat pool: 64 rows
SLOTS = torch.tensor([17, 3, 40, 16, 31, 63, 50, 5])
AGAIN = torch.tensor([60, 1, 33, 20, 7, 45, 28, 12])
T = len(SLOTS)
#: Where the page-128 pool's store kernel writes tokens SLOTS: both sides of tile edges, two pages.
TILE_SLOTS = [1, 31, 32, 33, 95, 127, 128, 200]
#: fp8 e4m3 magnitudes; each 32-value block holds all of them, so its largest is 6 and its scale
#: 2 ** (k - 6) for a block of magnitude 2 ** k: every value is exact after it.
MAGNITUDES = (0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
BUFFERS = ("k_buffer", "v_buffer", "k_scale_buffer", "v_scale_buffer")


class Layer:
    """What set_kv_buffer reads of SGLang's RadixAttention: the layer id."""

    def __init__(self, layer_id: int):
        self.layer_id = layer_id


def inputs(layer: int, kv: int, tokens: torch.Tensor) -> torch.Tensor:
    """bf16 K (kv 0) or V rows [tokens, H, HEAD] for these token ids: codes vary with head and
    position, signs with block and head, each block's magnitude with the token, block and side."""
    t = tokens.reshape(-1, 1, 1)
    h = torch.arange(H).reshape(1, -1, 1)
    c = torch.arange(HEAD).reshape(1, 1, -1)
    code = torch.tensor(MAGNITUDES)[(c + 3 * h + t) % 8]
    sign = 1 - 2 * ((c // 5 + h + kv) % 2)
    power = 2.0 ** ((t + layer + 2 * kv + 3 * (c // BLOCK)) % 11 - 5)
    return (code * sign * power).bfloat16()


def pool(page: int, size: int) -> Any:
    return mp.MHATokenToKVPoolMXFP8(size=size, page_size=page, dtype=torch.float8_e4m3fn, head_num=H, head_dim=HEAD,
                                    layer_num=L, device="cpu", enable_memory_saver=False, enable_alt_stream=False)


def store_kernel_writes(slots: list[int]) -> dict[str, list[torch.Tensor]]:
    """Each buffer of a page-128 pool where SGLang's own quantizing write path stored the inputs of
    tokens SLOTS at `slots`, layer by layer. Its Triton kernel runs in Triton's interpreter (the CPU
    has no Triton driver), which tests/conftest.py turned on before SGLang was imported."""
    out = pool(128, 256)
    for layer in range(L):
        out.set_kv_buffer(Layer(layer), torch.tensor(slots), inputs(layer, 0, SLOTS), inputs(layer, 1, SLOTS))
    return {n: [b.view(torch.uint8).clone() for b in getattr(out, n)] for n in BUFFERS}


@pytest.fixture(scope="module")
def kernel_output() -> dict[tuple[int, ...], dict[str, list[torch.Tensor]]]:
    """What SGLang's store kernel writes for the token positions these tests use."""
    runs = [list(range(1, T + 1)), TILE_SLOTS]  # slot 0 of a page-128 pool is its padding sink
    return {tuple(s): store_kernel_writes(s) for s in runs}


def written(kernel_output: dict[tuple[int, ...], dict[str, list[torch.Tensor]]], slots: list[int]) -> Any:
    """A page-128 pool holding what the store kernel wrote at `slots`."""
    out = pool(128, 256)
    for name, tensors in kernel_output[tuple(slots)].items():
        for mine, theirs in zip(getattr(out, name), tensors, strict=True):
            mine.view(torch.uint8).copy_(theirs)
    return out


def flat(kernel_output: dict[tuple[int, ...], dict[str, list[torch.Tensor]]], slots: torch.Tensor) -> Any:
    """A flat pool holding, at `slots`, what SGLang's read path reads of a page-128 pool SGLang's store
    kernel wrote with the inputs of tokens SLOTS (at 1..T)."""
    out = pool(PAGE, SIZE)
    copy = written(kernel_output, list(range(1, T + 1))).get_cpu_copy(torch.arange(1, T + 1))
    for layer in range(L):
        for buffer, rows in zip(BUFFERS, copy[layer][0], strict=True):
            getattr(out, buffer)[layer].view(torch.uint8)[slots] = rows.view(torch.uint8)  # as _write_scales does
    return out


def raw(p: Any) -> list[torch.Tensor]:
    return [b.view(torch.uint8) for n in BUFFERS for b in getattr(p, n)]


def cpu_copy(p: Any, slots: torch.Tensor) -> list[torch.Tensor]:
    """SGLang's own read path (get_cpu_copy, _read_scales), every tensor as its bytes."""
    return [t.view(torch.uint8) for layer in p.get_cpu_copy(slots) for t in layer[0]]


def test_the_flat_pool_moves_both_ways_and_sglang_reads_the_same(kernel_output: Any) -> None:
    source, fresh, oracle = flat(kernel_output, SLOTS), pool(PAGE, SIZE), flat(kernel_output, AGAIN)
    bound = kvgen.from_sglang(source)
    assert (bound.layout, bound.obj) == ("sglang_mha_mxfp8", "kv_planes")
    obj = MemoryObj(torch.zeros(tuple(bound.connector.get_shape(T, bound.kvcaches)), dtype=torch.uint8))
    bound.connector.from_gpu(obj, 0, T, kvcaches=bound.kvcaches, slot_mapping=SLOTS)
    target = kvgen.from_sglang(fresh)
    target.connector.to_gpu(obj, 0, T, kvcaches=target.kvcaches, slot_mapping=AGAIN)
    for got, want in zip(raw(fresh), raw(oracle), strict=True):
        assert torch.equal(got, want)  # every byte, moved and not moved
    for got, want in zip(cpu_copy(fresh, AGAIN), cpu_copy(source, SLOTS), strict=True):
        assert torch.equal(got, want)


def decode(spec: Spec, leaves: list[torch.Tensor], layer: int, slot: int, page: int) -> list[torch.Tensor]:
    """K and V at (layer, slot) from the spec's address arithmetic: each fp8 value times 2 ** (its
    scale byte - 127), the scale of value c of head h being value c // 32 of the token's head's scales.
    `leaves`: each part's tensor of the layer, as bytes."""
    ext = {"L": L, "B": leaves[0].shape[0], "N": page, "H": H, "C": 0}
    planes = spec.moved_planes()
    out = []
    for kv, (data, scales) in enumerate(((planes[0], planes[2]), (planes[1], planes[3]))):
        got = torch.zeros(H, HEAD)
        for h in range(H):
            for c in range(HEAD):
                where = {"l": layer, "kv": kv, "slot": slot, "h": h}
                _, value, _ = plane_address(spec, data, {**where, "c": c}, ext, 1)
                _, scale, _ = plane_address(spec, scales, {**where, "c": c // BLOCK}, ext, 1)
                fp8 = leaves[data.index][value].view(torch.float8_e4m3fn).float()
                got[h, c] = fp8 * 2.0 ** (int(leaves[scales.index][scale]) - 127)
        out.append(got)
    return out


def leaves_of(p: Any, layer: int, by_page: bool) -> list[torch.Tensor]:
    out = [getattr(p, n)[layer].view(torch.uint8) for n in BUFFERS]
    if by_page:  # the tiled spec reads K and V [rows, H, C] by page
        out[:2] = [t.view(-1, 128, H, HEAD) for t in out[:2]]
    return out


def test_the_flat_specs_arithmetic_decodes_the_inputs_and_a_scale_of_another_token_does_not(
        kernel_output: Any) -> None:
    source = flat(kernel_output, SLOTS)
    for layer, t in ((0, 0), (1, 5)):
        slot = int(SLOTS[t])
        want = [inputs(layer, kv, SLOTS[t:t + 1])[0].float() for kv in (0, 1)]
        assert all(torch.equal(g, w) for g, w in zip(decode(FLAT, leaves_of(source, layer, False), layer, slot, PAGE),
                                                      want, strict=True))
        leaves = leaves_of(source, layer, False)
        leaves[2] = leaves[2].clone()
        leaves[2][slot] = leaves[2][int(SLOTS[t + 1])]  # K's scales of the next token
        assert not torch.equal(decode(FLAT, leaves, layer, slot, PAGE)[0], want[0])


def test_the_split_slot_axis_addresses_what_sglangs_store_kernel_writes(kernel_output: Any) -> None:
    """The interleaved page-128 pool: every scale SGLang's quantizing kernel wrote is where the tiled
    spec's N%32, N/32 say (its decode gives back the inputs), and SGLang's own reader
    (_read_sf_interleaved) reads the same bytes the spec addresses."""
    slots = torch.tensor(TILE_SLOTS)
    source = written(kernel_output, TILE_SLOTS)
    for layer in range(L):
        leaves = leaves_of(source, layer, True)
        for t, slot in enumerate(slots.tolist()):
            want = [inputs(layer, kv, SLOTS[t:t + 1])[0].float() for kv in (0, 1)]
            got = decode(TILED, leaves, layer, slot, 128)
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), (layer, slot)
        ext = {"L": L, "B": 2, "N": 128, "H": H, "C": 4}
        read = source._read_scales(layer, slots)
        for kv, plane in enumerate(TILED.moved_planes()[2:]):
            for t, slot in enumerate(slots.tolist()):
                for h in range(H):
                    for c in range(4):
                        _, index, _ = plane_address(TILED, plane, {"l": layer, "kv": kv, "slot": slot, "h": h, "c": c},
                                                    ext, 1)
                        assert int(leaves[plane.index][index]) == int(read[kv][t, h, c].view(torch.uint8))
    nonzero = sum(int(source.k_scale_buffer[layer].view(torch.uint8).count_nonzero()) for layer in range(L))
    assert nonzero <= L * len(slots) * H * 4  # the kernel wrote no scale the spec does not address


def by_page(p: Any) -> tuple[list[torch.Tensor], ...]:
    """A page-128 pool as the tiled spec reads it: K and V [rows, H, C] by page, the interleaved
    scale atoms as SGLang allocates them ([pages, H, 32, 4, C / 32])."""
    pages = [[b.view(-1, 128, H, HEAD) for b in getattr(p, n)] for n in BUFFERS[:2]]
    return (*pages, *(list(getattr(p, n)) for n in BUFFERS[2:]))


def interleaved_move(kernel_output: Any, edit: tuple[str, str] | None = None, backend: str | None = None
                     ) -> tuple[Any, Any]:
    """(the page-128 pool the store kernel wrote at TILE_SLOTS, an empty one whose connector filled
    slots 1..T from a kv_planes object the source's connector stored those tokens into): the
    connectors from_sglang gives, or with `edit` the tiled spec's rendered with it."""
    source, fresh = written(kernel_output, TILE_SLOTS), pool(128, 256)
    if edit is None:
        out, back = kvgen.from_sglang(source, backend=backend), kvgen.from_sglang(fresh, backend=backend)
        assert (out.layout, out.obj) == ("sglang_mha_mxfp8_interleaved", "kv_planes")
        pairs = ((out.connector, out.kvcaches), (back.connector, back.kvcaches))
    else:
        connector = tiled_connector("sglang_mha_mxfp8_interleaved", "kv_planes", edit)(device="cpu", backend=backend)
        pairs = ((connector, by_page(source)), (connector, by_page(fresh)))
    (c_out, k_out), (c_back, k_back) = pairs
    obj = MemoryObj(torch.zeros(tuple(c_out.get_shape(T, k_out)), dtype=torch.uint8))
    c_out.from_gpu(obj, 0, T, kvcaches=k_out, slot_mapping=torch.tensor(TILE_SLOTS))
    c_back.to_gpu(obj, 0, T, kvcaches=k_back, slot_mapping=torch.arange(1, T + 1))
    return source, fresh


@pytest.mark.parametrize("backend", [None, "triton"])
def test_the_interleaved_pool_moves_both_ways_and_sglang_reads_the_same(kernel_output: Any, backend: str | None,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A page-128 pool through the connectors kvgen.from_sglang gives: tokens the store kernel wrote
    on both sides of tile edges of two pages, moved out and back in at slots 1..T. Every byte is what
    the kernel writes at 1..T, and SGLang's own reader (get_cpu_copy, _read_sf_interleaved) reads
    there what it read at the old slots. By default, and on kvgen's Triton kernels (in Triton's
    interpreter, set before their module is first imported)."""
    if backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        why = kernels.unavailable(torch.device("cpu"))
        if why:
            pytest.skip(why)
    launches = kernels.stats["launches"]
    source, fresh = interleaved_move(kernel_output, backend=backend)
    assert (kernels.stats["launches"] > launches) == (backend == "triton")
    for got, want in zip(raw(fresh), raw(written(kernel_output, list(range(1, T + 1)))), strict=True):
        assert torch.equal(got, want)  # every byte, moved and not moved
    for got, want in zip(cpu_copy(fresh, torch.arange(1, T + 1)), cpu_copy(source, torch.tensor(TILE_SLOTS)),
                         strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("edit, backend", [
    (("(ck.off % 32), (ck.off // 32)", "((ck.off + 1) % 32), (ck.off // 32)"), "torch"),
    (("slot_split=('N/32', 'N%32')", "slot_split=('N%32', 'N/32')"), "native"),
])
def test_a_scale_moved_from_another_place_of_its_tile_is_what_sglang_reads_wrong(kernel_output: Any,
                                                                                edit: tuple[str, str],
                                                                                backend: str) -> None:
    """The same move with a connector that reads token n's scales from another place: on the torch
    path at place (n + 1) % 32 of its tile, on the compiled kernel with the PROGRAM's tile and place
    swapped. SGLang's reader sees other scales, so the check above can fail."""
    if backend == "native" and native.compiler() is None:
        pytest.skip("no C compiler here")
    source, fresh = interleaved_move(kernel_output, edit, backend)
    got, want = cpu_copy(fresh, torch.arange(1, T + 1)), cpu_copy(source, torch.tensor(TILE_SLOTS))
    assert [torch.equal(g, w) for g, w in zip(got, want, strict=True)][:4] == [True, True, False, False]


def test_a_page_128_pool_binds_the_interleaved_spec_in_pages() -> None:
    bound = kvgen.from_sglang(pool(128, 128))
    assert (bound.layout, bound.obj, bound.connector.geometry.N) == ("sglang_mha_mxfp8_interleaved", "kv_planes", 128)
    assert tuple(bound.kvcaches[0][0].shape) == (2, 128, H, HEAD)  # size 128 and the padding page


def test_an_mxfp8_pool_of_another_head_size_is_refused_in_sglangs_words() -> None:
    other = mp.MHATokenToKVPoolMXFP8(size=SIZE, page_size=PAGE, dtype=torch.float8_e4m3fn, head_num=H, head_dim=64,
                                     layer_num=L, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    with pytest.raises(KVLayoutError, match="MHATokenToKVPoolMXFP8.*head_dim and v_head_dim 128, not 64 and 64"):
        kvgen.from_sglang(other)
