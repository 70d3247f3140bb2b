"""ModelDims -> Megatron `TransformerConfig`, and the parallel sizes a model fits.

    config = transformer_config_from_hf(hf_config, tp=2, pp=2)        # validate + translate (ModelDims accepted too)
    check_parallel_sizes(hf_config, tp=2, pp=2, world_size=8)          # ValueError naming every problem
    overrides = kernel_overrides(tp=4, sequence_parallel=True, recompute="selective", te=True, cuda=True)

The HF config is read once (`families.read_dims`); everything here reads the resulting ModelDims.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.nn.functional as F

from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_searchr1.models.families import ModelDims, read_dims, stage_layer_counts


def default_expert_tp(dims: ModelDims, tp: int, expert_tp: Optional[int] = None) -> int:
    """parallel.expert_tp as Megatron gets it: `expert_tp` when given, else 1 for an MoE model (whole experts per
    rank, spread by EP instead: slime's TP4 x EP8 layout) and TP for a dense one (which has no experts)."""
    if expert_tp is not None:
        return expert_tp
    return 1 if dims.moe is not None else tp


def check_parallel_sizes(hf_config_or_dims: Any, tp: int, pp: int, *, first_stage_layers: Optional[int] = None,
                         last_stage_layers: Optional[int] = None, world_size: Optional[int] = None,
                         ep: int = 1, expert_tp: Optional[int] = None) -> None:
    """Refuse TP/PP (and a world size) that do not fit the model: a ValueError listing every problem and what to do.

    Megatron's rules: TP divides the query heads and the MLP width; the KV heads (query groups) are a multiple of
    TP (each rank holds whole groups) or divide TP (each group is replicated over TP/groups ranks, as Megatron's
    attention does); the layers split over PP stages (evenly, or with `first_stage_layers` / `last_stage_layers`
    on the end stages and the rest evenly); the world size, when given, is a multiple of TP*PP. Expert parallelism
    (`ep`, MoE models only): EP divides the experts, expert TP (`expert_tp`, default_expert_tp: 1 for MoE) divides
    an expert's width, and the world is a multiple of TP*PP*EP as well (the experts' data-parallel groups are
    world / (expert_tp*PP*EP) ranks).
    """
    dims = read_dims(hf_config_or_dims)
    heads, groups, ffn = dims.num_heads, dims.num_kv_heads, dims.ffn_hidden_size
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
        try:
            stage_layer_counts(dims.num_layers, pp, first_stage_layers, last_stage_layers)
        except ValueError as e:
            problems.append(str(e))
        if world_size is not None and world_size % (tp * pp):
            problems.append(f"world size {world_size} is not a multiple of tp*pp={tp * pp}: launch with "
                            f"`torchrun --nproc_per_node {tp * pp} ...` (or use TP=1 PP=1 in one process)")
        problems += _expert_parallel_problems(dims, tp, pp, ep, world_size, default_expert_tp(dims, tp, expert_tp))
    if problems:
        raise ValueError("; ".join(problems))


def _expert_parallel_problems(dims: ModelDims, tp: int, pp: int, ep: int, world_size: Optional[int],
                              expert_tp: int) -> list[str]:
    if ep < 1 or expert_tp < 1:
        return [f"EP and expert TP must be >= 1 (got EP={ep}, expert TP={expert_tp})"]
    if dims.moe is None:
        return [] if ep == 1 else [f"EP={ep} needs a mixture-of-experts model; this one is dense: set parallel.ep=1"]
    problems = []
    if dims.moe.num_experts % ep:
        problems.append(f"EP={ep} does not divide num_experts={dims.moe.num_experts}: choose an EP that divides it")
    if dims.moe.ffn_hidden_size % expert_tp:
        problems.append(f"expert TP={expert_tp} does not divide moe_intermediate_size={dims.moe.ffn_hidden_size}: "
                        "choose a parallel.expert_tp that divides it (1: whole experts per rank)")
    if world_size is not None and world_size % (expert_tp * pp * ep):
        problems.append(f"world size {world_size} is not a multiple of expert_tp*pp*ep={expert_tp * pp * ep} (the "
                        "expert layout): choose a parallel.expert_tp that fits")
    if dims.moe.shared_expert_size % tp:
        problems.append(f"TP={tp} does not divide shared_expert_intermediate_size={dims.moe.shared_expert_size}")
    if world_size is not None and world_size % (tp * pp * ep):
        problems.append(f"world size {world_size} is not a multiple of tp*pp*ep={tp * pp * ep}: launch with "
                        f"`torchrun --nproc_per_node {tp * pp * ep} ...` (or lower parallel.ep)")
    return problems


def moe_config_fields(dims: ModelDims, ep: int = 1, expert_tp: int = 1, grouped_gemm: bool = False,
                      permute_fusion: bool = False) -> dict[str, Any]:
    """The TransformerConfig fields of an MoE model ({} for a dense one).

    The token dispatcher is alltoall everywhere (allgather refuses variable_seq_lengths, which pipelined RL
    micro-batches need); on the CPU it runs over gloo thanks to compat._split_sizes_to_host. `grouped_gemm`: the
    experts of a rank run as one grouped GEMM (TE's TEGroupedMLP; spec.block_spec builds it on the TE spec only),
    else as Megatron's SequentialMLP (one GEMM pair per expert, what the CPU runs); both name their weights so that
    families/base.grouped_to_sequential_name maps one onto the other. `permute_fusion`: TE's fused token permute /
    unpermute (CUDA). `expert_tp`: Megatron's expert_tensor_parallel_size. The router's GEMM and softmax run in
    fp32 (HF upcasts the router logits too).
    """
    moe = dims.moe
    if moe is None:
        return {}
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.topk,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_shared_expert_intermediate_size=moe.shared_expert_size or None,
        moe_shared_expert_gate=moe.shared_expert_gate,
        moe_layer_freq=[1 if dims.is_moe_layer(i) else 0 for i in range(dims.num_layers)],
        moe_grouped_gemm=grouped_gemm,
        moe_permute_fusion=permute_fusion,
        moe_router_dtype="fp32",
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=expert_tp,
    )


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


RECOMPUTE = {
    "none": {},
    # Megatron's selective recomputation: the attention core (softmax, dropout) is recomputed in backward, the
    # activation that grows with the square of the sequence; the rest is kept.
    "selective": dict(recompute_granularity="selective"),
    # Every layer keeps only its input and runs again in backward (one layer per checkpoint).
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}


def kernel_overrides(*, tp: int, sequence_parallel: bool = False, recompute: str = "none", te: bool = False,
                     cuda: bool = False, wgrad_fusion: bool = False) -> dict[str, Any]:
    """TransformerConfig fields for the GPU kernel settings (model.recompute, parallel.sequence_parallel, fusions).

    The fusions are CUDA kernels (bias+SwiGLU, bias+dropout+add: jit-fused; RoPE: Transformer Engine's), so they
    are on only with `cuda` and `te`; `gradient_accumulation_fusion` also needs Apex's fused_weight_gradient_mlp_cuda
    (`wgrad_fusion`), which Megatron's own output layer calls even under the TE spec. Masked-softmax fusion is on
    with them (the local spec's attention falls back to torch where the kernel does not apply). On the CPU (the
    defaults) this returns {}: the config stays as transformer_config_from_hf makes it.

    >>> kernel_overrides(tp=1)
    {}
    >>> kernel_overrides(tp=1, recompute="full")["recompute_method"]
    'uniform'
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"model.recompute must be one of {sorted(RECOMPUTE)}, got {recompute!r}")
    if sequence_parallel and tp < 2:
        raise ValueError(f"parallel.sequence_parallel=true splits activations over the TP ranks and needs "
                         f"parallel.tp > 1 (got tp={tp}): raise parallel.tp or set parallel.sequence_parallel=false")
    out: dict[str, Any] = dict(RECOMPUTE[recompute])
    if sequence_parallel:
        out["sequence_parallel"] = True
    if te and cuda:
        out.update(bias_activation_fusion=True, bias_dropout_fusion=True, masked_softmax_fusion=True,
                   apply_rope_fusion=True, gradient_accumulation_fusion=bool(wgrad_fusion))
    return out


def wgrad_fusion_available() -> bool:
    """Whether Apex's fused_weight_gradient_mlp_cuda imports (what gradient_accumulation_fusion needs); imported
    here, lazily, only on GPUs."""
    if not torch.cuda.is_available():
        return False
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except Exception:  # ImportError, or a CUDA/ABI mismatch
        return False
    return True


def transformer_config_from_hf(
    hf_config: Any, *, tp: int = 1, pp: int = 1, params_dtype: torch.dtype = torch.float32, ep: int = 1,
    expert_tp: Optional[int] = None, **overrides: Any
) -> TransformerConfig:
    """A Megatron TransformerConfig equivalent to `hf_config` (or its ModelDims) for TP=`tp`, PP=`pp`.

    `ep`: expert-parallel size (MoE models); `expert_tp`: expert tensor-parallel size (default_expert_tp: 1 for
    MoE). Grouped GEMM and permute fusion come as `overrides` (moe_grouped_gemm, moe_permute_fusion; model_settings
    sets them on the TE spec).
    `overrides` are TransformerConfig fields applied last (e.g. recompute_granularity="full",
    bias_activation_fusion=True, apply_rope_fusion=True on GPU, num_layers_in_first_pipeline_stage=...).
    """
    dims: ModelDims = read_dims(hf_config)
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"Unknown TransformerConfig override(s) {unknown}: they are not TransformerConfig fields.")
    check_parallel_sizes(dims, tp, pp, first_stage_layers=overrides.get("num_layers_in_first_pipeline_stage"),
                         last_stage_layers=overrides.get("num_layers_in_last_pipeline_stage"), ep=ep,
                         expert_tp=expert_tp)
    expert_tp = default_expert_tp(dims, tp, expert_tp)
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
        layernorm_epsilon=dims.norm_eps,
        qk_layernorm=dims.qk_norm,
        gated_linear_unit=True,  # SwiGLU: linear_fc1 holds [gate; up]
        activation_func=F.silu,
        add_bias_linear=dims.linear_bias,
        add_qkv_bias=dims.qkv_bias,
        hidden_dropout=0.0,  # HF decoders have no residual dropout
        attention_dropout=dims.attention_dropout,
        init_method_std=dims.init_std,
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
        moe_token_dispatcher_type="alltoall",  # the default (allgather) rejects variable lengths
        **moe_config_fields(dims, ep, expert_tp),
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)
