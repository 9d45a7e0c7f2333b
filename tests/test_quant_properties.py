"""Format 3's address arithmetic over random packed and tiled layouts (hypothesis): group sizes,
sub-byte types and their packing, K and V rows, block cells, split factors that differ for K
and V. Every value unit and scale lands on its own bytes inside the row or block it belongs to,
the fields fill it exactly, the two values of a byte share that byte (and its scale), and split
axes address what torch's own reshape of the same tensor addresses."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgen.oracle.address import packed_value, plane_address, scale_index, stored_slots
from kvgen.oracle.reference.planes import part_shape
from kvgen.plan.copy import compatible
from kvgen.plan.planes import compatible_planes
from kvgen.spec.library import load_library, load_specs
from kvgen.spec.model import Spec

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
EXT = {"L": 2, "KV": 2, "B": 3, "N": 4, "H": 2}


def load(tmp: Path, text: str) -> Spec:
    path = tmp / "spec.yaml"
    path.write_text(text)
    return load_specs([path])[0][0]


@st.composite
def packed_rows(draw: st.DrawFn) -> tuple[str, str, int, int, str, str]:
    """(data dtype, packing, count, group, scale dtype, where): a row or block of data and scales."""
    dtype = draw(st.sampled_from(["fp4_e2m1", "int4", "uint8", "float8_e4m3fn"]))
    groups = draw(st.integers(1, 8))
    group = 2 * draw(st.integers(1, 16)) if dtype in ("fp4_e2m1", "int4") else draw(st.integers(1, 32))
    packing = draw(st.sampled_from(["low_first", "high_first"]))
    scale = draw(st.sampled_from(["ue8m0", "float8_e4m3fn"]))
    where = draw(st.sampled_from(["kv_rows", "cells", "sides", "slot_sides"]))
    return dtype, packing, group * groups, group, scale, where


def spec_text(dtype: str, packing: str, count: int, group: int, scale: str, where: str) -> str:
    dims = {"kv_rows": "[B, N, H, [KV, C]]", "cells": "[B, H, N, C]", "sides": "[B, [KV, H], N, C]",
            "slot_sides": "[B, N, [KV, H], C]"}[where]
    kind = "row" if where == "kv_rows" else "block"
    pack = f", packing: {packing}" if dtype in ("fp4_e2m1", "int4") else ""
    sizes = "sizes: {KV: 2}\n" if where != "cells" else ""
    return (f"kvgen: 3\nname: t_packed\nkind: paged\nsummary: Random packed layout.\nlists: [L]\ndims: {dims}\n"
            f"{sizes}dtypes: [uint8]\nfields:\n  {kind}:\n"
            f"    - {{name: values, dtype: {dtype}, count: {count}{pack}}}\n"
            f"    - {{name: scale, dtype: {scale}, count: {count // group}, scales: values, group: {group}}}\n")


@SETTINGS
@given(packed_rows())
def test_every_unit_and_scale_has_its_own_bytes_and_the_fields_fill_them(tmp_path: Path, row: tuple) -> None:
    spec = load(tmp_path, spec_text(*row))
    part = spec.parts[0]
    shape = part_shape(spec, part, EXT)
    owner = torch.full(shape, -1, dtype=torch.long)
    values, scale = spec.moved_planes()
    kvs = range(2) if spec.has("KV") else range(1)
    for label, (kv, slot, h) in enumerate(itertools.product(kvs, range(EXT["B"] * EXT["N"]), range(EXT["H"]))):
        for plane in (values, scale):
            f = plane.field
            for unit in range(f.nbytes // f.itemsize):
                _, index, byte = plane_address(spec, plane, {"l": 0, "kv": kv, "slot": slot, "h": h, "c": unit}, EXT, 1)
                for b in range(f.itemsize):  # uint8 storage: each byte its own element
                    at = (*index[:-1], index[-1] + b + byte)
                    assert owner[at] == -1, f"{plane.name} ({kv}, {slot}, {h}, {unit}) overlaps"
                    owner[at] = label
    assert bool((owner >= 0).all())  # the fields fill every byte of the cache
    f, s = values.field, scale.field
    for c in range(0, f.count, 2):
        (u0, s0), (u1, s1) = packed_value(f, c), packed_value(f, c + 1)
        if f.is_sub_byte:
            assert u0 == u1 and {s0, s1} == {0, 4} and (s0 == 0) == (f.packing == "low_first")
            assert scale_index(f, s, c) == scale_index(f, s, c + 1)  # a byte is never split by a group
        else:
            assert (u0, u1) == (c, c + 1)


@SETTINGS
@given(st.integers(1, 12), st.randoms(use_true_random=False))
def test_a_bit_stream_holds_value_c_at_bit_3c_and_decodes_what_vllms_packing_packs(
        tmp_path: Path, groups: int, rng: Any) -> None:
    """uint3: the values' bits tile the field once, in order, and a row packed as vLLM's TurboQuant
    store kernel packs it (packed_24 = sum(code_j << 3j) per 8, little-endian) decodes value by value."""
    count = 8 * groups
    spec = load(tmp_path, "kvgen: 3\nname: t_stream\nkind: paged\nsummary: Random 3-bit codes.\nlists: [L]\n"
                          f"dims: [B, N, C]\ndtypes: [uint8]\nfields:\n  row:\n"
                          f"    - {{name: codes, dtype: uint3, count: {count}, packing: low_first}}\n")
    f = spec.parts[0].fields[0]
    assert f.nbytes == 3 * groups
    starts = [8 * u + shift for u, shift in (packed_value(f, c) for c in range(count))]
    assert starts == [3 * c for c in range(count)]  # each value right after the one before, none split off
    codes = [rng.randrange(8) for _ in range(count)]
    packed = []
    for g in range(groups):
        word = sum(codes[8 * g + j] << 3 * j for j in range(8))
        packed += [word & 0xFF, word >> 8 & 0xFF, word >> 16 & 0xFF]
    padded = [*packed, 0]
    assert [(padded[u] | padded[u + 1] << 8) >> shift & 7 for u, shift in (packed_value(f, c) for c in range(count))] \
        == codes


@st.composite
def tiles(draw: st.DrawFn) -> tuple[int, int, int, int]:
    """(K's C split factor, V's N split factor, C, N) with the factors dividing their axes."""
    fk, fv = draw(st.sampled_from([2, 4, 8])), draw(st.sampled_from([2, 4]))
    return fk, fv, fk * draw(st.integers(1, 3)), fv * draw(st.integers(1, 3))


@SETTINGS
@given(tiles())
def test_split_axes_address_what_torch_reshapes_address(tmp_path: Path, t: tuple[int, int, int, int]) -> None:
    fk, fv, c, n = t
    text = (f"kvgen: 3\nname: t_tiles\nkind: paged\nsummary: Random tiles.\nlists: [L, P]\nparts:\n"
            f"  k: {{dims: [B, H, C/{fk}, N, C%{fk}]}}\n  v: {{dims: [B, H, N/{fv}, C, N%{fv}]}}\n")
    spec = load(tmp_path, text)
    ext = {**EXT, "N": n, "C": c, "C.k": c, "C.v": c}
    blocks, heads = ext["B"], ext["H"]
    k = torch.arange(blocks * heads * c * n).reshape(blocks, heads, c // fk, n, fk)
    v = torch.arange(blocks * heads * c * n).reshape(blocks, heads, n // fv, c, fv)
    # Independently: K as [B, N, H, C] is a permute and reshape; V's slot is (tile, place).
    k_logical = k.permute(0, 3, 1, 2, 4).reshape(blocks * n, heads, c)
    v_logical = v.permute(0, 2, 4, 1, 3).reshape(blocks * n, heads, c)
    kp, vp = spec.moved_planes()
    for slot, h, cc in itertools.product(range(blocks * n), range(heads), range(c)):
        coords = {"l": 0, "slot": slot, "h": h, "c": cc}
        assert k[plane_address(spec, kp, coords, ext, 8)[1]] == k_logical[slot, h, cc]
        assert v[plane_address(spec, vp, coords, ext, 8)[1]] == v_logical[slot, h, cc]


@SETTINGS
@given(st.integers(1, 4), st.integers(1, 4))
def test_a_named_factor_addresses_what_torch_reshapes_address(tmp_path: Path, groups: int, per_group: int) -> None:
    """H split by a factor read from the tensor (`H/g`, `H%g`: SGLang's page_unified head groups):
    the reference addresses head h at group h // g, place h % g for any g the tensor has."""
    text = ("kvgen: 3\nname: t_groups\nkind: paged\nsummary: Random head groups.\n"
            "dims: [B, H/g, L, KV, N, H%g, C]\nsizes: {KV: 2}\n")
    spec = load(tmp_path, text)
    heads, (blocks, n, c, layers) = groups * per_group, (EXT["B"], EXT["N"], 3, EXT["L"])
    ext = {**EXT, "H": heads, "H%g": per_group, "C": c, "C.": c}
    cache = torch.arange(blocks * heads * layers * 2 * n * c).reshape(blocks, groups, layers, 2, n, per_group, c)
    # Independently: [L, KV, B * N, H, C] by a permute and reshape, H as (group, place) in order.
    logical = cache.permute(2, 3, 0, 4, 1, 5, 6).reshape(layers, 2, blocks * n, heads, c)
    (plane,) = spec.moved_planes()
    for layer, kv, slot, h in itertools.product(range(layers), range(2), range(blocks * n), range(heads)):
        coords = {"l": layer, "kv": kv, "slot": slot, "h": h, "c": c - 1}
        assert cache[plane_address(spec, plane, coords, ext, 8)[1]] == logical[layer, kv, slot, h, c - 1]


def test_a_token_ratio_says_which_slots_hold_a_token_and_only_whole_tokens_pair(tmp_path: Path) -> None:
    """Several slots per token (pooling) pairs with the token objects, k rows a token; several tokens
    per slot pairs with none (a chunk would split a slot): model groups move those."""
    head = "kvgen: 3\nname: t_ratio\nkind: paged\nsummary: Ratio.\nlists: [L]\ndims: [KV, B, N, H, C]\nsizes: {KV: 2}\n"
    compressed = load(tmp_path, head + "tokens_per_slot: 4\n")
    pooled = load(tmp_path, head + "slots_per_token: 2\n")
    assert [stored_slots(compressed, t) for t in (0, 3, 4, 9)] == [(0,), (0,), (1,), (2,)]
    assert [stored_slots(pooled, t) for t in (0, 9)] == [(0, 1), (18, 19)]
    library = load_library()
    plain = dataclasses.replace(compressed, token_ratio=(1, 1))
    assert compatible(plain, library["kv_2ltd"])  # the same cache one token a slot pairs as before
    assert not any(compatible(compressed, library[o]) or compatible_planes(compressed, library[o])
                   for o in ("kv_2ltd", "kv_planes"))
    assert compatible(pooled, library["kv_2ltd"])
