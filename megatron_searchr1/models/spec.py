"""Which modules a GPTModel is built from: Transformer Engine's (GPU) or Megatron's local spec with our attention.

    spec = block_spec(config, use_te=resolve_use_te(None), qk_norm=dims.qk_norm)   # GPTModel's transformer_layer_spec

A whole-block spec (every layer of this pipeline stage and the final norm) rather than a layer spec: handed a layer
spec, Megatron picks the block's final norm from whatever is installed (TE, else Apex, else torch), so a machine with
Apex but no working TE would build an Apex LayerNorm for an RMSNorm model (it refuses), and `use_te=False` on a TE
machine would still get a TE final norm. Here every norm follows `use_te`: TENorm with TE, torch's RMSNorm without
(`TorchNorm`, which unlike Megatron's WrappedTorchNorm also serves sequence parallelism).
"""
from __future__ import annotations

import copy
import logging
from typing import Optional

import torch

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_searchr1.models.attention import SDPAttention, SDPSelfAttention

log = logging.getLogger(__name__)
_te_import_error: Optional[str] = None  # why transformer_engine did not import (logged once)


def te_available() -> bool:
    """True when CUDA is present and Transformer Engine imports; when CUDA is present but TE fails to import, the
    reason is logged (once) instead of silently falling back to the local spec."""
    global _te_import_error
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # ImportError, or a CUDA/ABI mismatch inside TE
        if _te_import_error is None:
            _te_import_error = f"{type(e).__name__}: {e}"
            log.warning("Transformer Engine does not import (%s): building Megatron's local spec instead, which is "
                        "slower on GPU. Fix the TE install or pass use_te=False to "
                        "silence this.", _te_import_error)
        return False
    return True


def resolve_use_te(use_te: Optional[bool]) -> bool:
    """model.use_te: None -> TE when available; False -> the local spec; True without CUDA/TE -> a RuntimeError that
    says what to do (transformer_engine is imported here, lazily, never at module import)."""
    if use_te is None:
        return te_available()
    if use_te and not torch.cuda.is_available():
        raise RuntimeError("model.use_te=true (use_te=True) needs CUDA and Transformer Engine, and this machine has no "
                           "CUDA: set model.use_te=false (Megatron's local spec) or leave it unset (auto) on the CPU.")
    if use_te and not te_available():
        raise RuntimeError(f"model.use_te=true (use_te=True) but transformer_engine does not import "
                           f"({_te_import_error}): install the gpu extra, pip install -e '.[gpu]' (it brings "
                           "transformer-engine[pytorch]), or set model.use_te=false.")
    return bool(use_te)


class TorchNorm:
    """Megatron's WrappedTorchNorm (torch.nn.RMSNorm / LayerNorm from a TransformerConfig), with sequence parallelism.

    WrappedTorchNorm refuses sequence parallelism, though a norm is per token: on a rank's sequence shard it computes
    what it computes on the whole sequence. Only its weight's gradient is then partial (this rank's tokens), so the
    parameters are marked `sequence_parallel`, which makes Megatron's finalize_model_grads sum them over the TP group,
    as it does for TE's norms. Lets the local spec (the CPU) run and test sequence parallelism.
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **kwargs):
        if not config.sequence_parallel:
            return WrappedTorchNorm(config, hidden_size, eps, **kwargs)
        if config.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"TorchNorm builds RMSNorm or LayerNorm, not {config.normalization}")
        if config.layernorm_zero_centered_gamma or config.persist_layer_norm or config.memory_efficient_layer_norm:
            raise ValueError("TorchNorm (torch's norms) supports no zero-centred gamma, persistent or "
                             "memory-efficient layer norm")
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm


def norm_module(use_te: bool) -> type:
    """The norm class for every norm of the model: TENorm with TE, torch's (TorchNorm) without."""
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    return TorchNorm


def layer_spec(use_te: bool, qk_norm: bool = False, num_experts: Optional[int] = None,
               grouped_gemm: bool = False) -> ModuleSpec:
    """One transformer layer: TE's spec, or Megatron's local spec with SDPAttention and torch norms throughout.

    `num_experts`: an MoE layer (Megatron's MoELayer: router, experts, shared expert when the config sizes one).
    `grouped_gemm` (TE only): the experts as TEGroupedMLP (one grouped GEMM per linear over a rank's experts; its
    weights `experts.linear_fc1.weight{j}` map to SequentialMLP's names, families/base.grouped_to_sequential_name),
    else SequentialMLP (a loop over the experts: the local spec, the CPU)."""
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, moe_grouped_gemm=grouped_gemm,
                                                          qk_layernorm=qk_norm)
    if grouped_gemm:
        # Megatron's local grouped experts (the legacy GroupedMLP) need the CUDA-only `grouped_gemm` package and are
        # deprecated in favour of TE's; this project runs grouped GEMM through TE only.
        raise ValueError("grouped-GEMM experts (moe_grouped_gemm=True) need the Transformer Engine spec: set "
                         "model.use_te=true on a GPU with TE, or build the config without moe_grouped_gemm")
    spec = copy.deepcopy(get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                                  normalization="RMSNorm", qk_layernorm=qk_norm))
    layer = spec.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = TorchNorm
    if qk_norm:
        layer.self_attention.submodules.q_layernorm = layer.self_attention.submodules.k_layernorm = TorchNorm
    layer.self_attention.module = SDPSelfAttention
    layer.self_attention.submodules.core_attention = SDPAttention
    return spec


def block_spec(config: TransformerConfig, use_te: bool, qk_norm: bool = False) -> TransformerBlockSubmodules:
    """This pipeline stage's block: its layers (as many as Megatron builds here, uneven splits included) and a
    final norm of the same kind as the layers' norms. An MoE config's `moe_layer_freq` list (one 0/1 per global
    layer, models/config.moe_config_fields) picks an MoE or a dense layer for each; its `moe_grouped_gemm` picks
    grouped experts (TE spec only)."""
    n = get_num_layers_to_build(config)
    dense = layer_spec(use_te, qk_norm)
    if not config.num_moe_experts:
        layers = [dense] * n
    else:
        moe = layer_spec(use_te, qk_norm, num_experts=config.num_moe_experts, grouped_gemm=config.moe_grouped_gemm)
        freq = config.moe_layer_freq
        if not isinstance(freq, list):
            raise ValueError(f"block_spec needs moe_layer_freq as a per-layer 0/1 list, got {freq!r}")
        offset = get_transformer_layer_offset(config)
        layers = [moe if freq[offset + i] else dense for i in range(n)]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=norm_module(use_te))


def uses_te_spec(model: torch.nn.Module) -> bool:
    """True when `model` was built with Transformer Engine layers (fused norm naming), False for the local spec."""
    return any(type(m).__module__.startswith("megatron.core.extensions.transformer_engine") for m in model.modules())
