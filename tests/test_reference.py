"""The reference interpreter itself, checked by hand-written torch indexing per engine."""

from __future__ import annotations

import pytest
import torch
from harness import EXT, builtin_library, make_cache, same_bits, tensors_of

from kvgen import generated
from kvgen.oracle import reference
from kvgen.oracle.address import element_address
from kvgen.oracle.reference import planes, transfers
from kvgen.oracle.scenarios import SCENARIOS, at_odd_offsets, clone_tree, fitted, make_objects
from kvgen.oracle.scenarios.transfers import DST_EXT, SRC_EXT, fitted_extents
from kvgen.oracle.scenarios.transfers import make_cache as transfer_cache
from kvgen.plan.copy import plan_library
from kvgen.plan.package import kind_of, plan_connectors
from kvgen.runtime.ops import bits

LIB = builtin_library()
N, H, C = EXT["N"], EXT["H"], EXT["C"]
SLOTS = [13, 2, 40, 7]


def _store(paged: str, obj: str) -> tuple[object, torch.Tensor | list[torch.Tensor]]:
    spec = LIB[paged]
    cache = make_cache(spec, torch.float32, "cpu")
    o = LIB[obj]
    shape = reference.layouts.leaf_shape(o, {**EXT, "T": len(SLOTS)})
    out = [torch.zeros(shape) for _ in range(EXT["L"])] if o.lists else torch.zeros(shape)
    reference.store(spec, o, EXT, cache, out, reference.Span(SLOTS, 0, len(SLOTS)))
    return cache, out


def test_flash_attn_nhd_to_kv_2ltd() -> None:
    cache, out = _store("vllm_flash_attn_nhd", "kv_2ltd")
    for t, s in enumerate(SLOTS):
        for layer in range(EXT["L"]):
            for kv in range(2):
                want = cache[layer][kv, s // N, s % N].reshape(H * C)
                assert torch.equal(out[kv, layer, t], want)


def test_flashinfer_hnd_to_kv_t2d() -> None:
    cache, out = _store("vllm_flashinfer_hnd", "kv_t2d")
    for t, s in enumerate(SLOTS):
        for layer in range(EXT["L"]):
            for kv in range(2):
                assert torch.equal(out[layer][t, kv], cache[layer][s // N, kv, :, s % N].reshape(H * C))


def test_packed_content_holds_k_first() -> None:
    cache, out = _store("vllm_packed_nhd", "kv_2ltd")
    for t, s in enumerate(SLOTS):
        k = cache[0][s // N, s % N, :, :C]
        v = cache[0][s // N, s % N, :, C:]
        assert torch.equal(out[0, 0, t], k.reshape(-1))
        assert torch.equal(out[1, 0, t], v.reshape(-1))


def test_sglang_mha_folded_slots() -> None:
    cache, out = _store("sglang_mha", "kv_2ltd")
    k_list, v_list = cache
    for t, s in enumerate(SLOTS):
        assert torch.equal(out[0, 2, t], k_list[2][s].reshape(-1))
        assert torch.equal(out[1, 2, t], v_list[2][s].reshape(-1))


def test_trtllm_pool_hnd_inside_block() -> None:
    cache, out = _store("trtllm_pool", "kv_2ltd")
    for t, s in enumerate(SLOTS):
        assert torch.equal(out[1, 1, t], cache[s // N, 1, 1, :, s % N].reshape(-1))


def test_mla_single_plane() -> None:
    cache, out = _store("vllm_mla", "kv_mla")
    for t, s in enumerate(SLOTS):
        assert torch.equal(out[0, 2, t], cache[2][s // N, s % N])


def test_codes_are_unique_per_element() -> None:
    cache = make_cache(LIB["vllm_flash_attn_nhd"], torch.bfloat16, "cpu")
    codes = torch.cat([t.view(torch.int16).flatten() for t in cache])
    assert codes.unique().numel() == codes.numel()


def test_make_cache_gives_fresh_coded_leaves() -> None:
    """make_cache copies one coded template: a cache written by a test never leaks into the
    next, and strided or odd-offset leaves hold the same codes as fill_cache writes."""
    spec = LIB["vllm_kv_tuple"]
    first = make_cache(spec, torch.bfloat16, "cpu")
    for t in tensors_of(first):
        t.zero_()
    direct = reference.layouts.nest(spec, EXT, lambda path: torch.zeros(reference.layouts.leaf_shape(spec, EXT),
                                                                dtype=torch.bfloat16))
    reference.layouts.fill_cache(spec, EXT, direct, torch.bfloat16)
    for strided, odd in [(False, False), (True, False), (False, True)]:
        cache = make_cache(spec, torch.bfloat16, "cpu", strided, odd)
        assert same_bits(cache, direct)
        leaves = tensors_of(cache)
        assert all(t.is_contiguous() != strided for t in leaves)
        assert all((t.storage_offset() % 2 == 1) == odd for t in leaves)


# -- the whole-array evaluation against element_address, one element at a time ---------------

def _one_by_one(paged, obj, cache, objects, slots, *, to_cache: bool) -> None:
    """The reference's definition written as loops: each element of each moved token from
    where element_address puts it in one spec to where it puts it in the other. A token of k
    stored slots (`slots_per_token`) is k rows: manager slot s is slots s * k + j, rows t * k + j."""
    per = paged.token_ratio[1]
    ext, oext = EXT, {**EXT, "T": len(slots) * per}
    has = {a: paged.has(a) for a in ("L", "KV", "H", "C")}
    rows = [(t * per + j, s * per + j if s >= 0 else -1) for t, s in enumerate(slots) for j in range(per)]
    for t, slot in rows:
        if slot < 0:
            continue
        for layer in range(EXT["L"] if has["L"] else 1):
            for kv in range(EXT["KV"] if has["KV"] else 1):
                for h in range(EXT["H"] if has["H"] else 1):
                    for c in range(EXT["C"] if has["C"] else 1):
                        at = {"l": layer, "kv": kv, "h": h, "c": c}
                        cpath, cidx = element_address(paged, {**at, "slot": slot}, ext)
                        opath, oidx = element_address(obj, {**at, "t": t}, oext)
                        here = bits(reference.leaf(cache, cpath))
                        there = bits(reference.leaf(objects, opath))
                        if to_cache:
                            here[cidx] = there[oidx]
                        else:
                            there[oidx] = here[cidx]


def _pairs() -> list[tuple[str, str]]:
    return [(p.paged.name, p.obj.name) for p in plan_library(LIB) if p.paged.is_simple]


def _objects(obj, tokens: int, salt: int):
    shape = reference.layouts.leaf_shape(obj, {**EXT, "T": tokens})
    out = [torch.zeros(shape) for _ in range(EXT["L"])] if obj.lists else torch.zeros(shape)
    reference.layouts.fill_object(tensors_of(out), torch.float32, salt)
    return out


@pytest.mark.parametrize("pair", _pairs(), ids="-".join)
def test_reference_moves_each_element_where_element_address_says(pair: tuple[str, str]) -> None:
    """Store and load of every simple built-in pair equal the element-by-element loop, for a
    mapping with a skipped token and, on load, a slot written twice (the later token wins)."""
    paged, obj = LIB[pair[0]], LIB[pair[1]]
    per = paged.token_ratio[1]  # a pooled cache: the mapping holds the manager's slots, 1 / k of the cache's
    slots = [s % (EXT["B"] * EXT["N"] // per) if s >= 0 else s for s in (13, -1, 2, 40, 7)]
    got, want = _objects(obj, len(slots) * per, 3), _objects(obj, len(slots) * per, 3)
    cache = make_cache(paged, torch.float32, "cpu")
    reference.store(paged, obj, EXT, cache, got, reference.Span(slots, 0, len(slots)))
    _one_by_one(paged, obj, cache, want, slots, to_cache=False)
    assert same_bits(got, want)

    twice = [slots[0], -1, 2, slots[0], 7]
    objects = _objects(obj, len(twice) * per, 900)
    loaded, expected = make_cache(paged, torch.float32, "cpu"), make_cache(paged, torch.float32, "cpu")
    reference.load(paged, obj, EXT, loaded, objects, reference.Span(twice, 0, len(twice)))
    _one_by_one(paged, obj, expected, objects, twice, to_cache=True)
    assert same_bits(loaded, expected)
    assert not same_bits(loaded, make_cache(paged, torch.float32, "cpu"))


def _transfer_one_by_one(src, src_ext, source, src_slots, dst, dst_ext, target, dst_slots, sh, dh) -> None:
    """The transfer reference's definition as loops: each element of each token whose two
    slots are >= 0, from where element_address puts it in the source to the destination."""
    snapshot = [bits(t).clone() for t in tensors_of(source)]
    paths = reference.layouts.leaf_paths(src, src_ext)
    frozen = reference.layouts.nest(src, src_ext, lambda path: snapshot[paths.index(path)])
    for s, d in zip(src_slots, dst_slots, strict=True):
        if s < 0 or d < 0:
            continue
        for layer in range(src_ext["L"]):
            for kv in range(src_ext["KV"] if src.has("KV") else 1):
                for j in range(sh[1] - sh[0]):
                    for c in range(src_ext["C"]):
                        at = {"l": layer, "kv": kv, "c": c}
                        spath, sidx = element_address(src, {**at, "h": sh[0] + j, "slot": s}, src_ext)
                        dpath, didx = element_address(dst, {**at, "h": dh[0] + j, "slot": d}, dst_ext)
                        bits(reference.leaf(target, dpath))[didx] = reference.leaf(frozen, spath)[sidx]


@pytest.mark.parametrize("heads", [None, ((1, 2), (0, 1))], ids=["all_heads", "one_head"])
def test_transfer_reference_moves_each_element_where_element_address_says(heads) -> None:
    """Every built-in transfer pair (with a head range where both have heads; a cache of head
    groups, in groups of two, moves a range of one group), with a skipped source slot and a
    destination slot written twice: the later token wins."""
    src_slots, dst_slots = [5, -1, 17, 30, 2], [9, 3, 38, 9, 11]
    for a, b in sorted(generated.TRANSFERS):
        src, dst = LIB[a], LIB[b]
        if heads is not None and not (src.has("H") and dst.has("H")):
            continue
        src_ext, dst_ext = fitted_extents((src, dst), (SRC_EXT, DST_EXT))  # groups of two heads, at least two groups
        ranges = ((2, 4), (0, 2)) if heads is not None and (src.head_groups or dst.head_groups) else heads
        sh, dh = ranges or (transfers.heads_of(src, src_ext, None), transfers.heads_of(dst, dst_ext, None))
        source = transfer_cache(src, src_ext, torch.float32, "cpu")
        got = transfer_cache(dst, dst_ext, torch.float32, "cpu", 50_000)
        want = clone_tree(got)
        transfers.transfer(transfers.TransferSide(src, src_ext, source, src_slots, sh),
            transfers.TransferSide(dst, dst_ext, got, dst_slots, dh))
        _transfer_one_by_one(src, src_ext, source, src_slots, dst, dst_ext, want, dst_slots, sh, dh)
        assert same_bits(got, want), (a, b)


# -- format 2: the planes reference against its row-by-row definition --------------------------

def _rows_one_by_one(paged, obj, ext, cache, objects, slots, *, to_cache: bool) -> None:
    """Each row (count values) of each plane of each moved token (once per chunk for a plane
    without slots), as bytes, from where plane_address puts it to where the object's
    ObjectAddresses does."""
    from kvgen.oracle.address import ObjectAddresses, plane_address, plane_count

    oext = {**ext, "T": len(slots)}
    leaves = {p: planes.read_leaf(reference.leaf(cache, p)) for p in planes.cache_paths(paged, ext)}
    if isinstance(objects, torch.Tensor):
        owned = {(): planes.read_leaf(objects)}
    else:
        owned = {p: planes.read_leaf(reference.leaf(objects, p)) for p in planes.object_paths(obj, oext)}
    sizes, item = planes.value_sizes(paged, cache), next(iter(owned.values())).item
    there_of = ObjectAddresses(paged, obj, oext, sizes, item).address
    moved = [(t, s) for t, s in enumerate(slots) if s >= 0]
    for plane in paged.moved_planes():
        count, size = plane_count(paged, plane, ext), sizes[plane.name]
        part_item = reference.leaf(cache, next(p for p in leaves if plane_address(
            paged, plane, {"l": 0, "kv": 0, "h": 0, "slot": 0, "c": 0}, ext, 1)[0] == p)).element_size()
        # a row is one run of bytes unless split axes tile C or put another axis inside it (vectorized_5d):
        # then each value is its own run
        runs = [(0, count)] if _row_is_one_run(paged, plane, ext, part_item, leaves, count, size) else [
            (c, 1) for c in range(count)]
        for t, slot in moved if plane.has_slots else moved[:1] and [(0, 0)]:
            for v in planes.value_rows(plane, ext):
                for c, values in runs:
                    cpath, cidx, cbyte = plane_address(paged, plane, {**v, "slot": slot, "c": c}, ext, part_item)
                    opath, oidx, obyte = there_of(plane, {**v, "t": t, "c": c})
                    a = leaves[cpath].offset(cidx, cbyte)
                    b = owned[opath].offset(oidx, obyte)
                    n = values * size
                    if to_cache:
                        leaves[cpath].data[a:a + n] = owned[opath].data[b:b + n]
                    else:
                        owned[opath].data[b:b + n] = leaves[cpath].data[a:a + n]
    for written in (leaves if to_cache else owned).values():
        written.write_back()


def _row_is_one_run(paged, plane, ext, item, leaves, count, size) -> bool:  # noqa: ANN001
    """Whether the first row's values lie one after another in the cache's bytes."""
    from kvgen.oracle.address import plane_address

    row = {**next(iter(planes.value_rows(plane, ext))), "slot": 0}
    first = None
    for c in range(count):
        path, index, byte = plane_address(paged, plane, {**row, "c": c}, ext, item)
        at = leaves[path].offset(index, byte)
        first = at if first is None else first
        if at != first + c * size:
            return False
    return True


def _parts_pairs() -> list[tuple[str, str]]:
    return [(p.paged.name, p.obj.name) for p in plan_connectors(LIB) if not p.paged.is_simple]


@pytest.mark.parametrize("pair", _parts_pairs(), ids="-".join)
def test_planes_reference_moves_each_row_where_the_addresses_say(pair: tuple[str, str]) -> None:
    """Store and load of every format-2 built-in pair equal the row-by-row loop, with a
    skipped token and, on load, a slot written twice (the later token wins)."""
    paged, obj = LIB[pair[0]], LIB[pair[1]]
    fit = fitted(paged, SCENARIOS["random_slots"]).ext  # whole tiles of slots and C for split axes
    ext = planes.parts_extents(paged, fit)
    connector = generated.get(paged.name, obj.name)(device="cpu")
    for slots, to_cache in (([13, -1, 2, 40, 7], False), ([13, -1, 2, 13, 7], True)):
        cache = make_cache(paged, torch.float32, "cpu", ext=fit)
        connector.bind(cache)
        shape, dtype = connector.get_shape(len(slots)), connector.get_dtype()
        made = []
        for _ in range(2):
            tree = [torch.zeros(shape, dtype=dtype) for _ in range(EXT["L"])] if obj.lists else torch.zeros(shape,
                                                                                                          dtype=dtype)
            for j, t in enumerate(tensors_of(tree)):
                planes.fill_bytes(t, f"object/{j}")
            made.append(tree)
        other = make_cache(paged, torch.float32, "cpu", ext=fit)
        move = planes.load if to_cache else planes.store
        move(paged, obj, ext, cache, made[0], reference.Span(slots, 0, len(slots)))
        _rows_one_by_one(paged, obj, ext, other, made[1], slots, to_cache=to_cache)
        assert same_bits(cache, other) and same_bits(made[0], made[1]), (pair, to_cache)


def test_the_reference_of_each_built_pair_is_the_module_of_its_kind() -> None:
    """reference.store / load pick, for every connector a build makes, the module named as the
    planner's PAIR_KINDS names the pair's kind (layouts: one tensor tree; planes: format 2)."""
    picked = {(p.paged.name, p.obj.name): (reference.module_of(p.paged, p.obj).__name__.rsplit(".", 1)[-1],
                                           kind_of(p).name) for p in plan_connectors(LIB)}
    assert {kind for kind, _ in picked.values()} == {"layouts", "planes"}
    assert {pair: got for pair, (got, want) in picked.items() if got != want} == {}


def test_the_reference_entry_point_moves_a_format_2_pair_as_the_planes_reference_does() -> None:
    """reference.store of a cache of several planes gives the bytes planes.store gives; the
    layouts reference, which reads one tensor tree, could not move its parts."""
    paged, obj = LIB["vllm_gaudi_fp8"], LIB["kv_planes"]
    ext = planes.parts_extents(paged, EXT)
    connector = generated.get(paged.name, obj.name)(device="cpu")
    cache = make_cache(paged, torch.float32, "cpu")
    connector.bind(cache)
    made = [torch.zeros(connector.get_shape(len(SLOTS)), dtype=connector.get_dtype()) for _ in range(2)]
    reference.store(paged, obj, ext, cache, made[0], reference.Span(SLOTS, 0, len(SLOTS)))
    planes.store(paged, obj, ext, cache, made[1], reference.Span(SLOTS, 0, len(SLOTS)))
    assert torch.equal(made[0], made[1]) and bool(made[0].any())


@pytest.mark.parametrize("module", ["vllm_flash_attn_nhd__kv_2ltd", "vllm_flash_attn_nhd__kv_2td"])
def test_objects_at_odd_offsets_keep_their_bits_and_label_one_element_into_their_storage(module: str) -> None:
    """at_odd_offsets: the scenario objects of a misaligned buffer, whole or per layer."""
    connector = generated.get(*module.split("__"))(device="cpu")
    connector.bind(make_cache(LIB[module.split("__")[0]], torch.float32, "cpu"))
    objs = make_objects(connector, [5, 3], torch.float32, "cpu", salt=11, fmt=connector.format)
    odd = at_odd_offsets(objs)
    flat = [o for c in objs for o in (c if isinstance(c, list) else [c])]
    moved = [o for c in odd for o in (c if isinstance(c, list) else [c])]
    assert len(moved) == len(flat) and all(m.tensor.storage_offset() == 1 for m in moved)
    assert same_bits([m.tensor for m in moved], [o.tensor for o in flat])
    assert {m.metadata.fmt for m in moved} == {connector.format}
    assert all(m.tensor.untyped_storage().data_ptr() != o.tensor.untyped_storage().data_ptr()
               for m, o in zip(moved, flat, strict=True))


def test_byte_write_back_of_wide_values_after_an_odd_number_of_bytes() -> None:
    """A plane's tensors end to end: a float32 tensor after 6 bytes of bfloat16 starts at byte 6,
    where a view as 4-byte words is not allowed; the write-back must still land every bit."""
    small = torch.arange(3, dtype=torch.int16).view(torch.bfloat16)
    wide = torch.arange(5, dtype=torch.int32).view(torch.float32)
    found = planes.Bytes([small, wide])
    found.data[6:].view(-1)[:] = torch.arange(20, dtype=torch.uint8) + 100
    found.write_back()
    assert wide.view(torch.uint8).tolist() == list(range(100, 120))
    assert small.view(torch.int16).tolist() == [0, 1, 2]


@pytest.mark.parametrize(("where", "want"), [
    ([4, 0, 2], [2, 0, 3, 0, 1, 0]),  # each position once: a plain scatter
    ([4, 0, 4, 2, 0], [5, 0, 4, 0, 3, 0]),  # positions 4 and 0 twice: the later write wins
    ([1, 1, 1], [0, 3, 0, 0, 0, 0]),
])
def test_put_last_keeps_the_later_of_two_writes_to_one_position(where: list[int], want: list[int]) -> None:
    from kvgen.oracle.reference.common import put_last

    dst = torch.zeros(6, dtype=torch.int32)
    put_last(dst, torch.tensor(where), torch.arange(1, len(where) + 1))
    assert dst.tolist() == want
