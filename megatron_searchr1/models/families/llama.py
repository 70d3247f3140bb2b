"""Llama family (Llama 2/3, and checkpoints that reuse its layout): GQA attention, SwiGLU MLP, RMSNorm.

`attention_bias` puts a bias on q/k/v and o_proj, `mlp_bias` on gate/up/down. Megatron biases either every linear
or none besides q/k/v (`add_bias_linear`), so the two must agree: both off (every released Llama) or both on.
Llama 3.2 1B/3B tie the embeddings (no lm_head in the HF checkpoint).
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
    def linear_bias(cls, hf_config: Any) -> bool:
        return bool(config_get(hf_config, "attention_bias", False))

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        super().check_config(hf_config)
        attn, mlp = bool(config_get(hf_config, "attention_bias", False)), bool(config_get(hf_config, "mlp_bias", False))
        if attn != mlp:
            raise ValueError(f"attention_bias={attn} with mlp_bias={mlp} is not supported: Megatron puts a bias on "
                             "o_proj and the MLP linears together (add_bias_linear), so set both to the same value.")
