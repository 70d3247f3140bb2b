"""Per-family HF <-> Megatron weight mapping (used by the checkpoint converter and the rollout weight sync).

    family = get_family(hf_config)                       # the class, from `architectures` / `model_type`
    mapping = family.from_hf_config(hf_config, padded_vocab_size=640)
    full = mapping.hf_to_megatron("decoder.layers.0.self_attention.linear_qkv.weight", hf_tensors)
    shards = tp_split("decoder.layers.0.self_attention.linear_qkv.weight", full, tp=2)
    pairs = mapping.megatron_to_hf(name, tp_merge(name, shards))   # [(hf_name, tensor), ...]
"""
from __future__ import annotations

import dataclasses
from typing import Any

from megatron_searchr1.models.families.base import (  # noqa: F401  (re-exported API)
    EMBEDDING, FINAL_NORM, LAYER_TENSORS, MOE_LAYER_TENSORS, OUTPUT_LAYER, ModelFamily, deinterleave_qkv,
    expert_index, global_to_local_layer, grouped_to_sequential_name, sequential_to_grouped_name, global_to_local_name, interleave_qkv, is_expert_param, rename_expert,
    local_to_global_name, local_to_te_name, pad_vocab, pp_layer_range, rename_layer, split_layer_name, stack_gate_up,
    stage_layer_counts, te_to_local_name, tp_kind, tp_merge, tp_place, tp_split, trim_vocab, unstack_gate_up,
)
from megatron_searchr1.models.families.dims import ModelDims, MoeDims, RopeSettings, config_get  # noqa: F401
from megatron_searchr1.models.families.llama import LlamaFamily
from megatron_searchr1.models.families.mistral import MistralFamily
from megatron_searchr1.models.families.moe import MoeFamily, Qwen2MoeFamily, Qwen3MoeFamily  # noqa: F401
from megatron_searchr1.models.families.qwen2 import Qwen2Family
from megatron_searchr1.models.families.qwen3 import Qwen3Family

FAMILIES: tuple[type[ModelFamily], ...] = (Qwen2Family, Qwen3Family, LlamaFamily, MistralFamily, Qwen3MoeFamily,
                                           Qwen2MoeFamily)
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(a for f in FAMILIES for a in f.architectures)


def get_family(hf_config_or_arch: Any) -> type[ModelFamily]:
    """The family class for a `transformers` config, a config.json dict, or an architecture / model_type string.

    A config's `architectures` decide when it lists any (`Qwen2ForTokenClassification` is not a causal LM whose
    weights this mapping reads, even though its model_type is qwen2); `model_type` is used only when it lists none
    (a config built in code, e.g. `Qwen2Config(...)`). This is the one registry the builder, the converter and the
    weight sync consult.
    """
    if isinstance(hf_config_or_arch, str):
        wanted = [hf_config_or_arch]
    else:
        wanted = list(config_get(hf_config_or_arch, "architectures", None) or [])
        model_type = config_get(hf_config_or_arch, "model_type", None)
        if not wanted and model_type:
            wanted.append(model_type)
    for family in FAMILIES:
        if any(w in family.architectures or w in family.model_types for w in wanted):
            return family
    raise ValueError(f"unsupported model architecture {wanted or '(none given)'}; supported architectures: "
                     f"{', '.join(SUPPORTED_ARCHITECTURES)} (a critic is built from the same causal-LM config)")


def mapping_for(hf_config: Any, padded_vocab_size: int | None = None) -> ModelFamily:
    """`get_family(hf_config).from_hf_config(hf_config, padded_vocab_size)`; a ModelDims is bound as it is
    (with `padded_vocab_size` replaced when given)."""
    if isinstance(hf_config, ModelDims):
        dims = hf_config if padded_vocab_size is None else dataclasses.replace(hf_config,
                                                                               padded_vocab_size=padded_vocab_size)
        return get_family(dims.architecture)(dims)
    return get_family(hf_config).from_hf_config(hf_config, padded_vocab_size)


def read_dims(hf_config: Any, padded_vocab_size: int | None = None) -> ModelDims:
    """The model's ModelDims (validated); a ModelDims is returned as it is."""
    if isinstance(hf_config, ModelDims):
        return hf_config
    return get_family(hf_config).read_dims(hf_config, padded_vocab_size)
