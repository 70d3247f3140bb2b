"""Mistral family: the Llama layout (GQA, SwiGLU, RMSNorm, explicit `head_dim`) under its own architecture name.

Mistral 7B v0.1 attends within a 4096-token sliding window; later releases set `sliding_window: null`. Megatron's
local attention here is full causal attention, so a config with a window is refused rather than computed differently.
"""
from __future__ import annotations

from typing import Any

from megatron_searchr1.models.families.base import config_get
from megatron_searchr1.models.families.llama import LlamaFamily


class MistralFamily(LlamaFamily):
    architectures = ("MistralForCausalLM",)
    model_types = ("mistral",)

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        super().check_config(hf_config)
        window = config_get(hf_config, "sliding_window", None)
        if window is not None:
            raise ValueError(f"Mistral sliding_window={window} is not supported (full attention only): use a "
                             "checkpoint whose config has sliding_window: null (Mistral 7B v0.2 and later).")
