"""Qwen3 family (dense): GQA attention with RMSNorm over the head dim on queries and keys (`q_norm`, `k_norm`, applied
before RoPE), an explicit `head_dim` (often != hidden / heads), no q/k/v bias by default, SwiGLU MLP, RMSNorm.

Megatron: `qk_layernorm=True` builds `self_attention.q_layernorm` / `k_layernorm` of width head_dim, the same on
every TP rank. `attention_bias=True` would put a bias on q/k/v and o_proj but not on the MLP, which Megatron's
`add_bias_linear` cannot express: refused (no released Qwen3 sets it).
"""
from __future__ import annotations

from typing import Any

from megatron_searchr1.models.families.base import ModelFamily, config_get


class Qwen3Family(ModelFamily):
    architectures = ("Qwen3ForCausalLM",)
    model_types = ("qwen3",)

    @classmethod
    def qkv_bias(cls, hf_config: Any) -> bool:
        return False  # attention_bias=True is refused in check_config

    @classmethod
    def qk_norm(cls, hf_config: Any) -> bool:
        return True

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        super().check_config(hf_config)
        if config_get(hf_config, "attention_bias", False):
            raise ValueError("Qwen3 attention_bias=True is not supported: Megatron cannot bias o_proj without "
                             "biasing the MLP (add_bias_linear); set attention_bias=false.")
