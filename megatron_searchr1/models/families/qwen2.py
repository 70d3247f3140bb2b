"""Qwen2 / Qwen2.5 family: GQA attention with a bias on q/k/v (none on o_proj), SwiGLU MLP without bias, RMSNorm.

Tied embeddings are a config choice (Qwen2.5-0.5B/1.5B/3B tie, 7B does not); the mapping handles both.
"""
from __future__ import annotations

from typing import Any

from megatron_searchr1.models.families.base import ModelFamily


class Qwen2Family(ModelFamily):
    architectures = ("Qwen2ForCausalLM",)
    model_types = ("qwen2",)

    @classmethod
    def qkv_bias(cls, hf_config: Any) -> bool:
        return True  # Qwen2 always has q/k/v bias (no config switch)
