"""Model groups of several tokens per stored slot (`tokens_per_slot`, vLLM's tokens_per_state:
DeepSeek-V4's compressed caches): the group's slot mapping names one slot per k tokens, its member
object holds one row per k tokens, chunks start and end on whole slots, each checked before the
first write. The generated connector agrees with the reference (kvgen.oracle.reference.models) bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from model_harness import build_models

from kvgen.oracle.reference import models
from kvgen.oracle.scenarios import models as ms
from kvgen.runtime import KVLayoutError

SPECS = Path(__file__).resolve().parent / "specs_ratio"


@pytest.fixture(scope="module")
def toys(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_models(tmp_path_factory.mktemp("ratio"), (SPECS,))


@pytest.mark.parametrize("scenario", ["whole_blocks", "minus1_per_group", "sliding_window_chunks", "offset_skip"])
def test_compressed_group_matches_reference(toys: Any, scenario: str) -> None:
    lib = toys.library
    assert ms.check_model(toys, lib, lib.model("toy_compressed"), lib["kv_groups"], ms.SCENARIOS[scenario]) == \
        (True, True)


class Setup:
    def __init__(self, toys: Any) -> None:
        lib = toys.library
        self.case = models.model_case(lib, lib.model("toy_compressed"), lib["kv_groups"], set(toys.CONNECTORS),
                                      models.CaseSizes(blocks=8))
        self.conn = toys.get_model("toy_compressed", "kv_groups")()
        self.kv = ms.make_kvcaches(self.case)
        self.maps = {"full": torch.arange(16), "compressed": torch.tensor([5, 2, 7, 0])}  # 16 tokens, 4 states
        self.obj = ms.make_objects(self.conn, [16], self.kv, "r")[0]


def test_the_object_holds_one_row_per_state(toys: Any) -> None:
    s = Setup(toys)
    sections = {x.name: x for x in s.conn.sections(16, s.kv)}
    c = s.kv[1].shape[-1]  # the compressed group's row: C values of float32
    assert sections["compressed"].nbytes == 2 * (16 // 4) * c * 4  # [1, L=2, T=4, C]
    s.conn.from_gpu(s.obj, 0, 16, kvcaches=s.kv, slot_mappings=s.maps)
    rows = s.conn.member_view(s.obj, "compressed", 16, s.kv).tensor.reshape(2, 4, c)
    for k, layer in enumerate((1, 3)):
        n = s.kv[layer].shape[2]
        for t, slot in enumerate([5, 2, 7, 0]):
            assert torch.equal(rows[k, t], s.kv[layer][slot // n, 0, slot % n]), (layer, t)


def _unchanged(s: Setup, action: Any, match: str) -> None:
    before_obj, before_kv = s.obj.tensor.clone(), ms.clone_tree(s.kv)
    with pytest.raises(KVLayoutError, match=match):
        action()
    assert torch.equal(s.obj.tensor, before_obj) and ms.same_bits(s.kv, before_kv)


@pytest.mark.parametrize("direction", ["from_gpu", "to_gpu"])
def test_slot_mappings_and_chunks_off_whole_slots_are_refused(toys: Any, direction: str) -> None:
    s = Setup(toys)
    s.conn.from_gpu(s.obj, 0, 16, kvcaches=s.kv, slot_mappings=s.maps)  # labelled, so a load may read it
    move = getattr(s.conn, direction)
    per_token = {**s.maps, "compressed": torch.arange(16)}
    _unchanged(s, lambda: move(s.obj, 0, 16, kvcaches=s.kv, slot_mappings=per_token),
               r"lengths differ \(full: 16, compressed: 16 \(x4 tokens\)\)")
    _unchanged(s, lambda: move(s.obj, 2, 14, kvcaches=s.kv, slot_mappings=s.maps),
               "group 'compressed' stores one slot per 4 tokens: start 2 is not a multiple of 4")
    shorter = {"full": s.maps["full"][:12], "compressed": s.maps["compressed"][:3]}  # tokens 2..13
    _unchanged(s, lambda: move(s.obj, 4, 12, kvcaches=s.kv, slot_mappings=shorter, offset=2),
               "offset 2 is not a multiple of 4")


def test_a_chunk_of_part_of_a_state_has_no_object(toys: Any) -> None:
    s = Setup(toys)
    with pytest.raises(KVLayoutError, match="a chunk of 10 is not a multiple of 4"):
        s.conn.get_shape(10, s.kv)


def test_the_reference_reads_the_ratio_from_the_spec(toys: Any) -> None:
    lib = toys.library
    case = models.model_case(lib, lib.model("toy_compressed"), lib["kv_groups"], set(toys.CONNECTORS))
    assert [g.tokens_per_slot for g in case.groups] == [1, 4]
