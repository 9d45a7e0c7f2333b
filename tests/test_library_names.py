"""Looking up a layout or object by name: names, aliases in any case, LMCache format names."""

from __future__ import annotations

import pytest

from kvgen.errors import KVGenError, KVLayoutError
from kvgen.spec.library import load_library
from kvgen.tools.cli import main


@pytest.fixture(scope="module")
def library():
    return load_library()


@pytest.mark.parametrize("name,want", [
    ("vllm_flash_attn_nhd", "vllm_flash_attn_nhd"),
    ("NHD", "vllm_flash_attn_nhd"),
    ("nhd", "vllm_flash_attn_nhd"),
    ("Hnd", "vllm_flash_attn_hnd"),
    ("VLLM_MLA", "vllm_mla"),
    ("sglang_mha", "sglang_mha"),
    ("lbnhc", "vllm_lbnhc"),  # vLLM 0.33's KVCacheLayout name (aliases ignore case)
    # LMCache's names of memory formats
    ("KV_2LTD", "kv_2ltd"),
    ("KV_T2D", "kv_t2d"),
    ("kv_2td", "kv_2td"),
    # LMCache's names of paged formats, where one layout has the name
    ("NL_X_TWO_NB_BS_NH_HS", "vllm_flash_attn_nhd"),
    ("two_x_nl_x_nbbs_nh_hs", "sglang_mha"),
])
def test_lookup(library, name: str, want: str) -> None:
    assert library[name].name == want


def test_a_format_of_two_objects_names_both(library) -> None:
    with pytest.raises(KVLayoutError) as info:
        library["KV_MLA_FMT"]
    assert "kv_mla" in str(info.value) and "kv_mla_layer" in str(info.value)


def test_unknown_name_lists_names_and_aliases(library) -> None:
    with pytest.raises(KVGenError) as info:
        library["nope"]
    assert not isinstance(info.value, KeyError)
    message = str(info.value)
    assert "no layout or object named 'nope'" in message and "`kvgen list` shows all" in message
    for typo, known in (("vllm_flash_attn_nh", "vllm_flash_attn_nhd (NHD, "), ("kv_2ltdd", "kv_2ltd (KV_2LTD)"),
                        ("sglang_mh", "sglang_mha (SGLANG_MHA, "), ("vllm_ml", "vllm_mla (MLA, ")):
        with pytest.raises(KVGenError) as info:
            library[typo]
        assert str(info.value).split("closest: ", 1)[1].startswith(known), (typo, str(info.value))


def test_explain_by_lowercase_alias_and_format(capsys) -> None:
    assert main(["explain", "nhd"]) == 0
    assert capsys.readouterr().out.startswith("vllm_flash_attn_nhd (paged)")
    assert main(["explain", "KV_2LTD"]) == 0
    assert capsys.readouterr().out.startswith("kv_2ltd (object)")


def test_explain_unknown_names_the_aliases(capsys) -> None:
    assert main(["explain", "flash_attn_nhd"]) == 1
    err = capsys.readouterr().err
    assert "closest: vllm_flash_attn_nhd (NHD, " in err and "Traceback" not in err
