"""Megatron `GPTModel` built from a Hugging Face `transformers` config (families: models/families/).

    model = build_gpt_model(hf_config)          # TP/PP read from parallel_state; a ModelDims works as well

The HF config is read once into `ModelDims` (families/dims.py); the TransformerConfig (config.py), the module spec
(spec.py: TE on GPU, Megatron's local spec with our SDPAttention on the CPU) and the GPTModel arguments all come from
that record. After construction `use_fast_modules` (fast_modules.py) swaps in faster forwards of the same math on the
local spec, and parameters are cast to `params_dtype` (torch norms are created in fp32).

Parameter names the model produces (per pipeline stage; `i` is the layer index *within this stage*, the global index
is `model.decoder.layers[i].layer_number - 1`; TP shards are per rank):

    embedding.word_embeddings.weight                     [V_pad / tp, H]            first stage only
    decoder.layers.i.input_layernorm.weight              [H]                        local spec only
    decoder.layers.i.self_attention.linear_qkv.weight    [(nq + 2 ng) / tp * d, H]  rows per query group:
                                                         [q_0 .. q_{r-1}, k, v] (r = nq / ng), rows split over TP
                                                         (ng < tp: a rank holds a slice of one group; Megatron
                                                         all-gathers its group, so kv heads are replicated)
    decoder.layers.i.self_attention.linear_qkv.bias      [(nq + 2 ng) / tp * d]     Qwen2, biased Llama
    decoder.layers.i.self_attention.q_layernorm.weight   [d]                        Qwen3 (k_layernorm too)
    decoder.layers.i.self_attention.linear_proj.weight   [H, nq * d / tp]           (+ .bias [H], biased Llama)
    decoder.layers.i.pre_mlp_layernorm.weight            [H]                        local spec only
    decoder.layers.i.mlp.linear_fc1.weight               [2 F / tp, H]              per rank: [gate shard; up shard]
    decoder.layers.i.mlp.linear_fc2.weight               [H, F / tp]                (fc1/fc2 .bias, biased Llama)
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
from typing import Any, Optional

import torch

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_searchr1.models.config import (  # noqa: F401  (re-exported: callers import them from gpt)
    check_parallel_sizes, kernel_overrides, padded_vocab_size, transformer_config_from_hf, wgrad_fusion_available,
)
from megatron_searchr1.models.families import SUPPORTED_ARCHITECTURES, ModelDims, read_dims  # noqa: F401
from megatron_searchr1.models.fast_modules import (  # noqa: F401  (re-exported)
    BatchFirstGPTModel, BatchFirstOutputLayer, FastColumnParallelLinear, FastRowParallelLinear, SwiGLUMLP,
    use_fast_modules,
)
from megatron_searchr1.models.spec import (  # noqa: F401  (re-exported)
    block_spec, layer_spec, resolve_use_te, te_available, uses_te_spec,
)


def gpt_model_kwargs(hf_config: Any, config: TransformerConfig, *, use_te: Optional[bool] = None,
                     pre_process: Optional[bool] = None, post_process: Optional[bool] = None) -> dict:
    """GPTModel constructor arguments for `hf_config` (or its ModelDims) on this pipeline stage (shared with the
    critic)."""
    dims = read_dims(hf_config)
    use_te = resolve_use_te(use_te)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    return dict(
        config=config,
        transformer_layer_spec=block_spec(config, use_te, dims.qk_norm),
        vocab_size=padded_vocab_size(dims.vocab_size, config.tensor_model_parallel_size),
        max_sequence_length=dims.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,  # logits stay split over TP; gather explicitly where needed
        share_embeddings_and_output_weights=dims.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=dims.rope.theta,
        rope_scaling=dims.rope.llama3_factor is not None,
        rope_scaling_factor=dims.rope.llama3_factor or 8.0,
        seq_len_interpolation_factor=dims.rope.linear_factor,
    )


def parallel_sizes() -> tuple[int, int]:
    """(TP, PP) of the initialised Megatron parallel state."""
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("Megatron parallel state is not initialised: call "
                           "megatron_searchr1.megatron.initialize.initialize_megatron(tp=..., pp=...) first.")
    return (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size())


def resolve_config(dims: ModelDims, config: Optional[TransformerConfig], params_dtype: torch.dtype) -> TransformerConfig:
    """A copy of `config`, checked against the parallel state, or a fresh one from `dims`.

    A copy because a model owns its config: wrap_ddp writes the model's DDP hooks into it (`no_sync_func`), so one
    config shared by the actor, the reference and the critic (model_settings' dict) would hand the last-wrapped
    model's hooks to the others."""
    tp, pp = parallel_sizes()
    ep = parallel_state.get_expert_model_parallel_world_size()
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    if config is None:
        return transformer_config_from_hf(dims, tp=tp, pp=pp, params_dtype=params_dtype, ep=ep,
                                          expert_tp=etp if dims.moe is not None else None)
    if config.expert_model_parallel_size != ep:
        raise ValueError(f"config says EP={config.expert_model_parallel_size} but parallel_state is EP={ep}: build "
                         f"the config with transformer_config_from_hf(..., ep={ep}), matching initialize_megatron's ep")
    if config.num_moe_experts and config.expert_tensor_parallel_size != etp:
        # the experts' shards follow the process groups, not the config: a mismatch would size them wrongly
        raise ValueError(f"config says expert TP={config.expert_tensor_parallel_size} but parallel_state is expert "
                         f"TP={etp}: pass the same parallel.expert_tp to model_settings(expert_tp=...) and to "
                         "initialize_megatron (Megatron's expert_tensor_parallel_size)")
    if (config.tensor_model_parallel_size, config.pipeline_model_parallel_size) != (tp, pp):
        raise ValueError(f"config says TP={config.tensor_model_parallel_size}, PP={config.pipeline_model_parallel_size} "
                         f"but parallel_state is TP={tp}, PP={pp}: build the config with "
                         f"transformer_config_from_hf(hf_config, tp={tp}, pp={pp}, ...), matching the tp/pp given to "
                         "initialize_megatron (or pass config=None).")
    return copy.copy(config)


def model_settings(hf_config: Any, *, tp: int, pp: int, params_dtype: torch.dtype, use_te: Optional[bool] = None,
                   sequence_parallel: bool = False, recompute: str = "none", ep: int = 1,
                   expert_tp: Optional[int] = None) -> dict:
    """Keyword arguments for build_actor / build_reference / build_critic from the run's model.use_te,
    model.recompute and parallel.sequence_parallel / ep / expert_tp: `params_dtype`, the resolved `use_te` (None: TE
    when CUDA is present and transformer_engine imports) and a TransformerConfig with the kernel settings
    (kernel_overrides: fusions on only with TE on CUDA). `expert_tp` (None: 1 for MoE, config.default_expert_tp).
    An MoE model on the TE spec runs its experts as TE's grouped GEMM (moe_grouped_gemm) and, on CUDA with TE's
    fused kernels, permutes its tokens fused (moe_permute_fusion; TE-only: the local spec keeps both off).
    On a CPU with the defaults the config equals the one build_gpt_model makes."""
    use_te = resolve_use_te(use_te)
    moe = read_dims(hf_config).moe is not None
    if moe and tp > 1 and not sequence_parallel:
        # Megatron's MoELayer refuses to train under TP without it (the experts' tokens are split over TP).
        raise ValueError(f"an MoE model at parallel.tp={tp} trains only with parallel.sequence_parallel=true: set "
                         "it, or use parallel.tp=1 and parallel.ep for the experts")
    overrides = kernel_overrides(tp=tp, sequence_parallel=sequence_parallel, recompute=recompute, te=use_te,
                                 cuda=torch.cuda.is_available(), wgrad_fusion=use_te and wgrad_fusion_available())
    if moe and use_te:
        overrides.update(moe_grouped_gemm=True, moe_permute_fusion=permute_fusion_available())
    config = transformer_config_from_hf(hf_config, tp=tp, pp=pp, params_dtype=params_dtype, ep=ep,
                                        expert_tp=expert_tp, **overrides)
    return dict(params_dtype=params_dtype, use_te=use_te, config=config)


def permute_fusion_available() -> bool:
    """Whether Megatron finds TE's fused token permutation (moe_permute_fusion: CUDA kernels of TE >= 2.1);
    Megatron's TransformerConfig refuses the flag without them."""
    if not torch.cuda.is_available():
        return False
    try:
        from megatron.core.transformer.moe import moe_utils
    except Exception:
        return False
    return all(getattr(moe_utils, n, None) is not None for n in (
        "fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
        "fused_sort_chunks_by_index_with_probs", "fused_unpermute"))


def cast_params(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast every floating-point parameter to `dtype`, in place (torch norms are created in fp32 whatever
    params_dtype says; a bf16 model must hold bf16 norms, as Megatron-LM's Float16Module makes them)."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def to_device(model: torch.nn.Module) -> torch.nn.Module:
    """Move to the current GPU when there is one (torch norms are created on the CPU); no-op on the CPU."""
    return model.cuda(torch.cuda.current_device()) if torch.cuda.is_available() else model


def build_gpt_model(
    hf_config: Any,
    *,
    params_dtype: torch.dtype = torch.float32,
    use_te: Optional[bool] = None,
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
    config: Optional[TransformerConfig] = None,
    tokenizer_vocab_size: Optional[int] = None,
) -> GPTModel:
    """This rank's GPTModel stage for `hf_config` (or its ModelDims), randomly initialised (load weights with the
    family mapping).

    TP/PP come from the initialised `parallel_state`; pass `config` to use your own TransformerConfig
    (e.g. from `transformer_config_from_hf(..., recompute_granularity="full")`). `model.hf_vocab_size` holds the
    vocabulary the log-probs and logits run over (real_vocab_size): config.json's vocab_size, or
    `tokenizer_vocab_size` (len(tokenizer)) when that is smaller.
    """
    return build_stage(BatchFirstGPTModel, hf_config, params_dtype=params_dtype, use_te=use_te,
                       pre_process=pre_process, post_process=post_process, config=config,
                       tokenizer_vocab_size=tokenizer_vocab_size)


def real_vocab_size(config_vocab_size: int, tokenizer_vocab_size: Optional[int] = None) -> int:
    """The ids a model can emit: config.json's vocab_size, cut to the tokenizer's size when that is smaller.

    Checkpoints pad their embedding beyond the tokenizer (Qwen2.5: 152,064 rows for 151,665 ids); no text maps to
    those rows, so they are kept out of every softmax, as vLLM's sampler and verl's log-probs keep them out. (The
    weights keep all rows: the converters and the weight sync move config.json's vocabulary.)

    >>> real_vocab_size(152064, 151665), real_vocab_size(32000), real_vocab_size(100, 120)
    (151665, 32000, 100)
    """
    if tokenizer_vocab_size is None:
        return config_vocab_size
    if tokenizer_vocab_size < 1:
        raise ValueError(f"tokenizer_vocab_size must be >= 1, got {tokenizer_vocab_size}")
    return min(config_vocab_size, tokenizer_vocab_size)


def build_stage(model_cls: type[GPTModel], hf_config: Any, *, params_dtype: torch.dtype, use_te: Optional[bool],
                pre_process: Optional[bool], post_process: Optional[bool],
                config: Optional[TransformerConfig], tokenizer_vocab_size: Optional[int] = None) -> GPTModel:
    """The builder behind build_gpt_model and critic.build_critic_model: `model_cls(**GPTModel kwargs)`, faster
    modules swapped in, parameters in the config's dtype, `hf_vocab_size` set (real_vocab_size), moved to the GPU
    when there is one."""
    dims = read_dims(hf_config)
    use_te = resolve_use_te(use_te)
    config = resolve_config(dims, config, params_dtype)
    kwargs = gpt_model_kwargs(dims, config, use_te=use_te, pre_process=pre_process, post_process=post_process)
    model = model_cls(**kwargs)
    use_fast_modules(model, use_te=use_te)
    cast_params(model, config.params_dtype)
    model.hf_vocab_size = real_vocab_size(dims.vocab_size, tokenizer_vocab_size)
    return to_device(model)
