"""What a user gets for a mistake at run time or with a tool: kvgen's own error, saying
what was expected and what was found, before anything is written (issue 20, item 17)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from harness import builtin_library

import kvgen.generated as generated
from kvgen.errors import KVGenError, KVLayoutError
from kvgen.integrations import lmcache as kl
from kvgen.oracle.scenarios import EXT, clone_tree, make_cache, same_bits
from kvgen.runtime import MemoryObj

LIBRARY = builtin_library()
NHD = LIBRARY["vllm_flash_attn_nhd"]


def test_kernel_asm_without_triton_names_the_extra() -> None:
    code = ("import sys, runpy; sys.modules['triton'] = None; sys.argv = ['kernel_asm']; "
            "runpy.run_module('kvgen.tools.kernel_asm', run_name='__main__')")
    # test_kernels.py switches Triton's interpreter on for this process at import (collection):
    # kernel_asm, which compiles for a GPU, would refuse that before it looks for triton.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "kernel_asm needs triton, which is not installed: pip install 'kvgen[triton]'"]


def test_create_gpu_connector_without_metadata_is_kvgen_s_error() -> None:
    with pytest.raises(KVLayoutError, match="metadata must be LMCache's LMCacheMetadata .*kv_shape.*got None"):
        kl.create_gpu_connector(None, None, "vllm")


def test_get_shape_before_a_bind_is_kvgen_s_error() -> None:
    conn = generated.get("vllm_flash_attn_nhd", "kv_2ltd")()
    with pytest.raises(KVLayoutError, match="no cache bound yet"):
        conn.get_shape(4)
    model = generated.get_model("llama31_8b", "kv_groups")()
    with pytest.raises(KVLayoutError, match="no cache bound yet"):
        model.get_shape(4)
    assert issubclass(KVLayoutError, KVGenError)


@pytest.mark.parametrize("count", [-3, -1])
def test_negative_token_counts_are_refused(count: int) -> None:
    cache = make_cache(NHD, torch.float32, "cpu")
    conn = generated.get("vllm_flash_attn_nhd", "kv_2ltd")()
    with pytest.raises(KVLayoutError, match=f"num_tokens must be >= 0, got {count}"):
        conn.get_shape(count, cache)
    conn.bind(cache)
    with pytest.raises(KVLayoutError, match=f"num_tokens must be >= 0, got {count}"):
        conn.get_shape(count)
    assert conn.get_shape(0) == torch.Size([2, EXT["L"], 0, EXT["H"] * EXT["C"]])
    dropin = kl.VLLMPagedMemGPUConnectorV2(EXT["H"] * EXT["C"], EXT["L"], device="cpu")
    with pytest.raises(KVLayoutError, match=f"num_tokens must be >= 0, got {count}"):
        dropin.get_shape(count)
    trtllm = kl.TRTLLMGPUConnector(num_kv_heads=EXT["H"], head_dim=EXT["C"], hidden_dim_size=EXT["H"] * EXT["C"],
                                   num_layers=EXT["L"], chunk_size=16, dtype=torch.float32, device="cpu")
    with pytest.raises(KVLayoutError, match=f"num_tokens must be >= 0, got {count}"):
        trtllm.get_shape(count)
    for cls in (kl.VLLMPagedMemLayerwiseGPUConnector, kl.SGLangGPUConnector):
        with pytest.raises(KVLayoutError, match="num_tokens must be an integer"):
            cls(EXT["H"] * EXT["C"], EXT["L"], device="cpu").get_shape(2.5)


def test_model_sections_refuse_negative_counts() -> None:
    conn = generated.get_model("llama31_8b", "kv_groups")()
    for call in (conn.sections, conn.get_shape):  # the count is checked first, cache or not
        with pytest.raises(KVLayoutError, match="num_tokens must be >= 0, got -5"):
            call(-5)


def test_an_extra_send_after_the_last_layer_is_refused() -> None:
    cache = make_cache(NHD, torch.float32, "cpu")
    conn = generated.get("vllm_flash_attn_nhd", "kv_t2d")()
    mapping = torch.arange(5) * 3
    objs = [MemoryObj(torch.zeros(conn.get_shape(5, cache))) for _ in range(EXT["L"])]
    for _ in conn.batched_from_gpu([[o] for o in objs], [0], [5], kvcaches=cache, slot_mapping=mapping, sync=True):
        pass
    target = [torch.zeros_like(t) for t in cache]
    load = conn.batched_to_gpu([0], [5], kvcaches=target, slot_mapping=mapping, sync=True)
    next(load)
    for layer in range(EXT["L"]):
        load.send([objs[layer]])
    loaded = clone_tree(target)
    with pytest.raises(KVLayoutError, match=f"send\\(\\) after the last layer: all {EXT['L']} layers"):
        load.send([objs[0]])
    assert same_bits(target, loaded)
    for leaf, src in zip(target, cache, strict=True):  # the layers sent were loaded exactly
        assert torch.equal(leaf.flatten(1, 2)[:, mapping], src.flatten(1, 2)[:, mapping])


def test_a_missing_transfer_suggests_a_line_only_when_it_would_build() -> None:
    """The registry's advice and the build's rule (kvgen.spec.transfers) agree on every pair
    of built-in layouts: a transfers.yaml line is suggested exactly when the build takes it."""
    from kvgen.spec.transfers import content_problem

    with pytest.raises(KVLayoutError, match="no transfer vllm_mla -> vllm_flash_attn_nhd") as refused:
        generated.transfer("MLA", "NHD")
    assert "transfers.yaml" not in str(refused.value)
    assert "vllm_mla holds one latent plane (no K/V) without heads" in str(refused.value)
    layouts = LIBRARY.paged
    for src in layouts:
        for dst in layouts:
            if (src.name, dst.name) in generated._REGISTRY.transfers:
                continue
            with pytest.raises(KVLayoutError) as why:
                generated.transfer(src.name, dst.name)
            builds = content_problem(src, dst) is None
            assert ("transfers.yaml" in str(why.value)) == builds, (src.name, dst.name, str(why.value))


def test_a_misspelt_required_keyword_gets_did_you_mean() -> None:
    cache = make_cache(NHD, torch.float32, "cpu")
    conn = generated.get("vllm_flash_attn_nhd", "kv_2ltd")()
    obj = MemoryObj(torch.zeros(conn.get_shape(4, cache)))
    before = obj.tensor.clone()
    with pytest.raises(TypeError, match="from_gpu\\(\\) got an unexpected keyword argument 'slot_maping' "
                                        "\\(did you mean 'slot_mapping'\\?\\); it accepts: kvcaches, slot_mapping"):
        conn.from_gpu(obj, 0, 4, kvcaches=cache, slot_maping=torch.arange(4))
    assert same_bits(obj.tensor, before)
    model = generated.get_model("llama31_8b", "kv_groups")()
    with pytest.raises(TypeError, match="got an unexpected keyword argument 'slot_mapping' \\(did you mean "
                                        "'slot_mappings'\\?\\)"):
        model.from_gpu(obj, 0, 4, kvcaches=cache, slot_mapping={})
    with pytest.raises(TypeError, match="got an unexpected keyword argument 'slot_maping' \\(did you mean "
                                        "'slot_mapping'\\?\\)"):
        next(generated.get("vllm_flash_attn_nhd", "kv_t2d")().batched_to_gpu([0], [4], kvcaches=cache,
                                                                              slot_maping=torch.arange(4)))
