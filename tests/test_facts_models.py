"""The built-in model specs against kvgen.oracle.facts.models, and edits of them that must be caught.

The facts derive every group's layers, layout and sizes and every state tensor's shape from the
models' published configs without reading specs; each mutation below changes one thing a wrong
spec could get wrong, and must be refused by the loader (schema, passes) or disagree with the facts.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path
from typing import Any

import pytest

from kvgen.oracle.facts.models import MODEL_FACTS, model_disagreement
from kvgen.spec.library import BUILTIN_SPECS, load_each, load_library, spec_files
from kvgen.spec.models import ModelSpec
from kvgen.spec.passes.models import check_model_library

MODELS = BUILTIN_SPECS / "models"


@functools.cache
def _library() -> Any:
    return load_library()


@functools.cache
def _layouts() -> tuple[Any, ...]:
    """Every built-in layout and object (no models), loaded once."""
    entries, problems = load_each(spec_files([BUILTIN_SPECS]))
    assert not problems
    return tuple(e for e in entries if not isinstance(e[0], ModelSpec))


def test_every_model_spec_has_facts_and_every_fact_a_spec() -> None:
    names = {m.name for m in _library().models}
    assert names == set(MODEL_FACTS), (names ^ set(MODEL_FACTS))
    assert len(names) >= 8


@pytest.mark.parametrize("name", sorted(MODEL_FACTS))
def test_model_spec_agrees_with_its_facts(name: str) -> None:
    assert model_disagreement(_library().model(name)) is None


def test_facts_formulas_give_the_published_geometry() -> None:
    # Spot values worked by hand from the configs, so a wrong formula fails here too.
    ds = MODEL_FACTS["deepseek_v32_fp8"]
    assert ds.entries == 122 and dict(ds.groups[0].sizes) == {"C": 132} and dict(ds.groups[1].sizes) == {"C": 656}
    assert dict(MODEL_FACTS["deepseek_v32"].groups[1].sizes) == {"C": 576}
    gemma = MODEL_FACTS["gemma3_27b"]
    assert gemma.groups[1].layers == (5, 11, 17, 23, 29, 35, 41, 47, 53, 59) and len(gemma.groups[0].layers) == 52
    qn = MODEL_FACTS["qwen3_next_80b_a3b"]
    assert qn.groups[0].layers == tuple(range(3, 48, 4))
    assert [t.shape for t in qn.states[0].tensors] == [(3, 8192), (32, 128, 128)]
    assert MODEL_FACTS["llama31_8b"].groups[0].sizes == {"H": 8, "C": 128}
    jamba = MODEL_FACTS["jamba_v01"]
    assert jamba.groups[0].layers == (4, 12, 20, 28) and len(jamba.states[0].layers) == 28
    assert [t.shape for t in jamba.states[0].tensors] == [(3, 8192), (8192, 16)]


def _verdict(tmp_path: Path, text: str) -> str:
    """'refused: ...' when the loader refuses `text`, 'facts: ...' when it loads but disagrees
    with the facts, or 'accepted'."""
    path = tmp_path / "mutant.yaml"
    path.write_text(text)
    entries, problems = load_each([path])
    if not problems:
        problems = check_model_library([*_layouts(), *entries])
    if problems:
        return "refused: " + "; ".join(map(str, problems))
    why = model_disagreement(entries[0][0])
    return f"facts: {why}" if why else "accepted"


def _edit(name: str, old: str, new: str, count: int = 1) -> str:
    text = (MODELS / f"{name}.yaml").read_text("utf-8")
    assert text.count(old) >= count, (name, old)
    return text.replace(old, new, count)


def _swap(name: str, a: str, b: str) -> str:
    text = (MODELS / f"{name}.yaml").read_text("utf-8")
    assert a in text and b in text
    return text.replace(a, "\0").replace(b, a).replace("\0", b)


MUTATIONS: dict[str, tuple[Any, str]] = {
    # (the edited text, "refused" or "facts": who must catch it)
    "gpt_oss_swap_group_layers": (lambda: _swap("gpt_oss_120b", "{from: 0, every: 2}", "{from: 1, every: 2}"),
                                  "facts"),
    "deepseek_swap_indexer_and_mla_entries": (lambda: _swap("deepseek_v32", "{from: 0, every: 2}",
                                                            "{from: 1, every: 2}"), "facts"),
    "gemma_move_others_to_global": (lambda: _swap("gemma3_27b", "layers: others", "layers: {from: 5, every: 6}"),
                                    "facts"),
    "gemma_global_every_fifth": (lambda: _edit("gemma3_27b", "{from: 5, every: 6}", "{from: 4, every: 5}"), "facts"),
    "llama_kv_heads": (lambda: _edit("llama31_8b", "H: 8", "H: 32"), "facts"),
    "llama_head_size": (lambda: _edit("llama31_8b", "C: 128", "C: 64"), "facts"),
    "llama_layer_count": (lambda: _edit("llama31_8b", "layers: 32", "layers: 33"), "facts"),
    "gemma_layer_count_short": (lambda: _edit("gemma3_27b", "layers: 62", "layers: 60"), "facts"),
    "gpt_oss_layer_count_short": (lambda: _edit("gpt_oss_120b", "layers: 36", "layers: 35"), "facts"),
    "gpt_oss_group_past_the_end": (lambda: _edit("gpt_oss_120b", "{from: 1, every: 2}",
                                                 "{from: 1, every: 2, count: 19}"), "refused"),
    "qwen3_next_full_every_third": (lambda: _edit("qwen3_next_80b_a3b", "{from: 3, every: 4}",
                                                  "{from: 2, every: 4}"), "facts"),
    # The conv state's q|k|v sections sum to its split dim: a transposed or re-split conv state
    # no longer fits them, which the spec passes refuse before the facts look.
    "qwen3_next_conv_orientation": (lambda: _edit("qwen3_next_80b_a3b", "shape: [3, 8192]", "shape: [8192, 3]"),
                                    "refused"),
    "qwen3_next_conv_split": (lambda: _edit("qwen3_next_80b_a3b", "split: 1, sections", "split: 0, sections"),
                              "refused"),
    "qwen3_next_conv_split_out_of_range": (lambda: _edit("qwen3_next_80b_a3b", "split: 1, sections",
                                                         "split: 2, sections"), "refused"),
    "qwen3_next_conv_flat": (lambda: _edit("qwen3_next_80b_a3b", ", sections: [2048, 2048, 4096]}", "}"), "facts"),
    "qwen3_next_conv_sections_swapped": (lambda: _edit("qwen3_next_80b_a3b", "sections: [2048, 2048, 4096]",
                                                       "sections: [4096, 2048, 2048]"), "facts"),
    "qwen3_next_recurrent_k_v_swapped_heads": (lambda: _edit("qwen3_next_80b_a3b", "[32, 128, 128]",
                                                             "[16, 128, 128]"), "facts"),
    "qwen3_next_recurrent_dtype": (lambda: _edit("qwen3_next_80b_a3b", "dtypes: [bfloat16, float32]",
                                                 "dtypes: [float32]"), "facts"),
    "qwen3_next_tensor_order": (lambda: _swap("qwen3_next_80b_a3b", "name: conv", "name: recurrent"), "facts"),
    "qwen3_next_state_moved_off_others": (lambda: _edit("qwen3_next_80b_a3b", "    layers: others",
                                                        "    layers: {from: 0, every: 4}"), "refused"),
    "deepseek_fp8_mla_width": (lambda: _edit("deepseek_v32_fp8", "C: 656", "C: 576"), "refused"),
    "deepseek_indexer_width": (lambda: _edit("deepseek_v32", "C: 132", "C: 128"), "refused"),
    "deepseek_bf16_mla_width": (lambda: _edit("deepseek_v32", "C: 576", "C: 512"), "facts"),
    "gaudi_size_of_a_scale_part": (lambda: _edit("llama31_8b_gaudi_fp8", "C.v: 128", "C.v_scale: 128"), "refused"),
    "gaudi_plain_c": (lambda: _edit("llama31_8b_gaudi_fp8", "C.k: 128, C.v: 128", "C: 128"), "refused"),
    "gaudi_head_size": (lambda: _edit("llama31_8b_gaudi_fp8", "C.v: 128", "C.v: 64"), "facts"),
    "jamba_attention_offset": (lambda: _edit("jamba_v01", "{from: 4, every: 8}", "{from: 3, every: 8}"), "facts"),
    "jamba_ssm_transposed": (lambda: _edit("jamba_v01", "[8192, 16]", "[16, 8192]"), "facts"),
    "jamba_ssm_split": (lambda: _edit("jamba_v01", "split: 0}", "split: 1}"), "facts"),
    "gemma_window": (lambda: _edit("gemma3_27b", "window: 1024", "window: 4096"), "facts"),
}


@pytest.mark.parametrize("case", sorted(MUTATIONS))
def test_mutation_is_caught(case: str, tmp_path: Path) -> None:
    make, who = MUTATIONS[case]
    verdict = _verdict(tmp_path, make())
    assert verdict.startswith(who), verdict


def test_unmodified_spec_is_accepted(tmp_path: Path) -> None:
    # The harness itself: a copy of a built-in model loads and agrees.
    assert _verdict(tmp_path, (MODELS / "qwen3_next_80b_a3b.yaml").read_text("utf-8")) == "accepted"


def test_spec_without_facts_is_reported(tmp_path: Path) -> None:
    text = re.sub(r"^name: llama31_8b$", "name: llama31_8b_copy", (MODELS / "llama31_8b.yaml").read_text("utf-8"),
                  flags=re.MULTILINE)
    assert "has no facts" in _verdict(tmp_path, text)


def test_verify_counts_a_model_that_disagrees(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from kvgen.spec.library import Library
    from kvgen.tools.verify.run import _check_model_facts

    lib = _library()
    good = lib.model("llama31_8b")
    wrong = dataclasses.replace(good, groups=(dataclasses.replace(good.groups[0], sizes=(("H", 4), ("C", 128))),))
    user = dataclasses.replace(good, name="my_model", source=str(tmp_path / "my_model.yaml"))
    assert _check_model_facts(Library(lib.specs, (wrong, user))) == 1
    out = capsys.readouterr()
    assert "model llama31_8b disagrees" in out.err and "0 of 1 built-in model specs agree" in out.out
    assert _check_model_facts(lib) == 0
