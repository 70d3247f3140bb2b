"""Where each LoRA target lives in Megatron: the HF projection names of config/finetune.py (`LORA_TARGETS`, what a
user writes in `model.lora.targets`) mapped onto the fused Megatron linear that holds them and onto PEFT's module
path. Torch-free; models/lora.py builds the adapters from it and re-exports it."""
from __future__ import annotations

# HF projection -> (Megatron linear suffix within a layer, TP kind); keys in LORA_TARGETS' order
PROJECTIONS: dict[str, tuple[str, str]] = {
    "q_proj": ("self_attention.linear_qkv", "column"),
    "k_proj": ("self_attention.linear_qkv", "column"),
    "v_proj": ("self_attention.linear_qkv", "column"),
    "o_proj": ("self_attention.linear_proj", "row"),
    "gate_proj": ("mlp.linear_fc1", "column"),
    "up_proj": ("mlp.linear_fc1", "column"),
    "down_proj": ("mlp.linear_fc2", "row"),
}
# HF module path of each projection within `model.layers.{i}.` (PEFT's key names)
HF_MODULE = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
             "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
             "down_proj": "mlp.down_proj"}
