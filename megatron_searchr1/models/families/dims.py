"""An HF config, read once: `ModelDims`, the one record of everything Megatron needs about a model.

    dims = get_family(hf_config).read_dims(hf_config)     # or mapping_for(hf_config).dims

The builder (TransformerConfig, GPTModel arguments), the weight mapping (converter, weight sync) and the parallel-size
checks all read this record; none of them goes back to the HF config. Reading it also validates it: a feature the
Megatron translation would compute differently (another activation, sliding windows, an unsupported RoPE scaling)
raises a ValueError saying what to change, so a model is refused before anything is built.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

# Megatron's llama3 RoPE scaling hard-codes these three values (RotaryEmbedding._apply_scaling).
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def config_get(cfg: Any, key: str, default: Any = None) -> Any:
    """Read a field from a `transformers` config object or a config.json dict."""
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


@dataclass(frozen=True)
class RopeSettings:
    """Rotary embedding settings as GPTModel's constructor takes them."""

    theta: float
    """rotary_base (HF rope_theta)."""
    llama3_factor: Optional[float] = None
    """Llama-3.x frequency scaling factor (GPTModel rope_scaling=True), None when not scaled."""
    linear_factor: Optional[float] = None
    """Linear position interpolation (HF rope_type 'linear' -> seq_len_interpolation_factor)."""


def _rope_parameters(hf_config: Any) -> dict:
    """HF rope settings as one dict: transformers>=5 `rope_parameters`, or the older rope_theta/rope_scaling."""
    params = config_get(hf_config, "rope_parameters", None)
    if isinstance(params, Mapping) and params:
        if "full_attention" in params:  # per-layer-type form; our families use full attention only
            params = params["full_attention"]
        return dict(params)
    out = dict(config_get(hf_config, "rope_scaling", None) or {})
    out.setdefault("rope_theta", config_get(hf_config, "rope_theta", 10000.0))
    return out


def rope_settings(hf_config: Any) -> RopeSettings:
    """Translate HF RoPE settings; raise for scaling kinds Megatron's RotaryEmbedding would compute differently."""
    p = _rope_parameters(hf_config)
    theta = float(p.get("rope_theta", 10000.0))
    kind = p.get("rope_type", p.get("type")) or "default"
    if kind == "default":
        return RopeSettings(theta=theta)
    if kind == "linear":
        return RopeSettings(theta=theta, linear_factor=float(p["factor"]))
    if kind == "llama3":
        mismatched = {k: p.get(k) for k, v in MEGATRON_LLAMA3_ROPE.items() if float(p.get(k, v)) != v}
        if mismatched:
            raise ValueError(f"llama3 rope scaling with {mismatched} is not supported: Megatron's RotaryEmbedding "
                             f"fixes {MEGATRON_LLAMA3_ROPE}.")
        return RopeSettings(theta=theta, llama3_factor=float(p["factor"]))
    raise ValueError(f"rope scaling {kind!r} is not supported (supported: none/'default', 'linear', 'llama3'). "
                     "Remove rope_scaling from the config or add the scaling to models/families/dims.py.")


@dataclass(frozen=True)
class ModelDims:
    """Everything Megatron and the weight mapping need to know about a dense decoder, read once from its HF config."""

    num_layers: int
    """Number of transformer layers."""
    hidden_size: int
    """Model width h."""
    num_heads: int
    """Query heads nq."""
    num_kv_heads: int
    """Key/value heads = Megatron query groups ng."""
    head_dim: int
    """Per-head width d (may differ from h / nq: Qwen3, Mistral and Llama configs may set it)."""
    ffn_hidden_size: int
    """MLP width f."""
    vocab_size: int
    """True vocabulary size (HF)."""
    padded_vocab_size: int
    """Megatron embedding rows (>= vocab_size; padding rows are zeros)."""
    tie_embeddings: bool
    """Output layer shares the input embedding."""
    qkv_bias: bool
    """q/k/v projections have a bias."""
    linear_bias: bool = False
    """o_proj, gate, up and down have a bias too (Megatron's add_bias_linear: all of them or none)."""
    qk_norm: bool = False
    """RMSNorm over the head dim on queries and keys before RoPE (Qwen3); its weights are TP-replicated."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon (every norm of the model)."""
    rope: RopeSettings = RopeSettings(theta=10000.0)
    """Rotary embedding base and scaling."""
    max_position_embeddings: int = 4096
    """Longest sequence the RoPE config claims (GPTModel's max_sequence_length)."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    init_std: float = 0.02
    """Std of Megatron's random init (HF initializer_range)."""
    architecture: str = ""
    """The HF causal-LM architecture name written to an exported config."""
    moe: Optional["MoeDims"] = None
    """The mixture-of-experts settings (families/moe.py); None for a dense model."""

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index` (global) has experts (a mixed model keeps some layers dense)."""
        return self.moe is not None and index in self.moe.layers


@dataclass(frozen=True)
class MoeDims:
    """A mixture-of-experts model's expert settings, read once from its HF config (Qwen2-MoE, Qwen3-MoE)."""

    num_experts: int
    """Routed experts per MoE layer E (HF num_experts / num_local_experts)."""
    topk: int
    """Experts each token is routed to (HF num_experts_per_tok)."""
    ffn_hidden_size: int
    """One routed expert's MLP width (HF moe_intermediate_size)."""
    norm_topk_prob: bool
    """Renormalise the top-k probabilities to sum to 1 (softmax over the k chosen logits, Megatron's
    moe_router_pre_softmax=False) rather than keep the softmax over all experts (pre_softmax=True)."""
    aux_loss_coeff: float
    """Load-balancing loss weight (HF router_aux_loss_coef)."""
    layers: tuple[int, ...]
    """Global indices of the layers with experts; the others are dense with the model's ffn_hidden_size."""
    shared_expert_size: int = 0
    """The shared expert's MLP width (Qwen2-MoE shared_expert_intermediate_size); 0: no shared expert."""
    shared_expert_gate: bool = False
    """The shared expert's output is scaled by sigmoid(x @ gate), a (1, h) weight (Qwen2-MoE)."""


def check_common(hf_config: Any) -> None:
    """Refuse HF features no family here translates (activation, sliding windows, non-full attention layers)."""
    act = config_get(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported: the Megatron model uses SwiGLU (silu).")
    if config_get(hf_config, "use_sliding_window", False):
        raise ValueError("Sliding-window attention is not supported: set use_sliding_window=False in the config.")
    layer_types = config_get(hf_config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"Only full-attention layers are supported, config has layer_types={sorted(set(layer_types))}.")
