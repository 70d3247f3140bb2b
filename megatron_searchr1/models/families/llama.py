"""Llama family (Llama 2/3, and checkpoints that reuse its layout): GQA attention, SwiGLU MLP, RMSNorm.

`attention_bias` puts a bias on q/k/v AND o_proj, `mlp_bias` on gate/up/down; both default to off. Llama 3.2 1B/3B
tie the embeddings (no lm_head in the HF checkpoint).
"""
from __future__ import annotations

from typing import Any

from megatron_searchr1.models.families.base import ModelFamily, config_get


class LlamaFamily(ModelFamily):
    architectures = ("LlamaForCausalLM",)
    model_types = ("llama",)

    @classmethod
    def qkv_bias(cls, hf_config: Any) -> bool:
        return bool(config_get(hf_config, "attention_bias", False))

    @classmethod
    def proj_bias(cls, hf_config: Any) -> bool:
        return bool(config_get(hf_config, "attention_bias", False))
