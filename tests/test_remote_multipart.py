"""kvgen.remote for caches of several parts (format 2): each part described as a cache of its
own leaves, every part of every token planned and moved, checked element by element against
codes worked out from each element's (part, layer, head, slot, channel) and source rank; and
the part kinds that cannot be planned refused, naming the part."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from kvgen import remote
from kvgen.oracle.scenarios import clone_tree, same_bits
from kvgen.oracle.scenarios.layouts import make_cache
from kvgen.runtime.errors import KVLayoutError
from tests.remote_harness import LIBRARY, PART_WIDTHS, PartsCase, run_by_memmove

SRC_SLOTS = [3, 0, -1, 9, 15, 4, 5]
DST_SLOTS = [1, 12, 2, -1, 7, 8, 9]


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(1, 1), (2, 4), (4, 2), (1, 2)], ids=lambda n: f"tp{n}")
@pytest.mark.parametrize("spec", sorted(PART_WIDTHS))
def test_every_part_of_every_token_moves(spec: str, src_tp: int, dst_tp: int) -> None:
    for rank in range(dst_tp):
        case = PartsCase(spec, src_tp, dst_tp, rank, blocks=(4, 8))
        srcs, dst = case.caches()
        before = [clone_tree(c) for c in srcs]
        sd, dd = case.describe(srcs, dst)
        p = remote.plan(sd, dd, torch.tensor(SRC_SLOTS), torch.tensor(DST_SLOTS))
        assert p.strategy == "direct" and "each of its 2 parts read direct" in p.why
        run_by_memmove(p, dst)
        assert same_bits(dst, case.expected(SRC_SLOTS, DST_SLOTS)), (spec, rank)
        assert all(same_bits(a, b) for a, b in zip(srcs, before, strict=True))


def test_a_description_of_several_parts() -> None:
    case = PartsCase("sglang_mha_v_head", 2, 2, 1)
    srcs, dst = case.caches()
    _, d = case.describe(srcs, dst)
    assert [(p.part, p.extent("C"), p.extent("H")) for p in d.parts] == [("k", 8, 2), ("v", 4, 2)]
    everything = [t.data_ptr() for part in dst for t in part]  # P -> L
    assert list(d.leaves) == everything and [a for p in d.parts for a in p.leaves] == everything
    assert d.regions() == [(a, p.span, 0) for p in d.parts for a in p.leaves]
    assert [p.span for p in d.parts] == [16 * 2 * 8 * 4, 16 * 2 * 4 * 4]
    assert remote.CacheDescription.from_bytes(d.to_bytes()) == d
    assert d.fingerprint != replace(d, parts=(d.parts[0], replace(d.parts[1], extents=d.parts[0].extents))).fingerprint


def test_a_single_part_description_keeps_its_wire_form() -> None:
    cache = make_cache(LIBRARY["vllm_flash_attn_nhd"], torch.float16, "cpu")
    raw = json.loads(remote.describe(cache, "vllm_flash_attn_nhd", tp_rank=0, tp_size=1).to_bytes())
    assert "parts" not in raw and "part" not in raw


@pytest.mark.parametrize(("spec", "dtype", "message"), [
    ("sglang_mha_fp4", torch.uint8, r"sglang_mha_fp4: its parts hold typed fields \(k.values, v.values, k_scale"),
    ("sglang_mha_mxfp8_interleaved", torch.uint8, r"part k_scale splits or tiles axes \(E, N%32, N/32\)"),
    ("vllm_fp8_tensor_scales", torch.uint8, "part k_scale has no token axis"),
])
def test_parts_that_cannot_be_planned_are_refused(spec: str, dtype: torch.dtype, message: str) -> None:
    with pytest.raises(KVLayoutError, match=message):
        remote.describe(make_cache(LIBRARY[spec], dtype, "cpu"), spec, tp_rank=0, tp_size=1)


def test_mismatched_parts_are_refused_before_anything_is_planned() -> None:
    case = PartsCase("sglang_mha_v_head", 2, 2, 0)
    srcs, dst = case.caches()
    sd, dd = case.describe(srcs, dst)
    with pytest.raises(KVLayoutError, match="several parts .k, v.: its parts are read direct"):
        remote.plan(sd, dd, torch.tensor([0]), torch.tensor([0]), strategy="staged")
    narrow = replace(dd, parts=(dd.parts[0], replace(dd.parts[1], extents=dd.parts[0].extents)))
    with pytest.raises(KVLayoutError, match="head size C 4 vs 8"):
        remote.plan(sd, narrow, torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(KVLayoutError, match=r"parts \['k', 'v'\] vs \['k'\]"):
        remote.plan(sd, replace(dd, parts=dd.parts[:1]), torch.tensor([0]), torch.tensor([0]))
    single = remote.describe(make_cache(LIBRARY["sglang_mha"], torch.float32, "cpu"), "sglang_mha", tp_rank=0,
                             tp_size=2, num_kv_heads=4)
    with pytest.raises(KVLayoutError, match=r"parts \['k', 'v'\] vs \[\]"):
        remote.plan(sd, single, torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(KVLayoutError, match="slot 16 is outside"):
        remote.plan(sd, dd, torch.tensor([16]), torch.tensor([0]))


def test_a_part_without_heads_beside_parts_with_them_does_not_change_tp_size() -> None:
    """Such a part (a per-token scale of all of a rank's heads) holds each rank's own values."""
    case = PartsCase("sglang_mha_v_head", 2, 4, 0)
    srcs, dst = case.caches()
    sd, dd = case.describe(srcs, dst)

    def headless(d: remote.CacheDescription) -> remote.CacheDescription:
        v = d.parts[1]
        return replace(d, parts=(d.parts[0], replace(v, strides=tuple(x for x in v.strides if x[0] != "H"))))

    with pytest.raises(KVLayoutError, match="part.s. v hold no heads while its other parts do"):
        remote.plan([headless(d) for d in sd], headless(dd), torch.tensor([0]), torch.tensor([0]))


@pytest.mark.parametrize("spec", ["sglang_mha_mxfp8", "vllm_gaudi_fp8", "vllm_ascend_dsa"])
def test_parts_of_other_dtypes_and_widths_move_bit_for_bit(spec: str) -> None:
    """fp8 values with e8m0 or bfloat16 scales (one value per head), three MLA parts: at one TP
    size each destination slot's rows of every part are the source slot's, bit for bit."""
    from kvgen.oracle.scenarios.layouts import EXT

    src = make_cache(LIBRARY[spec], torch.uint8, "cpu")
    dst = make_cache(LIBRARY[spec], torch.uint8, "cpu", ext={**EXT, "N": 8, "B": 6})
    before = clone_tree(dst)
    sd = remote.describe(src, spec, tp_rank=0, tp_size=1)
    dd = remote.describe(dst, spec, tp_rank=0, tp_size=1)
    assert len({q.dtype for q in dd.parts}) == (1 if spec == "vllm_ascend_dsa" else 2)
    s_slots, d_slots = [5, 0, 47, -1, 12, 30], [40, 3, 0, 7, -1, 21]
    run_by_memmove(remote.plan(sd, dd, torch.tensor(s_slots), torch.tensor(d_slots)), dst)
    for a, b, w in zip(_tokens(src), _tokens(before), _tokens(dst), strict=True):
        want = b.clone()
        for s, d in zip(s_slots, d_slots, strict=True):
            if s >= 0 and d >= 0:
                want[d] = a[s]
        assert torch.equal(w, want)


def _tokens(tree: object) -> list[torch.Tensor]:
    """Every leaf as bytes, one row per slot (the leaves here hold slots first: [S, ...] or [B, N, ...])."""
    from kvgen.runtime.binding import leaves

    out = []
    for t in leaves(tree):
        flat = t.contiguous().view(torch.uint8)
        out.append(flat.reshape(t.shape[0] * (t.shape[1] if t.dim() == 4 else 1), -1))
    return out
