"""Every generated connector refuses bad input with a KVLayoutError, before writing anything.

One test per check, over a representative set of layouts (a list of per-layer tensors, a
(K, V) tuple per layer, SGLang's K and V lists of folded slot buffers, one cross-layer
tensor, MLA with no KV and no heads) and two layerwise pairs. Each test asserts the
message says what was expected (the spec's arrow form with sizes) and what was received,
and that cache and memory objects (tensors and format labels) are bit-for-bit unchanged.
Batches hold two chunks and the bad item is the last one checked, so a connector that
wrote the first chunk before checking the second would be caught.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from harness import EXT, block_table_mapping, builtin_library, clone_tree, make_cache, make_objects, same_bits
from harness import tensors_of as leaves

from kvgen import generated
from kvgen.notation import format_layout as arrow
from kvgen.oracle import reference
from kvgen.runtime import KVLayoutError, MemoryObj
from kvgen.runtime.connector import _same_device
from kvgen.runtime.memory import Format
from kvgen.runtime.ops import bits

LIBRARY = builtin_library()
PAIRS = [
    ("vllm_flash_attn_nhd", "kv_2ltd"),
    ("vllm_kv_tuple", "kv_2ltd"),
    ("sglang_mha", "kv_2ltd"),
    ("vllm_cross_layer", "kv_2ltd"),
    ("vllm_mla", "kv_mla"),
    ("vllm_flash_attn_nhd", "kv_t2d"),  # layerwise
    ("sglang_mha", "kv_2td"),  # layerwise, folded slots
]
STARTS, ENDS = (0, 8), (6, 13)
SEQ = 13
SLOTS = EXT["B"] * EXT["N"]
DIRECTIONS = ["store", "load"]
DEFAULT: Any = object()  # "the case's own" (None is a bad input of its own)


def _pair_id(pair: tuple[str, str]) -> str:
    return f"{pair[0]}-{pair[1]}"


# -- a connector, its cache and objects; running one transfer ---------------------------------


@dataclass
class Case:
    paged: str
    obj: str
    conn: Any
    cache: Any
    mapping: torch.Tensor

    @property
    def layout(self) -> Any:
        return self.conn.layout

    @property
    def layerwise(self) -> bool:
        return self.conn.layerwise

    def cache_expected(self) -> str:
        """The cache's arrow with its fixed sizes, as kvcaches messages give it."""
        return arrow(self.layout.lists, self.layout.dims, dict(self.layout.sizes))

    def object_expected(self, num_tokens: int) -> str:
        g = self.conn.geometry
        return self.conn.memory.arrow({**g.extents(), "T": num_tokens})

    def objects(self, direction: str, salt: int = 11) -> Any:
        """Objects in the connector's own form: a list per chunk (whole); memory_objs[layer][chunk]
        (layerwise store); the list sent for each layer (layerwise load)."""
        fmt = self.conn.format if direction == "load" else None
        lengths = [e - s for s, e in zip(STARTS, ENDS, strict=True)]
        per_chunk = make_objects(self.conn, lengths, torch.float32, "cpu", salt, fmt)
        if not self.layerwise:
            return per_chunk
        return [[chunk[layer] for chunk in per_chunk] for layer in range(EXT["L"])]

    def run(self, direction: str, objs: Any, *, cache: Any = DEFAULT, mapping: Any = DEFAULT,
            starts: Any = STARTS, ends: Any = ENDS, **kwargs: Any) -> None:
        cache = self.cache if cache is DEFAULT else cache
        mapping = self.mapping if mapping is DEFAULT else mapping
        conn = self.conn
        if not self.layerwise:
            move = conn.batched_from_gpu if direction == "store" else conn.batched_to_gpu
            move(objs, starts, ends, kvcaches=cache, slot_mapping=mapping, **kwargs)
        elif direction == "store":
            for _ in conn.batched_from_gpu(objs, starts, ends, kvcaches=cache, slot_mapping=mapping, **kwargs):
                pass
        else:
            gen = conn.batched_to_gpu(starts, ends, kvcaches=cache, slot_mapping=mapping, **kwargs)
            next(gen)
            for layer in range(EXT["L"]):
                gen.send(objs[layer] if layer < len(objs) else None)
            next(gen, None)


def make_case(pair: tuple[str, str], device: str | None = "cpu") -> Case:
    paged, obj = pair
    conn = generated.get(paged, obj)(device=device)
    cache = make_cache(LIBRARY[paged], torch.float32, "cpu")
    conn.bind(cache)
    mapping = torch.tensor(block_table_mapping(SEQ, random.Random(_pair_id(pair)), EXT))
    return Case(paged, obj, conn, cache, mapping)


def victim(case: Case, direction: str, objs: Any) -> tuple[Any, int, int]:
    """Where the bad object goes: (container, index) of the last object checked before any
    write: chunk 2 of the batch; of the last layer (layerwise store) or of layer 0 (a
    layerwise load checks each layer's objects as they are sent)."""
    if not case.layerwise:
        return objs, 1, ENDS[1] - STARTS[1]
    row = objs[-1] if direction == "store" else objs[0]
    return row, 1, ENDS[1] - STARTS[1]


# -- bit-for-bit snapshots -----------------------------------------------------------------------


def freeze(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.device.type == "meta":
            return ("meta", tuple(value.shape), value.dtype)
        return ("tensor", tuple(value.shape), value.dtype, bits(value).detach().cpu().clone())
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [freeze(v) for v in value])
    if hasattr(value, "tensor") or hasattr(value, "metadata"):
        meta = getattr(value, "metadata", None)
        return ("object", freeze(getattr(value, "tensor", None)), repr(getattr(meta, "fmt", None)))
    return ("value", repr(value))


def same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def refused(case: Case, direction: str, objs: Any, *expected: str, **kwargs: Any) -> str:
    """Run a transfer that must fail; check the message and that nothing changed."""
    cache = kwargs.get("cache", case.cache)
    before = freeze((cache, objs, case.cache))
    with pytest.raises(KVLayoutError) as info:
        case.run(direction, objs, **kwargs)
    message = str(info.value)
    for part in expected:
        assert part in message, f"{part!r} not in the message:\n{message}"
    assert same(freeze((cache, objs, case.cache)), before), "a refused transfer changed the cache or an object"
    return message


# -- reshaping a cache -------------------------------------------------------------------------------


def map_leaves(tree: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    return type(tree)(map_leaves(t, fn) for t in tree)


def replace_last_leaf(tree: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    target = leaves(tree)[-1]
    return map_leaves(tree, lambda t: fn(t) if t is target else t)


def kv_dim(case: Case) -> int | None:
    return next((i for i, d in enumerate(case.layout.dims) if d == ("KV",)), None)


# -- kvcaches --------------------------------------------------------------------------------------


@pytest.fixture(params=PAIRS, ids=_pair_id)
def case(request: pytest.FixtureRequest) -> Case:
    return make_case(request.param)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("what", ["other_container", "none", "dict", "string"])
def test_kvcaches_not_a_list(case: Case, direction: str, what: str) -> None:
    if what == "other_container":
        # a stacked tensor where lists are expected, a list where one tensor is expected
        bad = leaves(case.cache)[0] if case.layout.lists else [case.cache]
        got = "Tensor" if case.layout.lists else "list"
    else:
        bad = {"none": None, "dict": {"k": case.cache}, "string": "kv"}[what]
        got = type(bad).__name__
    refused(case, direction, case.objects(direction), f"{case.paged}: kvcaches must be {case.cache_expected()}",
            f"got {got}", cache=bad)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_kvcaches_wrong_nesting(case: Case, direction: str) -> None:
    lists = case.layout.lists
    if lists == ("L",):
        bad, why = [(t,) for t in case.cache], "expected tensors under the list levels, got tuple"
    elif lists == ("L", "KV"):
        bad, why = [pair[0] for pair in case.cache], "level KV must be a list or tuple, got Tensor"
    elif lists == ("KV", "L"):  # handed over layer-major instead of K list, V list
        bad, why = [list(layer) for layer in zip(*case.cache, strict=True)], f"KV must be 2, got {EXT['L']}"
    else:
        bad, why = [[case.cache]], "expected tensors under the list levels, got list"
    refused(case, direction, case.objects(direction), case.cache_expected(), why, "(got list of", cache=bad)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_kvcaches_empty(case: Case, direction: str) -> None:
    if case.layout.lists:
        bad, why = [], f"level {case.layout.lists[0]} must be non-empty"
        got = "got list of 0 x nothing"
    else:
        t = case.cache
        bad, why, got = t[:0], "every extent must be positive, got B=0", "tensor[0,"
    refused(case, direction, case.objects(direction), case.cache_expected(), why, got, cache=bad)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_kvcaches_ragged_list_levels(direction: str) -> None:
    case = make_case(("vllm_kv_tuple", "kv_2ltd"))
    bad = [*case.cache[:-1], case.cache[-1][:1]]
    refused(case, direction, case.objects(direction), "L -> KV=2 -> [B N H C]",
            "level KV must be non-empty and the same length everywhere, got lengths [1, 2]", cache=bad)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("count", [1, 3])
def test_wrong_number_of_k_v_entries(case: Case, direction: str, count: int) -> None:
    lists = case.layout.lists
    if not case.layout.has("KV"):
        pytest.skip("MLA holds one plane: no K/V axis")
    if "KV" in lists:
        def resize(kv: Any) -> Any:
            return type(kv)(kv[i % 2] for i in range(count))
        bad = resize(case.cache) if lists[0] == "KV" else [resize(layer) for layer in case.cache]
    else:
        d = kv_dim(case)
        def resize_dim(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.narrow(d, 0, 1)], d) if count == 3 else t.narrow(d, 0, 1)
        bad = map_leaves(case.cache, resize_dim)
    refused(case, direction, case.objects(direction), case.cache_expected(), f"KV must be 2, got {count}", cache=bad)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_wrong_rank(case: Case, direction: str) -> None:
    rank = len(case.layout.dims)
    bad = map_leaves(case.cache, lambda t: t.unsqueeze(-1))
    refused(case, direction, case.objects(direction), case.cache_expected(),
            f"tensors must have {rank} dims, got {rank + 1}", cache=bad)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
def test_disallowed_dtype(case: Case, direction: str, dtype: torch.dtype) -> None:
    bad = map_leaves(case.cache, lambda t: t.to(dtype))
    name = str(dtype).removeprefix("torch.")
    refused(case, direction, case.objects(direction), case.cache_expected(), f"dtype {name} is not one of float32",
            cache=bad)


def test_dtype_outside_the_spec_list() -> None:
    """A layout that declares `dtypes` refuses the others, even ones another layout allows."""
    from kvgen.runtime import CacheReader, PagedLayout

    spec = PagedLayout(name="bf16_only", lists=("L",), dims=(("KV",), ("B",), ("N",), ("H",), ("C",)),
                       sizes=(("KV", 2),), dtypes=("bfloat16",))
    with pytest.raises(KVLayoutError, match=r"bf16_only: kvcaches must be L -> \[KV=2 B N H C\]: dtype float16 "
                                            r"is not one of bfloat16 \(got list of 2 x tensor\[2, 3, 4, 1, 8\]"):
        CacheReader(spec, [torch.zeros(2, 3, 4, 1, 8, dtype=torch.float16)] * 2).leaves()


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("what", ["shape", "dtype", "device"])
def test_layers_differ(case: Case, direction: str, what: str) -> None:
    if not case.layout.lists:
        pytest.skip("one tensor holds every layer")
    change = {
        "shape": lambda t: t.narrow(-1, 0, t.shape[-1] - 1),
        "dtype": lambda t: t.to(torch.float16),
        "device": lambda t: t.to("meta"),
    }[what]
    bad = replace_last_leaf(case.cache, change)
    refused(case, direction, case.objects(direction), case.cache_expected(),
            "every tensor must have one shape, dtype and device", "float32 on cpu and tensor[", cache=bad)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_cache_on_another_device(direction: str) -> None:
    case = make_case(("vllm_flash_attn_nhd", "kv_2ltd"))
    objs = case.objects(direction)
    case.conn.device = torch.device("meta")  # as if made with device="meta"
    case.conn._key = None
    refused(case, direction, objs, "kvcaches must be L=3 -> [KV=2 B=12 N=4 H=2 C=4] on meta (the connector's device)",
            "got list of 3 x tensor[2, 12, 4, 2, 4] float32 on cpu")


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_cache_without_storage(case: Case, direction: str) -> None:
    bad = map_leaves(case.cache, lambda t: t.to("meta"))
    refused(case, direction, case.objects(direction), case.cache_expected(),
            "cache tensors must have storage", "on meta", cache=bad)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_cache_with_shared_slots(case: Case, direction: str) -> None:
    """An expanded view (stride 0) would have two slots share one element."""
    def expand(t: torch.Tensor) -> torch.Tensor:
        d = next(i for i, n in enumerate(t.shape) if n > 1)
        return t.narrow(d, 0, 1).expand(t.shape)

    refused(case, direction, case.objects(direction), case.cache_expected(), "stride 0",
            cache=map_leaves(case.cache, expand))


def test_same_device_rule() -> None:
    cuda0, cuda1 = torch.device("cuda:0"), torch.device("cuda:1")
    assert _same_device(cuda0, torch.device("cuda"))  # made for "cuda", cache on cuda:0
    assert _same_device(cuda1, cuda1) and not _same_device(cuda0, cuda1)
    assert not _same_device(torch.device("cpu"), torch.device("cuda"))
    assert _same_device(torch.device("cpu"), torch.device("cpu"))


def test_validation_runs_once_per_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checking a cache is per registered cache, not per call or token."""
    case = make_case(("vllm_flash_attn_nhd", "kv_2ltd"))
    calls = []
    real = type(case.conn).read_geometry
    monkeypatch.setattr(type(case.conn), "read_geometry", staticmethod(lambda c: calls.append(1) or real(c)))
    for _ in range(3):
        case.run("store", case.objects("store"))
    assert calls == []  # bound in make_case already
    other = make_cache(LIBRARY["vllm_flash_attn_nhd"], torch.float32, "cpu")
    case.run("store", case.objects("store"), cache=other)
    case.run("store", case.objects("store"), cache=other)
    assert calls == [1]


# -- memory objects ---------------------------------------------------------------------------------


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("what", ["one_token_more", "one_token_less", "flat", "dtype"])
def test_object_wrong_shape_or_dtype(case: Case, direction: str, what: str) -> None:
    objs = case.objects(direction)
    row, i, n = victim(case, direction, objs)
    t = row[i].tensor
    bad = {
        "one_token_more": lambda: torch.zeros(case.conn.get_shape(n + 1)),
        "one_token_less": lambda: torch.zeros(case.conn.get_shape(n - 1)),
        "flat": lambda: t.reshape(-1),
        "dtype": lambda: t.to(torch.float16),
    }[what]()
    row[i] = MemoryObj(bad, row[i].metadata.fmt)
    shape = list(case.conn.get_shape(n))
    refused(case, direction, objs, f"memory object must be {case.obj} {case.object_expected(n)} float32 "
            f"(shape {shape}), got tensor[{', '.join(map(str, bad.shape))}] {str(bad.dtype).removeprefix('torch.')}")


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("what", ["bare_tensor", "no_metadata", "no_fmt", "none"])
def test_object_missing_attributes(case: Case, direction: str, what: str) -> None:
    objs = case.objects(direction)
    row, i, n = victim(case, direction, objs)
    t = row[i].tensor
    row[i] = {"bare_tensor": t, "no_metadata": SimpleNamespace(tensor=t),
              "no_fmt": SimpleNamespace(tensor=t, metadata=SimpleNamespace()), "none": None}[what]
    got = {"bare_tensor": "got tensor[", "no_metadata": "got SimpleNamespace with .tensor tensor[",
           "no_fmt": "got SimpleNamespace with .tensor tensor[", "none": "got NoneType"}[what]
    refused(case, direction, objs, f"expected a memory object with .tensor ({case.obj} {case.object_expected(n)} "
            "float32) and .metadata.fmt", got)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_object_label_not_a_format(case: Case, direction: str) -> None:
    objs = case.objects(direction)
    row, i, _ = victim(case, direction, objs)
    row[i].metadata.fmt = 6  # a bare code, not a label with a .name
    refused(case, direction, objs, "memory object format label must be None or have a .name",
            f"(expected {case.conn.memory.format}), got 6")


def test_load_demands_the_connectors_format(case: Case) -> None:
    for label, name in ((None, "UNDEFINED"), (Format("KV_2TD_OTHER", 99), "KV_2TD_OTHER")):
        objs = case.objects("load")
        row, i, n = victim(case, "load", objs)
        row[i].metadata.fmt = label
        refused(case, "load", objs, f"cannot load an object labelled {name}: this connector reads "
                f"{case.conn.memory.format} ({case.obj} {case.object_expected(n)} float32)")


def test_store_accepts_only_the_allowed_labels(case: Case) -> None:
    memory = case.conn.memory
    foreign = next(f for f in ("KV_MLA_FMT", "KV_2LTD", "KV_T2D") if f != memory.format and f not in memory.accepts)
    objs = case.objects("store")
    row, i, _ = victim(case, "store", objs)
    row[i].metadata.fmt = Format(foreign, 42)
    allowed = ", ".join([memory.format, *memory.accepts])
    refused(case, "store", objs, f"cannot store {memory.format} into an object labelled {foreign}; "
            f"allowed labels before a store: {allowed}")
    # and the allowed ones do store
    for label in (None, case.conn.format, *(Format(a, 0) for a in memory.accepts)):
        ok = case.objects("store")
        row, i, _ = victim(case, "store", ok)
        row[i].metadata.fmt = label
        case.run("store", ok)


def test_store_into_shared_memory_object(case: Case) -> None:
    objs = case.objects("store")
    row, i, n = victim(case, "store", objs)
    shape = case.conn.get_shape(n)
    row[i] = MemoryObj(torch.zeros(1).expand(shape))
    refused(case, "store", objs, f"memory object {case.obj} {case.object_expected(n)} float32 has dims", "stride 0")


# -- slot mapping, starts and ends ------------------------------------------------------------------


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("what", ["float", "bool", "uint8", "uint16", "uint32", "uint64", "complex", "two_dims", "list",
                                  "meta"])
def test_slot_mapping_type(case: Case, direction: str, what: str) -> None:
    m = case.mapping
    wrapping = m.clamp(min=0)
    wrapping[0] = torch.iinfo(torch.int64).min
    wrapping = wrapping.view(torch.uint64)  # slot 2**63: as int64 a negative slot, the token skipped unsaid
    bad, expected, got = {
        "float": (m.float(), "must hold signed integers", "got tensor[13] float32"),
        "bool": (m > 0, "must hold signed integers", "got tensor[13] bool"),
        "uint8": (m.to(torch.uint8), "must hold signed integers", "got tensor[13] uint8"),
        "uint16": (m.to(torch.uint16), "must hold signed integers", "got tensor[13] uint16"),
        "uint32": (m.to(torch.uint32), "must hold signed integers", "got tensor[13] uint32"),
        "uint64": (wrapping, "must hold signed integers", "got tensor[13] uint64"),
        "complex": (m.to(torch.complex64), "must hold signed integers", "got tensor[13] complex64"),
        "two_dims": (m.view(1, -1), "must be a 1-D integer tensor", "got tensor[1, 13] int64"),
        "list": (m.tolist(), "must be a 1-D integer tensor", "got list of 13 x int"),
        "meta": (m.to("meta"), "must be on the cpu or on cpu", "got tensor[13] int64 on meta"),
    }[what]
    refused(case, direction, case.objects(direction), f"slot_mapping {expected}", got, mapping=bad)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_slot_mapping_too_short(case: Case, direction: str) -> None:
    refused(case, direction, case.objects(direction), "tokens [8, 13) with offset 0 need slot_mapping[8:13], "
            "but slot_mapping has 12 entries: end 13 is beyond the last token the mapping holds (11)",
            mapping=case.mapping[:12])


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("slot", [SLOTS, SLOTS + 1000])
def test_slot_outside_the_cache(case: Case, direction: str, slot: int) -> None:
    bad = case.mapping.clone()
    bad[-1] = slot
    refused(case, direction, case.objects(direction), f"slot {slot} is outside the cache, which has {SLOTS} slots "
            f"(valid slots: 0..{SLOTS - 1}, or < 0 to skip a token)", mapping=bad)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("what", ["negative_start", "end_before_start", "end_beyond_mapping", "more_starts",
                                  "more_ends", "float_start", "string_ends", "offset_after_start"])
def test_chunk_bounds(case: Case, direction: str, what: str) -> None:
    objs = case.objects(direction)
    starts, ends, kwargs = list(STARTS), list(ENDS), {}
    if what == "negative_start":
        starts[1] = -1
        expected = "tokens [-1, 13) with offset 0 need slot_mapping[-1:13], but slot_mapping has 13 entries: " \
                   "start -1 is before the first token the mapping holds (0)"
    elif what == "end_before_start":
        ends[1] = 7
        expected = "a chunk must have start <= end, got start 8 and end 7"
    elif what == "end_beyond_mapping":
        ends[1] = 14
        expected = "need slot_mapping[8:14], but slot_mapping has 13 entries"
    elif what == "more_starts":
        starts.append(13)
        expected = "expected one end per start, got 3 starts [0, 8, 13] but 2 ends [6, 13]"
    elif what == "more_ends":
        ends.append(13)
        expected = "expected one end per start, got 2 starts [0, 8] but 3 ends [6, 13, 13]"
    elif what == "float_start":
        starts[1] = 8.5
        expected = "starts[1] must be an integer, got float 8.5"
    elif what == "string_ends":
        ends = "6,13"
        expected = "ends must be a list of integers (one per chunk), got str"
    else:
        kwargs["offset"] = 4
        expected = "tokens [0, 6) with offset 4 need slot_mapping[-4:2]"
    refused(case, direction, objs, expected, starts=starts, ends=ends, **kwargs)


@pytest.mark.parametrize("skip", [-1, 6, 100])
def test_skip_prefix_out_of_range(case: Case, skip: int) -> None:
    """The skip applies to every chunk: 6 fits the first chunk (6 tokens), not the second (5)."""
    n = 5 if skip == 6 else 6
    refused(case, "load", case.objects("load"), f"skip_prefix_n_tokens must be in [0, {n}] for a chunk of {n} "
            f"tokens, got {skip}", skip_prefix_n_tokens=skip)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_positions_may_be_integer_scalars(case: Case, direction: str) -> None:
    """An int32 tensor of starts and a 0-d tensor among the ends move exactly the tokens the
    same positions as Python ints move, checked against the reference."""
    paged, obj = LIBRARY[case.paged], LIBRARY[case.obj]
    objs = case.objects(direction)
    if case.layerwise:  # [layer][chunk] -> per chunk, the list of per-layer tensors
        chunks = [[objs[layer][i].tensor for layer in range(EXT["L"])] for i in range(len(STARTS))]
    else:
        chunks = [o.tensor for o in objs]
    want_chunks, want_cache = clone_tree(chunks), clone_tree(case.cache)
    before = clone_tree((chunks, case.cache))

    case.run(direction, objs, starts=torch.tensor(STARTS, dtype=torch.int32), ends=[torch.tensor(ENDS[0]), ENDS[1]])
    mapping = case.mapping.tolist()
    for i, (start, end) in enumerate(zip(STARTS, ENDS, strict=True)):
        move = reference.store if direction == "store" else reference.load
        move(paged, obj, EXT, want_cache, want_chunks[i], reference.Span(mapping, start, end))
    assert same_bits((chunks, case.cache), (want_chunks, want_cache)), "data differ from the reference"
    assert not same_bits((chunks, case.cache), before), "nothing moved"


# -- how many objects --------------------------------------------------------------------------------

WHOLE = [p for p in PAIRS if not generated.get(*p).layerwise]
LAYERWISE = [p for p in PAIRS if generated.get(*p).layerwise]


@pytest.mark.parametrize("pair", WHOLE, ids=_pair_id)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_whole_object_count(pair: tuple[str, str], direction: str) -> None:
    case = make_case(pair)
    objs = case.objects(direction)
    refused(case, direction, objs[:1], "expected a list of 2 memory objects (one per chunk), got list of 1 x MemoryObj")
    refused(case, direction, objs[0], "expected a list of 2 memory objects (one per chunk), got MemoryObj")


@pytest.mark.parametrize("pair", LAYERWISE, ids=_pair_id)
@pytest.mark.parametrize("what", ["missing_layer", "extra_layer", "missing_chunk", "flat", "not_a_list"])
def test_layerwise_store_object_layout(pair: tuple[str, str], what: str) -> None:
    case = make_case(pair)
    objs = case.objects("store")
    bad, got = {
        "missing_layer": (objs[:-1], "got list of 2 x list of 2 x MemoryObj (objects per layer: [2, 2])"),
        "extra_layer": ([*objs, objs[0]], "(objects per layer: [2, 2, 2, 2])"),
        "missing_chunk": ([*objs[:-1], objs[-1][:1]], "(objects per layer: [2, 2, 1])"),
        "flat": ([row[0] for row in objs], "got list of 3 x MemoryObj (objects per layer: "
                                           "['MemoryObj', 'MemoryObj', 'MemoryObj'])"),
        "not_a_list": (objs[0][0], "got MemoryObj (objects per layer: MemoryObj)"),
    }[what]
    n = "T"
    expected = f"expected memory_objs[3 layers][2 chunks] of {case.obj} {case.object_expected(0).replace('T=0', n)}"
    refused(case, "store", bad, expected, got)


@pytest.mark.parametrize("pair", LAYERWISE, ids=_pair_id)
@pytest.mark.parametrize("what", ["missing_chunk", "none", "single_object"])
def test_layerwise_load_sent_objects(pair: tuple[str, str], what: str) -> None:
    case = make_case(pair)
    objs = case.objects("load")
    sent, got = {
        "missing_chunk": ([objs[0][:1], *objs[1:]], "got list of 1 x MemoryObj"),
        "none": ([], "got NoneType"),
        "single_object": ([objs[0][0], *objs[1:]], "got MemoryObj"),
    }[what]
    refused(case, "load", sent, "layer 0: send() a list of one memory object per chunk (2)", got)


@pytest.mark.parametrize("pair", LAYERWISE, ids=_pair_id)
def test_layerwise_load_refuses_a_later_layer_without_writing_it(pair: tuple[str, str]) -> None:
    """Objects arrive a layer at a time, so earlier layers are already loaded; the refused
    layer and the ones after it stay as they were."""
    case = make_case(pair)
    objs = case.objects("load")
    objs[1][1] = MemoryObj(torch.zeros(case.conn.get_shape(3)), case.conn.format)
    before = freeze(case.cache)
    with pytest.raises(KVLayoutError, match=r"memory object must be .* \(shape \[.*\]\), got tensor\["):
        case.run("load", objs)
    after = freeze(case.cache)

    def layer(tree: Any, index: int) -> Any:
        """Layer `index` of a frozen cache: (L) list for vllm, [K list, V list] for SGLang."""
        _, items = tree
        if case.layout.lists[0] == "L":
            return items[index]
        return [kv[1][index] for kv in items]

    assert not same(layer(after, 0), layer(before, 0)), "layer 0 should have been loaded"
    for index in (1, 2):
        assert same(layer(after, index), layer(before, index)), f"layer {index} was written"
