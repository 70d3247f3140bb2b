"""Megatron `GPTModel` built from a Hugging Face `transformers` config (Qwen2 and Llama families).

    config = transformer_config_from_hf(hf_config, tp=2, pp=1)     # validate + translate
    model = build_gpt_model(hf_config)                             # TP/PP read from parallel_state

Layer spec: Transformer Engine's on GPU (when TE imports), Megatron's local spec on the CPU with
`SDPAttention` (attention.py) in place of `DotProductAttention` and `SDPSelfAttention` (RoPE with cos/sin
computed once, no concats) in place of `SelfAttention`. After construction `use_fast_modules` swaps in
`SwiGLUMLP` (no gradient concat), `Fast{Column,Row}ParallelLinear` (`F.linear` when a call needs no
communication) and, on the last stage, `BatchFirstOutputLayer` (logits computed [b, s, V], saving copies).
Each computes what the Megatron module it replaces computes (tested against it). On the CPU these bring
the local spec's fwd+bwd from 1.35-1.39x HF Qwen2 (sdpa) to ~1.0x (tools/benchmarks/bench_megatron_vs_hf.py).

Parameter names the model produces (per pipeline stage; `i` is the layer index *within this stage*,
the global index is `i + get_transformer_layer_offset(config)`; TP shards are per rank):

    embedding.word_embeddings.weight                     [V_pad / tp, H]            first stage only
    decoder.layers.i.input_layernorm.weight              [H]                        local spec only
    decoder.layers.i.self_attention.linear_qkv.weight    [(nq + 2 ng) / tp * d, H]  rows per query group:
                                                         [q_0 .. q_{r-1}, k, v] (r = nq / ng), rows split over TP
                                                         (ng < tp: a rank holds a slice of one group; Megatron
                                                         all-gathers its group, so kv heads are replicated)
    decoder.layers.i.self_attention.linear_qkv.bias      [(nq + 2 ng) / tp * d]     Qwen2 (qkv bias) only
    decoder.layers.i.self_attention.linear_proj.weight   [H, nq * d / tp]
    decoder.layers.i.pre_mlp_layernorm.weight            [H]                        local spec only
    decoder.layers.i.mlp.linear_fc1.weight               [2 F / tp, H]              per rank: [gate shard; up shard]
    decoder.layers.i.mlp.linear_fc2.weight               [H, F / tp]
    decoder.final_layernorm.weight                       [H]                        last stage only
    output_layer.weight                                  [V_pad / tp, H]            last stage, untied only

With the TE spec the two norms are fused into the following linear layer and named
`self_attention.linear_qkv.layer_norm_weight` and `mlp.linear_fc1.layer_norm_weight` (TE modules also
carry `_extra_state` entries in `state_dict()`). `uses_te_spec(model)` says which naming applies.
Tied embeddings (Llama 3.2 style): no `output_layer.weight`; with PP > 1 Megatron keeps a copy of the
embedding on the last stage as `output_layer.weight` and all-reduces its gradient with the first stage.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Optional

import torch
import torch.nn.functional as F

from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_searchr1.models.attention import SDPAttention, SDPSelfAttention
from megatron_searchr1.models.families import (  # noqa: F401  (SUPPORTED_ARCHITECTURES: re-exported)
    SUPPORTED_ARCHITECTURES, LlamaFamily, ModelFamily, get_family, mapping_for,
)

# Megatron's llama3 RoPE scaling hard-codes these three values (RotaryEmbedding._apply_scaling).
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def hf_architecture(hf_config) -> str:
    """The supported HF architecture name of `hf_config`, or a ValueError naming the supported ones.

    The registry is models/families (`get_family`): one source of truth for what the builder and the mapping accept.
    """
    return get_family(hf_config).architectures[0]


def model_family(hf_config) -> str:
    """'qwen2' or 'llama': the name of the family mapping module for this config."""
    return get_family(hf_config).model_types[0]


def check_parallel_sizes(hf_config, tp: int, pp: int) -> None:
    """Refuse TP/PP that do not fit the model (ValueError listing every problem and what to change).

    Megatron's rules: TP divides the query heads and the MLP width; the KV heads (query groups) are a multiple of
    TP (each rank holds whole groups) or divide TP (each group is replicated over TP/groups ranks, as Megatron's
    attention does); PP divides the layers (uniform split).
    """
    heads, layers = hf_config.num_attention_heads, hf_config.num_hidden_layers
    groups = getattr(hf_config, "num_key_value_heads", None) or heads
    ffn = hf_config.intermediate_size
    problems = []
    if tp < 1 or pp < 1:
        problems.append(f"TP and PP must be >= 1 (got TP={tp}, PP={pp})")
    else:
        if heads % tp:
            problems.append(f"TP={tp} does not divide num_attention_heads={heads}: choose a TP that divides it")
        if groups % tp and tp % groups:
            problems.append(f"num_key_value_heads (query groups)={groups} must be a multiple of TP={tp} (each rank "
                            f"holds whole groups) or divide it (groups replicated over ranks): choose such a TP")
        if ffn % tp:
            problems.append(f"TP={tp} does not divide intermediate_size={ffn}: choose a TP that divides it")
        if layers % pp:
            problems.append(f"PP={pp} does not divide num_hidden_layers={layers}: choose a PP that divides it")
    if problems:
        raise ValueError("; ".join(problems))


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's rule: round the vocabulary up to a multiple of `divisible_by * tp`.

    >>> padded_vocab_size(151643, 1), padded_vocab_size(256, 2), padded_vocab_size(257, 1, 64)
    (151680, 256, 320)
    """
    if vocab_size <= 0 or tp <= 0 or divisible_by <= 0:
        raise ValueError(f"padded_vocab_size needs positive numbers, got vocab_size={vocab_size}, tp={tp}, "
                         f"divisible_by={divisible_by}")
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class RopeSettings:
    """Rotary embedding settings translated to GPTModel's constructor arguments."""

    theta: float
    """rotary_base (HF rope_theta)."""
    llama3_factor: Optional[float] = None
    """Llama-3.x frequency scaling factor (GPTModel rope_scaling=True), None when not scaled."""
    linear_factor: Optional[float] = None
    """Linear position interpolation (HF rope_type 'linear' -> seq_len_interpolation_factor)."""


def _rope_parameters(hf_config) -> dict:
    """HF rope settings as one dict: transformers>=5 `rope_parameters`, or the older rope_theta/rope_scaling."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        if "full_attention" in params:  # per-layer-type form; our families use full attention only
            params = params["full_attention"]
        return dict(params)
    out = dict(getattr(hf_config, "rope_scaling", None) or {})
    out.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return out


def rope_settings(hf_config) -> RopeSettings:
    """Translate HF RoPE settings; raise for scaling kinds Megatron's RotaryEmbedding would compute differently."""
    p = _rope_parameters(hf_config)
    theta = float(p.get("rope_theta", 10000.0))
    kind = p.get("rope_type", p.get("type")) or "default"
    if kind == "default":
        return RopeSettings(theta=theta)
    if kind == "linear":
        return RopeSettings(theta=theta, linear_factor=float(p["factor"]))
    if kind == "llama3":
        mismatched = {k: p.get(k) for k, v in _MEGATRON_LLAMA3_ROPE.items() if float(p.get(k, v)) != v}
        if mismatched:
            raise ValueError(
                f"llama3 rope scaling with {mismatched} is not supported: Megatron's RotaryEmbedding fixes "
                f"{_MEGATRON_LLAMA3_ROPE}."
            )
        return RopeSettings(theta=theta, llama3_factor=float(p["factor"]))
    raise ValueError(
        f"rope scaling {kind!r} is not supported (supported: none/'default', 'linear', 'llama3'). "
        "Remove rope_scaling from the config or add the scaling to megatron_searchr1/models/gpt.py."
    )


def _check_supported(hf_config, family: type[ModelFamily]) -> None:
    """Reject HF features this Megatron translation would silently compute differently."""
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported: the Megatron model uses SwiGLU (silu).")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("Sliding-window attention is not supported: set use_sliding_window=False in the config.")
    layer_types = getattr(hf_config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"Only full-attention layers are supported, config has layer_types={sorted(set(layer_types))}.")
    if family is LlamaFamily:
        if getattr(hf_config, "attention_bias", False):
            raise ValueError("Llama attention_bias=True is not supported (Megatron has q/k/v bias only, "
                             "not an o_proj bias).")
        if getattr(hf_config, "mlp_bias", False):
            raise ValueError("Llama mlp_bias=True is not supported.")
    rope_settings(hf_config)  # raises for unsupported scaling


def transformer_config_from_hf(
    hf_config, *, tp: int = 1, pp: int = 1, params_dtype: torch.dtype = torch.float32, **overrides: Any
) -> TransformerConfig:
    """A Megatron TransformerConfig equivalent to `hf_config` for TP=`tp`, PP=`pp`.

    `overrides` are TransformerConfig fields applied last (e.g. recompute_granularity="full",
    bias_activation_fusion=True, apply_rope_fusion=True on GPU).
    """
    family = get_family(hf_config)
    _check_supported(hf_config, family)
    check_parallel_sizes(hf_config, tp, pp)
    dims = mapping_for(hf_config).dims  # the same dimensions the weight mapping reads (head_dim included)
    if params_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"params_dtype must be float32, bfloat16 or float16, got {params_dtype}.")

    kwargs = dict(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        num_layers=dims.num_layers,
        hidden_size=dims.hidden_size,
        ffn_hidden_size=dims.ffn_hidden_size,
        num_attention_heads=dims.num_heads,
        num_query_groups=dims.num_kv_heads,
        kv_channels=dims.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.rms_norm_eps),
        gated_linear_unit=True,  # SwiGLU: linear_fc1 holds [gate; up]
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=dims.qkv_bias,
        hidden_dropout=0.0,  # HF decoders have no residual dropout
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
        init_method_std=float(getattr(hf_config, "initializer_range", 0.02)),
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # Fusions are CUDA kernels or TE ops; the trainer may turn them on through `overrides` on GPU.
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=not torch.cuda.is_available(),
        # RL micro-batches have different lengths: pipeline stages exchange shapes first.
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # unused by dense models; the default rejects variable lengths
    )
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"Unknown TransformerConfig override(s) {unknown}: they are not TransformerConfig fields.")
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def te_available() -> bool:
    """True when CUDA is present and Transformer Engine imports."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def layer_spec(use_te: bool) -> ModuleSpec:
    """The transformer layer spec: TE's on GPU, else Megatron's local spec with SDPAttention."""
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=False)
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=False))
    spec.submodules.self_attention.module = SDPSelfAttention
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def resolve_use_te(use_te: Optional[bool]) -> bool:
    """None -> TE when available; True without CUDA/TE -> a RuntimeError that says what to do."""
    if use_te is None:
        return te_available()
    if use_te and not torch.cuda.is_available():
        raise RuntimeError("use_te=True needs CUDA, and this machine has none: build with use_te=False "
                           "(Megatron's local spec) on the CPU.")
    if use_te and not te_available():
        raise RuntimeError("use_te=True but transformer_engine does not import: install "
                           "`transformer-engine[pytorch]` (pip install -e .[gpu]) or pass use_te=False.")
    return bool(use_te)


def gpt_model_kwargs(hf_config, config: TransformerConfig, *, use_te: Optional[bool] = None,
                     pre_process: Optional[bool] = None, post_process: Optional[bool] = None) -> dict:
    """GPTModel constructor arguments for `hf_config` on this pipeline stage (shared with the critic)."""
    rope = rope_settings(hf_config)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    return dict(
        config=config,
        transformer_layer_spec=layer_spec(resolve_use_te(use_te)),
        vocab_size=padded_vocab_size(hf_config.vocab_size, config.tensor_model_parallel_size),
        max_sequence_length=int(getattr(hf_config, "max_position_embeddings", 4096)),
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,  # logits stay split over TP; gather explicitly where needed
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=rope.theta,
        rope_scaling=rope.llama3_factor is not None,
        rope_scaling_factor=rope.llama3_factor or 8.0,
        seq_len_interpolation_factor=rope.linear_factor,
    )


def parallel_sizes() -> tuple[int, int]:
    """(TP, PP) of the initialised Megatron parallel state."""
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("Megatron parallel state is not initialised: call "
                           "megatron_searchr1.megatron.initialize.initialize_megatron(tp=..., pp=...) first.")
    return (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size())


def resolve_config(hf_config, config: Optional[TransformerConfig], params_dtype: torch.dtype) -> TransformerConfig:
    """`config`, checked against the parallel state, or a fresh one from `hf_config`."""
    tp, pp = parallel_sizes()
    if config is None:
        return transformer_config_from_hf(hf_config, tp=tp, pp=pp, params_dtype=params_dtype)
    if (config.tensor_model_parallel_size, config.pipeline_model_parallel_size) != (tp, pp):
        raise ValueError(f"config says TP={config.tensor_model_parallel_size}, PP={config.pipeline_model_parallel_size} "
                         f"but parallel_state is TP={tp}, PP={pp}: build the config with "
                         f"transformer_config_from_hf(hf_config, tp={tp}, pp={pp}, ...), matching the tp/pp given to "
                         "initialize_megatron (or pass config=None).")
    return config


def to_device(model: torch.nn.Module) -> torch.nn.Module:
    """Move to the current GPU when there is one (torch norms are created on the CPU); no-op on the CPU."""
    return model.cuda(torch.cuda.current_device()) if torch.cuda.is_available() else model


def build_gpt_model(
    hf_config,
    *,
    params_dtype: torch.dtype = torch.float32,
    use_te: Optional[bool] = None,
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
    config: Optional[TransformerConfig] = None,
) -> GPTModel:
    """This rank's GPTModel stage for `hf_config`, randomly initialised (load weights with the family mapping).

    TP/PP come from the initialised `parallel_state`; pass `config` to use your own TransformerConfig
    (e.g. from `transformer_config_from_hf(..., recompute_granularity="full")`). `model.hf_vocab_size`
    holds the unpadded vocabulary size.
    """
    return _build_stage(BatchFirstGPTModel, hf_config, params_dtype=params_dtype, use_te=use_te,
                        pre_process=pre_process, post_process=post_process, config=config)


def _build_stage(model_cls: type[GPTModel], hf_config, *, params_dtype: torch.dtype, use_te: Optional[bool],
                 pre_process: Optional[bool], post_process: Optional[bool],
                 config: Optional[TransformerConfig]) -> GPTModel:
    """The builder behind build_gpt_model and critic.build_critic_model: `model_cls(**GPTModel kwargs)`, faster
    modules swapped in, `hf_vocab_size` set, moved to the GPU when there is one."""
    use_te = resolve_use_te(use_te)
    config = resolve_config(hf_config, config, params_dtype)
    kwargs = gpt_model_kwargs(hf_config, config, use_te=use_te, pre_process=pre_process, post_process=post_process)
    model = model_cls(**kwargs)
    use_fast_modules(model, use_te=use_te)
    model.hf_vocab_size = int(hf_config.vocab_size)
    return to_device(model)


def uses_te_spec(model: torch.nn.Module) -> bool:
    """True when `model` was built with Transformer Engine layers (fused norm naming), False for the local spec."""
    return any(type(m).__module__.startswith("megatron.core.extensions.transformer_engine") for m in model.modules())


# ---------------------------------------------------------------------------------------------------------------
# Local-spec speed-ups (CPU). Each replaces one Megatron forward with the same math and fewer copies or less
# Python; tests compare each against the Megatron module it replaces.
# ---------------------------------------------------------------------------------------------------------------
class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up over fc1's [..., 2F] output, whose backward writes [d_gate, d_up] into one buffer.

    Megatron's unfused path (`torch.chunk` + silu + mul) pays a `torch.cat` of the two [..., F] gradients in
    backward: a copy of the layer's largest activation. Same saved tensors, same kernels otherwise
    (aten.silu_backward), so gradients match autograd's bit for bit.
    """

    @staticmethod
    def forward(ctx, x):
        gate, up = x.chunk(2, dim=-1)
        act = F.silu(gate)
        ctx.save_for_backward(x, act)
        return act * up

    @staticmethod
    def backward(ctx, grad):
        x, act = ctx.saved_tensors
        gate, up = x.chunk(2, dim=-1)
        grad_x = torch.empty_like(x)
        d_gate, d_up = grad_x.chunk(2, dim=-1)  # views into grad_x: written in place, no concat
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=d_gate)
        torch.mul(grad, act, out=d_up)
        return grad_x


class SwiGLUMLP(MLP):
    """Megatron's MLP with `_SwiGLU` on the plain path (SwiGLU, no bias, no fusion, no clamp/offset/scales)."""

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        cfg = self.config
        plain = (
            per_token_scale is None
            and cfg.gated_linear_unit
            and self.activation_func is F.silu
            and not cfg.use_te_activation_func
            and not cfg.bias_activation_fusion
            and cfg.activation_func_clamp_value is None
            and cfg.glu_linear_offset == 0.0
        )
        if not plain:
            return super().forward(hidden_states, per_token_scale=per_token_scale, **kwargs)
        intermediate, bias = self.linear_fc1(hidden_states)  # [s, b, 2F/tp]
        if bias is not None:
            intermediate = intermediate + bias
        return self.linear_fc2(_SwiGLU.apply(intermediate))


class _NoCommLinear:
    """Mixin for Megatron's parallel linears: run `F.linear` when the call needs no communication.

    Megatron routes every linear through a Python autograd Function (for async TP all-reduce, sequence
    parallelism and fused gradient accumulation). When none of those apply (TP=1 column layers, row layers
    without SP, no fusion) it computes exactly `input @ weight.T + bias`; PyTorch's native op does the same
    without the Python backward (~0.4 ms per layer call on the CPU). Anything else goes to Megatron's path.
    """

    def _forward_impl(self, input, weight, *args, **kwargs):
        plain = (
            not args
            and weight.requires_grad
            and not kwargs.get("gradient_accumulation_fusion")
            and not kwargs.get("allreduce_dgrad")
            and not kwargs.get("sequence_parallel")
            and kwargs.get("grad_output_buffer") is None
        )
        if not plain:
            return super()._forward_impl(input, weight, *args, **kwargs)
        return F.linear(input, weight, kwargs.get("bias"))


class FastColumnParallelLinear(_NoCommLinear, tensor_parallel.ColumnParallelLinear):
    """ColumnParallelLinear with the `_NoCommLinear` shortcut."""


class FastRowParallelLinear(_NoCommLinear, tensor_parallel.RowParallelLinear):
    """RowParallelLinear with the `_NoCommLinear` shortcut."""


class BatchFirstOutputLayer(FastColumnParallelLinear):
    """The LM output layer, computing logits batch-first when the model asks for logits.

    GPTModel returns `logits.transpose(0, 1).contiguous()`: a copy of the whole [s, b, V] logits tensor, and
    in backward the transposed gradient is copied twice more inside the linear layer. V is ~20-400x the hidden
    size, so those copies cost ~5% of a small model's step on the CPU. Transposing the [s, b, h] input instead
    (small) and returning a [s, b, V] *view* of a contiguous [b, s, V] result makes GPTModel's `.contiguous()`
    free and its backward copy-free. Numerically identical (same matmul per row).
    Only when `batch_first` is set (by BatchFirstGPTModel, for calls without labels): Megatron's loss path
    (`labels=...`) reads the [s, b, V] logits with `.view`, which needs them contiguous.
    """

    batch_first = False

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if not self.batch_first:
            return super().forward(input_, weight, runtime_gather_output)
        out, bias = super().forward(input_.transpose(0, 1).contiguous(), weight, runtime_gather_output)
        return out.transpose(0, 1), bias


class BatchFirstGPTModel(GPTModel):
    """GPTModel that lets a BatchFirstOutputLayer compute batch-first logits when it returns logits (no labels)."""

    def _postprocess(self, *args, **kwargs):
        layer = getattr(self, "output_layer", None)
        if isinstance(layer, BatchFirstOutputLayer):
            # GPTModel passes everything by keyword; only the plain-logits path transposes back to [b, s, V].
            layer.batch_first = (kwargs.get("labels") is None and not self.mtp_process
                                 and not self.config.sequence_parallel)
        return super()._postprocess(*args, **kwargs)


def use_fast_modules(model: GPTModel, *, use_te: bool) -> None:
    """Swap in the faster forwards (same parameters and state; only `forward` differs, so a class swap).

    Swapped after construction rather than in the spec because TransformerLayer only passes the TP group to
    a spec whose MLP *is* MLP. Transformer Engine models keep TE's own modules (only the output layer changes).
    """
    layer = getattr(model, "output_layer", None)
    if (type(layer) is tensor_parallel.ColumnParallelLinear and not model.config.sequence_parallel
            and not model.config.defer_embedding_wgrad_compute):
        layer.__class__ = BatchFirstOutputLayer
    if not use_te:
        swaps = {MLP: SwiGLUMLP, tensor_parallel.ColumnParallelLinear: FastColumnParallelLinear,
                 tensor_parallel.RowParallelLinear: FastRowParallelLinear}
        for module in model.modules():
            if type(module) in swaps:
                module.__class__ = swaps[type(module)]
