"""Differential fuzz (hypothesis, bounded): the compiled CPU kernel and the generated torch
copies of every built-in transfer leave the destination bit for bit alike, and as the
element-by-element reference does, for random extents, block sizes on each side (powers of
two and others), slot pairs with skipped tokens, head ranges, strided or odd-offset storage,
whole or per layer. A cache of head groups (`H/g`, `H%g`) gets random group sizes and ranges of
whole groups."""

from __future__ import annotations

import pytest
import torch
from harness import builtin_library
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgen import generated, tp
from kvgen.oracle.reference import transfers
from kvgen.oracle.scenarios import clone_tree, same_bits
from kvgen.oracle.scenarios.transfers import make_cache, run_transfer
from kvgen.runtime import native
from kvgen.spec.elements import split_extents
from kvgen.spec.transfers import load_transfers

BUILTIN = load_transfers(builtin_library())

pytestmark = pytest.mark.skipif(bool(native.unavailable()), reason=f"no compiled kernel: {native.unavailable()}")


@st.composite
def cases(draw: st.DrawFn) -> dict:
    pair = draw(st.sampled_from(BUILTIN))
    heads = pair.src.has("H") and pair.dst.has("H")
    base = {"L": draw(st.integers(1, 3)), "KV": 2, "C": draw(st.sampled_from([1, 2, 3, 8])),
            "H": draw(st.integers(1, 3)) if heads else 1}
    # block sizes of powers of two (the kernel splits a slot by a shift and a mask) and others (by a division)
    src = {**base, "N": draw(st.sampled_from([1, 2, 3, 4, 6])), "B": draw(st.integers(1, 6))}
    dst = {**base, "N": draw(st.sampled_from([1, 2, 3, 4, 6])), "B": draw(st.integers(1, 6))}
    if _grouped(pair.src) or _grouped(pair.dst):  # heads in groups of g: ranges of whole groups
        g, groups = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        count = g * draw(st.integers(1, groups))
        s0, d0 = (g * draw(st.integers(0, groups - count // g)) for _ in range(2))
        ranges = tp.HeadRanges((s0, s0 + count), (d0, d0 + count))
        for spec, ext in ((pair.src, src), (pair.dst, dst)):
            ext["H"] = g * groups
            ext.update({a: g for a in spec.head_groups[1:]})  # the place's extent: the group's size
            ext.update(split_extents(spec.axes, ext))
    elif heads:
        dst["H"] = draw(st.integers(1, 3))
        count = draw(st.integers(1, min(src["H"], dst["H"])))
        s0, d0 = draw(st.integers(0, src["H"] - count)), draw(st.integers(0, dst["H"] - count))
        ranges = tp.HeadRanges((s0, s0 + count), (d0, d0 + count))
    else:
        ranges = tp.HeadRanges()
    s_slots, d_slots = src["N"] * src["B"], dst["N"] * dst["B"]
    tokens = draw(st.integers(0, min(s_slots, d_slots)))
    picked = draw(st.permutations(range(d_slots)))[:tokens]
    if draw(st.booleans()):  # runs of consecutive slots, so whole blocks move too
        first_s, first_d = draw(st.integers(0, s_slots - tokens)), draw(st.integers(0, d_slots - tokens))
        s_map, d_map = list(range(first_s, first_s + tokens)), list(range(first_d, first_d + tokens))
    else:
        s_map, d_map = [draw(st.integers(0, s_slots - 1)) for _ in range(tokens)], list(picked)
    skip = draw(st.lists(st.integers(0, max(tokens - 1, 0)), max_size=3)) if tokens else []
    for i in skip:
        if draw(st.booleans()):
            s_map[i] = -1
        else:
            d_map[i] = -1
    storage = draw(st.sampled_from([("plain", "plain"), ("strided", "odd"), ("odd", "strided")]))
    return {"pair": pair, "src": src, "dst": dst, "heads": ranges, "s": s_map, "d": d_map, "storage": storage,
            "layerwise": draw(st.booleans()), "dtype": draw(st.sampled_from([torch.float32, torch.bfloat16]))}


def _grouped(spec) -> bool:  # noqa: ANN001
    return bool(spec.head_groups)


def _cache(spec, ext, case, side: int, salt: int = 0):  # noqa: ANN001, ANN202
    storage = case["storage"][side]
    return make_cache(spec, ext, case["dtype"], "cpu", salt, storage=storage)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_compiled_and_torch_transfers_agree_with_the_reference(case: dict) -> None:
    pair, src, dst = case["pair"], case["src"], case["dst"]
    source = _cache(pair.src, src, case, 0)
    want = clone_tree(_cache(pair.dst, dst, case, 1, 10000))
    transfers.transfer(
        transfers.TransferSide(pair.src, src, source, case["s"], case["heads"].src_heads),
        transfers.TransferSide(pair.dst, dst, want, case["d"], case["heads"].dst_heads))
    for backend in ("native", "torch"):
        out = _cache(pair.dst, dst, case, 1, 10000)  # fresh, in the case's storage
        calls = native.stats["calls"]
        run_transfer(generated.transfer(pair.src.name, pair.dst.name)(copy_backend=backend),
                     (source, torch.tensor(case["s"], dtype=torch.long)),
                     (out, torch.tensor(case["d"], dtype=torch.long)),
                     layerwise=case["layerwise"], heads=case["heads"])
        moved = any(a >= 0 and b >= 0 for a, b in zip(case["s"], case["d"], strict=True))
        assert (native.stats["calls"] > calls) == (backend == "native" and moved)
        assert same_bits(out, want), f"{backend} differs from the reference"
