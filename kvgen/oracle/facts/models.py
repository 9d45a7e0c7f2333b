"""Facts about the built-in model specs (specs/models), written from the models' published configs.

Like kvgen.oracle.facts.layouts, this table does not read specs: each model's config values are copied
here as numbers (with the file and field names they come from), and the cache a model spec must
describe is derived from them by the formulas below: the length of the engine's cache list, each
attention group's layers, layout, heads and head size, and each state tensor's shape and dtypes.
`model_disagreement` compares a loaded model spec with its facts, field by field.

Sources (projects as named on Hugging Face / GitHub):

- config.json of each model on Hugging Face (https://huggingface.co/<config>/blob/main/config.json).
- vLLM (vllm-project/vllm): v1/attention/backends/flash_attn.py (per layer (2, num_blocks,
  block_size, num_kv_heads, head_size)); model_executor/models/deepseek_v2.py (Indexer.k_cache =
  DeepseekV32IndexerCache(head_dim + head_dim // quant_block_size * 4, uint8), quant_block_size 128,
  built before the layer's MLA attention); v1/worker/utils.py bind_kv_cache (the cache list by layer
  index, a layer's several caches in registration order); v1/attention/backends/mla/flashmla_sparse.py
  (fp8_ds_mla rows: kv_lora_rank fp8 values, kv_lora_rank / 128 float32 scales, rope bf16 values);
  model_executor/layers/mamba/mamba_utils.py (gated_delta_net_state_shape: conv (kernel - 1,
  conv_dim / tp) in the default "SD" layout, recurrent (num_v_heads / tp, head_v_dim, head_k_dim);
  gated_delta_net_state_dtype: conv in the model dtype, recurrent in mamba_ssm_cache_dtype;
  mamba1_state_shape: conv (kernel - 1, intermediate / tp), SSM (intermediate / tp, d_state)).
- vLLM 0.33 for DeepSeek-V4: models/deepseek_v4/attention.py (DeepseekV4Attention.get_kv_cache_spec:
  the compressed cache, tokens_per_state = compress ratio, 584-byte fp8_ds_mla states;
  DeepseekV4IndexerCache: 132-byte keys), models/deepseek_v4/compressor.py (CompressorStateCache:
  state_dim 2 * coff * head_dim float32, block size 4 or 8, window coff * ratio),
  v1/attention/backends/mla/sparse_swa.py (DeepseekV4SWACache), v1/core/kv_cache_planning.py (the
  grouping and the per-block slab), v1/worker/utils.py (allocate_kv_cache, bind_kv_cache).
- vLLM-Gaudi (vllm-project/vllm-gaudi): per layer (key, value, key scales, value scales), values
  fp8, scales one bfloat16 per token and head.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: float8_e4m3fn values of DeepSeek's fp8 caches are scaled per this many values (one float32 each).
FP8_QUANT_BLOCK = 128
FLOAT32_BYTES = 4
BF16_BYTES = 2


@dataclass(frozen=True)
class GroupFact:
    """An attention group as the engine keeps it."""

    name: str
    layout: str
    layers: tuple[int, ...]
    #: Extents at TP 1 (H, C, N, or C.PART), as a model spec's `sizes` must say them.
    sizes: Mapping[str, int]
    dtypes: tuple[str, ...] = ()
    window: int | None = None
    tokens_per_slot: int = 1


@dataclass(frozen=True)
class TensorFact:
    name: str
    shape: tuple[int, ...]
    dtypes: tuple[str, ...]
    split: int | None
    #: Sizes at TP 1 of the sections the split dim concatenates, each split on its own.
    sections: tuple[int, ...] | None = None


@dataclass(frozen=True)
class StateFact:
    name: str
    layers: tuple[int, ...]
    tensors: tuple[TensorFact, ...]


@dataclass(frozen=True)
class ModelFact:
    name: str
    #: The Hugging Face repository whose config.json gives the numbers.
    config: str
    #: The config fields used, copied as numbers.
    values: Mapping[str, Any]
    entries: int
    groups: tuple[GroupFact, ...]
    states: tuple[StateFact, ...] = field(default=())
    #: The groups share one allocation (vLLM's per-block slab): entries of different groups may alias.
    overlaid: bool = False

    @property
    def source(self) -> str:
        return f"https://huggingface.co/{self.config}/blob/main/config.json"


MODEL_FACTS: dict[str, ModelFact] = {}


def _register(fact: ModelFact) -> None:
    MODEL_FACTS[fact.name] = fact


def _every(start: int, step: int, stop: int) -> tuple[int, ...]:
    return tuple(range(start, stop, step))


def _dense(name: str, config: str, values: Mapping[str, Any], layout: str = "vllm_flash_attn_nhd",
           parts: tuple[str, ...] = ()) -> ModelFact:
    """Every layer full attention: one group of all num_hidden_layers entries."""
    n = values["num_hidden_layers"]
    head = values.get("head_dim") or values["hidden_size"] // values["num_attention_heads"]
    sizes = {"H": values["num_key_value_heads"]}
    sizes.update({f"C.{p}": head for p in parts} if parts else {"C": head})
    return ModelFact(name, config, values, n, (GroupFact("full", layout, tuple(range(n)), sizes),))


LLAMA31_8B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
_register(_dense("llama31_8b", "meta-llama/Llama-3.1-8B", LLAMA31_8B))
# vLLM-Gaudi fp8: the K and V parts have the head size; the scale parts one value per token and head.
_register(_dense("llama31_8b_gaudi_fp8", "meta-llama/Llama-3.1-8B", LLAMA31_8B, "vllm_gaudi_fp8", ("k", "v")))
_register(_dense("qwen3_32b", "Qwen/Qwen3-32B",
                 {"num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128}))


def _alternating(name: str, config: str, values: Mapping[str, Any], global_every: int,
                 names: tuple[str, str]) -> ModelFact:
    """Sliding-window layers, with a full-attention layer wherever (i + 1) % global_every == 0."""
    n = values["num_hidden_layers"]
    full = tuple(i for i in range(n) if (i + 1) % global_every == 0)
    local = tuple(i for i in range(n) if i not in full)
    sizes = {"H": values["num_key_value_heads"], "C": values["head_dim"]}
    return ModelFact(name, config, values, n, (
        GroupFact(names[0], "vllm_flash_attn_nhd", local, sizes, window=values["sliding_window"]),
        GroupFact(names[1], "vllm_flash_attn_nhd", full, sizes)))


# layer_types: "sliding_attention" at even layers, "full_attention" at odd ones.
_register(_alternating("gpt_oss_120b", "openai/gpt-oss-120b",
                       {"num_hidden_layers": 36, "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128},
                       2, ("sliding", "full")))
# text_config; sliding_window_pattern 6: five local layers, then one global.
_register(_alternating("gemma3_27b", "google/gemma-3-27b-it",
                       {"num_hidden_layers": 62, "num_key_value_heads": 16, "head_dim": 128, "sliding_window": 1024,
                        "sliding_window_pattern": 6},
                       6, ("local", "global")))


DEEPSEEK_V32 = {"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_head_dim": 128}


def _deepseek_v32(name: str, fp8: bool) -> ModelFact:
    """Per decoder layer two cache-list entries: its indexer keys, then its MLA latent cache."""
    v = DEEPSEEK_V32
    n = v["num_hidden_layers"]
    indexer_bytes = v["index_head_dim"] + v["index_head_dim"] // FP8_QUANT_BLOCK * FLOAT32_BYTES
    if fp8:  # fp8_ds_mla: fp8 latent, its float32 scales, bf16 rope values, all in bytes
        mla = GroupFact("mla", "vllm_mla_fp8", _every(1, 2, 2 * n),
                        {"C": v["kv_lora_rank"] + v["kv_lora_rank"] // FP8_QUANT_BLOCK * FLOAT32_BYTES
                         + v["qk_rope_head_dim"] * BF16_BYTES})
    else:
        mla = GroupFact("mla", "vllm_mla", _every(1, 2, 2 * n), {"C": v["kv_lora_rank"] + v["qk_rope_head_dim"]},
                        ("bfloat16",))
    return ModelFact(name, "deepseek-ai/DeepSeek-V3.2", v, 2 * n, (
        GroupFact("indexer", "vllm_dsa_indexer", _every(0, 2, 2 * n), {"C": indexer_bytes}), mla))


_register(_deepseek_v32("deepseek_v32", fp8=False))
_register(_deepseek_v32("deepseek_v32_fp8", fp8=True))


def _qwen3_next() -> ModelFact:
    v = {"num_hidden_layers": 48, "full_attention_interval": 4, "num_key_value_heads": 2, "head_dim": 256,
         "linear_num_key_heads": 16, "linear_key_head_dim": 128, "linear_num_value_heads": 32,
         "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}
    n = v["num_hidden_layers"]
    full = tuple(i for i in range(n) if (i + 1) % v["full_attention_interval"] == 0)
    linear = tuple(i for i in range(n) if i not in full)
    # q and k projections of every key head, v of every value head, all through the short conv.
    conv_dim = 2 * v["linear_num_key_heads"] * v["linear_key_head_dim"] + \
        v["linear_num_value_heads"] * v["linear_value_head_dim"]
    key_dim = v["linear_num_key_heads"] * v["linear_key_head_dim"]
    sections = (key_dim, key_dim, v["linear_num_value_heads"] * v["linear_value_head_dim"])  # q | k | v
    conv = TensorFact("conv", (v["linear_conv_kernel_dim"] - 1, conv_dim), ("bfloat16",), 1, sections)
    recurrent = TensorFact("recurrent", (v["linear_num_value_heads"], v["linear_value_head_dim"],
                                         v["linear_key_head_dim"]), ("bfloat16", "float32"), 0)
    return ModelFact("qwen3_next_80b_a3b", "Qwen/Qwen3-Next-80B-A3B-Instruct", v, n,
                     (GroupFact("full", "vllm_flash_attn_nhd", full, {"H": v["num_key_value_heads"],
                                                                      "C": v["head_dim"]}),),
                     (StateFact("linear", linear, (conv, recurrent)),))


_register(_qwen3_next())


def _jamba_v01() -> ModelFact:
    v = {"num_hidden_layers": 32, "attn_layer_period": 8, "attn_layer_offset": 4, "num_key_value_heads": 8,
         "hidden_size": 4096, "num_attention_heads": 32, "mamba_expand": 2, "mamba_d_state": 16, "mamba_d_conv": 4}
    n = v["num_hidden_layers"]
    attn = tuple(i for i in range(n) if i % v["attn_layer_period"] == v["attn_layer_offset"])
    mamba = tuple(i for i in range(n) if i not in attn)
    inner = v["mamba_expand"] * v["hidden_size"]  # Mamba-1: the conv runs over the expanded width
    return ModelFact("jamba_v01", "ai21labs/Jamba-v0.1", v, n,
                     (GroupFact("attn", "vllm_flash_attn_nhd", attn,
                                {"H": v["num_key_value_heads"], "C": v["hidden_size"] // v["num_attention_heads"]}),),
                     (StateFact("mamba", mamba, (TensorFact("conv", (v["mamba_d_conv"] - 1, inner), ("bfloat16",), 1),
                                                 TensorFact("ssm", (inner, v["mamba_d_state"]),
                                                            ("bfloat16", "float32"), 0))),))


_register(_jamba_v01())


# DeepSeek-V4-Flash: transformers 5.24's DeepseekV4Config defaults, documented as the config of
# deepseek-ai/DeepSeek-V4-Flash-Base (its @auto_docstring checkpoint): 43 layers; layer_types two
# heavily_compressed_attention layers, then compressed_sparse / heavily_compressed alternating from
# layer 2 (HCA at 0, 1, 2 and every even layer, CSA at every odd layer from 3); compress_rates CSA 4,
# HCA 128; head_dim 512 (qk_rope_head_dim 64 of it), index_head_dim 128, sliding_window 128.
DEEPSEEK_V4_FLASH = {"num_hidden_layers": 43, "head_dim": 512, "qk_rope_head_dim": 64, "index_head_dim": 128,
                     "sliding_window": 128, "compress_rates": {"csa": 4, "hca": 128},
                     "layer_types": ("hca", "hca") + ("hca", "csa") * 20 + ("hca",)}
#: fp8_ds_mla (vllm/models/deepseek_v4/attention.py): NoPE fp8 values, one UE8M0 scale per 64 of
#: them padded to 8 bytes, RoPE bf16 values.
DSV4_SCALE_GROUP, DSV4_SCALE_BYTES = 64, 8


def _dsv4_entries(layer_types: Sequence[str]) -> dict[str, list[int]]:
    """The cache-list entries of each kind of cache, in vLLM's order: by decoder layer, and a layer's
    caches in allocation order (bind_kv_cache keeps kv_caches' order, which follows the KV cache
    tensors: SWA, then the compressed caches (HCA, indexer keys, CSA), then the compressor states
    (HCA, indexer, CSA)). A CSA layer has five caches, an HCA layer three."""
    order = {"hca": ("swa", "hca", "hca_state"),
             "csa": ("swa", "indexer", "csa", "indexer_state", "csa_state")}
    out: dict[str, list[int]] = {}
    at = 0
    for i, kind in enumerate(layer_types):
        for cache in order[kind]:
            key = f"swa_{'even' if i % 2 == 0 else 'odd'}" if cache == "swa" else cache
            out.setdefault(key, []).append(at)
            at += 1
    return out


def _deepseek_v4_flash() -> ModelFact:
    v = DEEPSEEK_V4_FLASH
    at = _dsv4_entries(v["layer_types"])
    nope = v["head_dim"] - v["qk_rope_head_dim"]
    row = nope + v["qk_rope_head_dim"] * BF16_BYTES + DSV4_SCALE_BYTES  # 584: FlashMLA's packed record
    assert nope // DSV4_SCALE_GROUP < DSV4_SCALE_BYTES
    indexer = v["index_head_dim"] + v["index_head_dim"] // FP8_QUANT_BLOCK * FLOAT32_BYTES
    csa, hca = v["compress_rates"]["csa"], v["compress_rates"]["hca"]

    def state(name: str, ratio: int, dim: int) -> GroupFact:
        """CompressorStateCache: kv and score states of coff * dim floats (coff 2 where ratio is 4,
        overlapping windows), block size 4 (ratio 4) or 8 (ratio 128), window coff * ratio."""
        coff = 1 + (ratio == 4)
        return GroupFact(name, "vllm_mla_latent", tuple(at[name]), {"N": 4 if ratio == 4 else 8, "C": 2 * coff * dim},
                         ("float32",), window=coff * ratio)

    mla = {"C": row}
    return ModelFact("deepseek_v4_flash", "deepseek-ai/DeepSeek-V4-Flash-Base", v, sum(map(len, at.values())), (
        GroupFact("swa_even", "vllm_dsv4_mla_fp8", tuple(at["swa_even"]), mla, window=v["sliding_window"]),
        GroupFact("swa_odd", "vllm_dsv4_mla_fp8", tuple(at["swa_odd"]), mla, window=v["sliding_window"]),
        GroupFact("hca", "vllm_dsv4_mla_fp8", tuple(at["hca"]), mla, tokens_per_slot=hca),
        GroupFact("indexer", "vllm_dsv4_indexer", tuple(at["indexer"]), {"C": indexer}, tokens_per_slot=csa),
        GroupFact("csa", "vllm_dsv4_mla_fp8", tuple(at["csa"]), mla, tokens_per_slot=csa),
        state("hca_state", hca, v["head_dim"]),
        state("indexer_state", csa, v["index_head_dim"]),
        state("csa_state", csa, v["head_dim"])), overlaid=True)


_register(_deepseek_v4_flash())


def _group_disagreement(g: Any, f: GroupFact) -> str | None:
    """Where one attention group of a spec differs from its facts, or None."""
    if g.layout != f.layout:
        return f"group {g.name}: layout {g.layout}, the engine keeps {f.layout}"
    if tuple(g.layers) != f.layers:
        return f"group {g.name}: layers {_short(g.layers)}, the facts say {_short(f.layers)}"
    if dict(g.sizes) != dict(f.sizes):
        return f"group {g.name}: sizes {dict(g.sizes)}, the facts say {dict(f.sizes)}"
    if tuple(g.dtypes) != f.dtypes:
        return f"group {g.name}: dtypes {list(g.dtypes)}, the facts say {list(f.dtypes)}"
    if g.window != f.window:
        return f"group {g.name}: window {g.window}, the facts say {f.window}"
    if g.tokens_per_slot != f.tokens_per_slot:
        return f"group {g.name}: tokens_per_slot {g.tokens_per_slot}, the facts say {f.tokens_per_slot}"
    return None


def _state_disagreement(s: Any, f: StateFact) -> str | None:
    """Where one state group of a spec differs from its facts, or None."""
    if tuple(s.layers) != f.layers:
        return f"state {s.name}: layers {_short(s.layers)}, the facts say {_short(f.layers)}"
    got = [(t.name, tuple(t.shape), tuple(t.dtypes), t.split, t.sections) for t in s.tensors]
    want = [(t.name, t.shape, t.dtypes, t.split, t.sections) for t in f.tensors]
    return f"state {s.name}: tensors {got}, the facts say {want}" if got != want else None


def _listed(what: str, got: Sequence[Any], want: Sequence[Any]) -> str | None:
    names, expected = [x.name for x in got], [x.name for x in want]
    return f"{what} are {names}, the facts say {expected}" if names != expected else None


def _comparisons(model: Any, fact: ModelFact) -> Iterator[str | None]:
    """Each comparison in turn (None where it agrees); a later one runs only once every earlier one agreed."""
    yield f"config is {model.config!r}, the facts come from {fact.config!r}" if model.config != fact.config else None
    yield (f"layers is {model.layers}, the engine's cache list has {fact.entries} entries"
           if model.layers != fact.entries else None)
    yield (f"overlaid is {model.overlaid}, the facts say {fact.overlaid}"
           if model.overlaid != fact.overlaid else None)
    yield _listed("groups", model.groups, fact.groups)
    for g, f in zip(model.groups, fact.groups, strict=True):
        yield _group_disagreement(g, f)
    yield _listed("state groups", model.states, fact.states)
    for s, f in zip(model.states, fact.states, strict=True):
        yield _state_disagreement(s, f)


def model_disagreement(model: Any) -> str | None:
    """Where a loaded model spec (kvgen.spec.models.ModelSpec) differs from its facts, or None.

    Reads only the spec's declared fields; everything it is compared with comes from this module."""
    fact = MODEL_FACTS.get(model.name)
    if fact is None:
        return f"model {model.name} has no facts in kvgen.oracle.facts.models"
    return next((why for why in _comparisons(model, fact) if why), None)


def _short(layers: tuple[int, ...]) -> str:
    shown = ", ".join(map(str, layers[:6]))
    return f"[{shown}{', ...' if len(layers) > 6 else ''}] ({len(layers)})"


__all__ = ["MODEL_FACTS", "GroupFact", "ModelFact", "StateFact", "TensorFact", "model_disagreement"]
