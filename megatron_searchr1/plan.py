"""Will this config fit: the GPU memory of every phase of an RL step, per GPU, from the model built on the meta device.

    python -m megatron_searchr1.plan examples/grpo_qwen2.5-7b.yaml --nodes 1 --gpus-per-node 8 --gpu-memory-gib 80
    python -m megatron_searchr1.plan examples/ppo_qwen2.5-3b.yaml parallel.sequence_parallel=true --nodes 2 \
        --model-config tests/models/real_configs/Qwen2.5-3B-Instruct.json    # model not downloaded yet

What it promises. Parameter counts are those of the model the trainer builds: the project's builder pieces
(`gpt_model_kwargs`, `CriticModel`) construct every pipeline stage on the meta device (no weights, no GPU), so any
family models/families/ supports works. Tensor-parallel shards are computed from each parameter's split rule
(`families.tp_split`, the rule the converter loads shards with; Megatron's layers read their TP size from a real
process group, so a meta build at TP > 1 is not possible in one process). Building a stage needs Megatron's parallel
state, so the planner starts a world of one process (gloo on loopback) when none is running, and sets the pipeline
rank/size overrides per stage. Everything else is arithmetic, written down next to each number:

- weights: params x model.dtype bytes; gradients: Megatron DDP's fp32 buffer (`grad_reduce_in_fp32=True` in
  megatron/optimizer.py), 4 bytes per param, never sharded; optimizer: Adam m and v in fp32 plus an fp32 master copy
  for bf16/fp16 models (12 bytes per param; 8 for fp32 models), divided by DP with the distributed optimizer.
- MoE (parallel.ep): a rank holds E/ep routed experts at 1/tp of their width (Megatron's expert-TP defaults to TP)
  and the attention, norms, router and shared expert at its TP; the experts' gradients and optimizer state follow
  them, the optimizer state sharded over expert-DP = world / (ep x tp x pp) instead of DP. Activations: the MLP
  term becomes topk routed copies per token (`mlp_bytes_per_token`), balanced routing assumed (imbalance adds).
- activations (one micro-batch of optim.max_tokens_per_micro_batch tokens): Korthikanti et al. 2022 ("Reducing
  activation recomputation in large transformer models") per-layer accounting, adapted to these models (RMSNorm,
  GQA, SwiGLU, no dropout, fused flash attention on the GPU, so no s^2 score tensors), bytes per token per layer:
      a_bytes * (4h / sp + (nq/tp + 2 ceil(ng/tp)) d + nq d / tp + 3 F / tp)
  (two norm inputs and two linear inputs of width h, split over TP with sequence parallelism (sp = tp); q, k, v;
  the attention output; fc1's [gate; up] output and fc2's input). Selective recomputation re-runs the attention
  core, whose only saved tensors beyond these are flash attention's per-row statistics: it saves ~nothing with
  fused attention. Full recomputation keeps one h-wide input per layer and re-runs one layer at a time. With
  PP > 1, 1F1B keeps up to PP micro-batches in flight on the first stage: PP x that stage's layers.
- log-probs head (last stage): per token and local vocab column (V_pad / tp), 12 bytes: the fp32 softmax kept for
  backward (4), its fp32 gradient (4) and the bf16 logits and their gradient (2 + 2); with entropy
  (algo.entropy_coeff > 0) 24: the fp32 shifted logits kept too (4) and two fp32 temporaries of dH/dz (8).
- vLLM (one engine per rollout.engine_tp GPUs): its share is rollout.gpu_memory_utilization x the GPU: its weights
  (sharded over engine_tp), an activation estimate (8192 batched tokens through one layer's widest tensors plus
  256 rows of fp32 logits) and the KV cache, the rest. KV per token = 2 x layers x ceil(ng / engine_tp) x d x bytes.
- constants (stated, not measured): CUDA context 1 GiB per GPU (0.5-1 GiB depending on driver and kernels loaded;
  one process per GPU, vLLM in-process); vLLM memory outside its sleep pools (CUDA graphs, buffers) 1 GiB.

Phases (the trainer's order, train.py): start-up (vLLM's own check that gpu_memory_utilization x GPU is free when
it starts, after the trainer's models exist), update peak (actor or critic update; vLLM asleep), weight sync (vLLM
weights awake, the update's cache emptied, KV cache not yet awake), rollout (vLLM fully awake). `--wake together`
models the trainer before issue 19 instead: weights and KV cache woken at once while PyTorch's allocator still
caches the update's activations. Offload flags act while the engine generates (model.param_offload for the actor
and critic weights, grad_offload, optimizer_offload; ref_offload keeps the reference in host memory except during
its forward pass); rollout.sleep_level 1 keeps a pinned host copy of vLLM's weights, 2 frees them.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Optional, Sequence

from megatron_searchr1.cli import ArgumentParser, UsageError, above, at_least, run_main

GiB = 1 << 30
CUDA_CONTEXT = 1 * GiB
"""Per GPU: the CUDA context and the kernels loaded (0.5-1 GiB); an estimate."""
VLLM_OUTSIDE_POOLS = 1 * GiB
"""vLLM memory that sleep does not free (CUDA graphs, sampler and input buffers); an estimate."""
VLLM_BATCHED_TOKENS = 8192
"""vLLM's profile run: tokens of one forward (max_num_batched_tokens)."""
VLLM_MAX_SEQS = 256
"""vLLM's max_num_seqs: rows of fp32 logits in the sampler."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
WAKE_MODES = ("staged", "together")


# ----------------------------------------------------------------------------------------------------------------
# Parameter counts: the model built on the meta device
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StageCounts:
    """Parameters of one pipeline stage on one TP rank."""

    actor: int
    """Actor (= reference) parameters on this rank."""
    critic: int
    """Critic parameters on this rank (trunk + value head, no output layer)."""
    layers: int
    """Transformer layers of this stage."""
    first: bool
    last: bool
    actor_experts: int = 0
    """Of `actor`, the routed-expert parameters (MoE): this rank's E/ep experts at 1/tp of their width."""
    critic_experts: int = 0
    """Of `critic`, the routed-expert parameters."""


@dataclass(frozen=True)
class ModelCounts:
    """What the planner needs to know about the model at (tp, pp)."""

    dims: object
    """families.ModelDims."""
    tp: int
    pp: int
    stages: tuple[StageCounts, ...]
    hf_params: int
    """Parameters of the HF model (what the engine holds, unsharded)."""
    hf_replicated: int
    """Of those, the ones every engine TP rank holds whole (norms, replicated biases, MoE routers)."""
    ep: int = 1
    """Expert-parallel size (parallel.ep); expert-TP is Megatron's default, tp."""


def read_dims_of(hf_config):
    """The model's families.ModelDims from a config.json dict (or a transformers config)."""
    from megatron_searchr1.models.families import read_dims

    return read_dims(hf_config)


def _ensure_world_of_one() -> bool:
    """Megatron's parallel state (a world of one process) for building stages; True when we started it."""
    import torch
    from megatron.core import parallel_state as ps

    from megatron_searchr1.megatron.initialize import initialize_megatron

    if ps.model_parallel_is_initialized():
        return False
    # gloo on the CPU; where CUDA works (a GPU login node) the project's default (a world of one on one GPU)
    initialize_megatron(tp=1, pp=1, device=None if torch.cuda.is_available() else "cpu")
    return True


def build_meta_stage(dims, pp: int, stage: int, *, critic: bool = False, first_stage_layers: Optional[int] = None,
                     last_stage_layers: Optional[int] = None):
    """One pipeline stage of the actor (or critic) at TP = 1 on the meta device, its layers renumbered to their global
    index (`layer_number` is 1-based, as Megatron sets it). Needs Megatron's parallel state (any world)."""
    import torch
    from megatron.core import parallel_state as ps

    from megatron_searchr1.models.config import transformer_config_from_hf
    from megatron_searchr1.models.critic import CriticModel
    from megatron_searchr1.models.families import stage_layer_counts
    from megatron_searchr1.models.gpt import BatchFirstGPTModel, gpt_model_kwargs, use_fast_modules

    extra = {}
    if first_stage_layers is not None:
        extra["num_layers_in_first_pipeline_stage"] = first_stage_layers
    if last_stage_layers is not None:
        extra["num_layers_in_last_pipeline_stage"] = last_stage_layers
    # CPU-style initialisation creates every weight with a plain torch.empty, which the meta device context catches
    # (the GPU path would allocate on the current GPU); no init kernels on meta tensors either
    config = transformer_config_from_hf(dims, tp=1, pp=pp, params_dtype=torch.float32, use_cpu_initialization=True,
                                        perform_initialization=False, **extra)
    counts = stage_layer_counts(dims.num_layers, pp, first_stage_layers, last_stage_layers)
    ps.set_pipeline_model_parallel_world_size(pp)
    ps.set_pipeline_model_parallel_rank(stage)
    try:
        with torch.device("meta"):
            kwargs = gpt_model_kwargs(dims, config, use_te=False, pre_process=stage == 0, post_process=stage == pp - 1)
            if stage > 0:
                # a tied model's later stage keeps its own copy of the embedding as output_layer.weight (same
                # shape); Megatron's tie set-up asks the real pipeline group, which in a world of one says stage 0
                kwargs["share_embeddings_and_output_weights"] = False
            model = (CriticModel if critic else BatchFirstGPTModel)(**kwargs)
            use_fast_modules(model, use_te=False)
    finally:
        ps.set_pipeline_model_parallel_world_size(None)
        ps.set_pipeline_model_parallel_rank(None)
    if len(model.decoder.layers) != counts[stage]:
        raise AssertionError(f"stage {stage} built {len(model.decoder.layers)} layers, expected {counts[stage]}")
    offset = sum(counts[:stage])
    for i, layer in enumerate(model.decoder.layers):
        layer.layer_number = offset + i + 1
    return model


def shard_numel(global_name: str, shape: Sequence[int], dims, tp: int) -> int:
    """Elements of one TP rank's shard of a full (TP = 1) parameter, by its split rule (families.tp_split);
    vocabulary tensors are padded to a multiple of 128 x tp first, as Megatron pads them."""
    from megatron_searchr1.models.config import padded_vocab_size
    from megatron_searchr1.models.families import tp_kind

    numel = math.prod(shape)
    if global_name.startswith("value_head."):
        return numel  # the critic's head is replicated over TP
    kind = tp_kind(global_name)
    if kind == "vocab":
        return padded_vocab_size(dims.vocab_size, tp) // tp * shape[1]
    return numel if kind == "replicated" else numel // tp


def stage_param_numel(model, dims, tp: int, ep: int = 1) -> tuple[int, int]:
    """(all, routed experts): one rank's parameter counts of a meta stage built by `build_meta_stage` (at EP = 1,
    every expert) at TP = `tp` and EP = `ep`: a rank holds E/ep experts, each at 1/tp of its width (Megatron's
    expert-TP defaults to TP), and the attention, norms, router and shared expert at its TP alone."""
    from megatron_searchr1.models.families import is_expert_param
    from megatron_searchr1.rollout.weight_sync import global_param_names

    dense = experts = 0
    for _, g, p in global_param_names(model):
        n = shard_numel(g, p.shape, dims, tp)
        if is_expert_param(g):
            experts += n
        else:
            dense += n
    dense += sum(p.numel() for n, p in model.named_parameters() if n.startswith("value_head."))
    if experts % ep:
        raise ValueError(f"EP={ep} does not split the {experts} expert parameters evenly (parallel.ep)")
    return dense + experts // ep, experts // ep


def count_params(dims, tp: int, pp: int, last_stage_layers: Optional[int] = None, ep: int = 1) -> ModelCounts:
    """ModelCounts for `dims` at (tp, pp, ep): every stage of the actor and the critic built on the meta device
    (`last_stage_layers`: an uneven split, Megatron's num_layers_in_last_pipeline_stage). The stages are built at
    EP = 1 (a world of one has no expert groups) and the experts divided by `ep` (`stage_param_numel`)."""
    from megatron_searchr1.models.families import mapping_for, stage_layer_counts, tp_kind

    _ensure_world_of_one()
    layers = stage_layer_counts(dims.num_layers, pp, None, last_stage_layers)
    stages = []
    for s in range(pp):
        actor, actor_e = stage_param_numel(build_meta_stage(dims, pp, s, last_stage_layers=last_stage_layers), dims,
                                           tp, ep)
        critic, critic_e = stage_param_numel(
            build_meta_stage(dims, pp, s, critic=True, last_stage_layers=last_stage_layers), dims, tp, ep)
        stages.append(StageCounts(actor, critic, layers[s], s == 0, s == pp - 1, actor_e, critic_e))
    mapping = mapping_for(dims)
    hf_params = hf_replicated = 0
    for name in mapping.megatron_names():
        n = math.prod(mapping.megatron_shape(name))
        if tp_kind(name) == "vocab":
            n = n // dims.padded_vocab_size * dims.vocab_size
        hf_params += n
        hf_replicated += n if tp_kind(name) == "replicated" else 0
    return ModelCounts(dims, tp, pp, tuple(stages), hf_params, hf_replicated, ep)


# ----------------------------------------------------------------------------------------------------------------
# Byte arithmetic (pure functions of the config and the counts)
# ----------------------------------------------------------------------------------------------------------------
def optimizer_bytes_per_param(dtype: str) -> int:
    """Adam's m and v in fp32, plus the fp32 master weight of a bf16/fp16 model (megatron/optimizer.py)."""
    return 8 if dtype == "float32" else 12


def activation_bytes_per_token_layer(dims, tp: int, *, sequence_parallel: bool, recompute: str, a_bytes: int) -> int:
    """Saved activations of one layer per token (module docstring for the formula); full recompute: the layer input."""
    sp = tp if sequence_parallel else 1
    h, d, f = dims.hidden_size, dims.head_dim, dims.ffn_hidden_size
    if recompute == "full":
        return a_bytes * h // sp
    qkv = (dims.num_heads // tp + 2 * math.ceil(dims.num_kv_heads / tp)) * d
    return a_bytes * (4 * h // sp + qkv + dims.num_heads * d // tp) + mlp_bytes_per_token(dims, tp, a_bytes)


def mlp_bytes_per_token(dims, tp: int, a_bytes: int) -> int:
    """The MLP's saved activations per token: a dense layer's 3F/tp (fc1's [gate; up] output, fc2's input); an MoE
    layer's (the largest layer of a mixed model) per routed copy, topk of them with balanced routing: the permuted
    input h (fc1's weight gradient) and the expert output h (kept for the probabilities' gradient) plus 3 fm/tp
    (expert TP = tp), the shared expert's 3 S/tp, and the router's fp32 logits and probabilities (8E bytes).
    Under EP a rank receives, on average, topk copies of each of its micro-batch's tokens (the all-to-all swaps
    tokens between EP ranks, each with a micro-batch of its own)."""
    moe = dims.moe
    if moe is None or not moe.layers:
        return a_bytes * 3 * dims.ffn_hidden_size // tp
    routed = moe.topk * (2 * dims.hidden_size + 3 * moe.ffn_hidden_size // tp)
    return a_bytes * (routed + 3 * moe.shared_expert_size // tp) + 8 * moe.num_experts


def head_bytes_per_token(dims, tp: int, entropy: bool) -> int:
    """The log-probs head per token: 12 (24 with entropy) bytes per local vocab column (module docstring)."""
    from megatron_searchr1.models.config import padded_vocab_size

    return padded_vocab_size(dims.vocab_size, tp) // tp * (24 if entropy else 12)


@dataclass
class Phase:
    """One phase's memory on one GPU: (item, bytes) in print order."""

    name: str
    items: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.items.values())


@dataclass
class Plan:
    """The planner's answer for one config on one cluster shape."""

    world: int
    dp: int
    gpu_bytes: int
    stage: int
    """The pipeline stage with the largest update peak (the one reported)."""
    phases: list
    kv_bytes: int
    kv_bytes_per_token: int
    trajectories_per_engine: int
    full_length: int
    host_bytes_per_node: int
    sync_buckets: int
    sync_extra_bytes: int
    notes: list

    @property
    def kv_tokens(self) -> int:
        return max(0, self.kv_bytes) // self.kv_bytes_per_token

    @property
    def worst(self) -> "Phase":
        return max(self.phases, key=lambda p: p.total)

    @property
    def fits(self) -> bool:
        return self.kv_bytes > 0 and all(p.total <= self.gpu_bytes for p in self.phases)


def sync_plan(counts: ModelCounts, bucket_bytes: int, dtype_bytes: int) -> tuple[int, int]:
    """(buckets, peak extra bytes on one GPU) of the weight sync (rollout/weight_sync.py), planned as it plans:
    each stage's Megatron tensors mapped to HF on meta tensors (`mapping.megatron_to_hf`), packed in order into
    buckets of `bucket_bytes` HF bytes (`plan_buckets`; a larger tensor travels alone). Extra bytes of one bucket:
    this rank's packed shards g/tp, the all-gathered buffer g, the merged tensors g, the HF-mapped tensors h, and with
    PP > 1 the packed broadcast buffer h (g = the bucket's TP-split tensors in full, h = its HF bytes). Under EP > 1
    the routed experts skip the buckets (`sync_expert_weights`): one MoE layer's E experts travel at a time, x bytes
    in full, all-gathered over expert-TP and EP (x) and merged (x), and with PP > 1 broadcast from their stage (x);
    each such layer counts as one bucket."""
    import torch

    from megatron_searchr1.models.config import padded_vocab_size
    from megatron_searchr1.models.families import is_expert_param, mapping_for, tp_kind
    from megatron_searchr1.rollout.weight_sync import aligned, plan_buckets

    dims, tp, pp = counts.dims, counts.tp, counts.pp
    mapping = mapping_for(dims, padded_vocab_size=padded_vocab_size(dims.vocab_size, tp))
    dtype = {4: torch.float32, 2: torch.bfloat16}[dtype_bytes]
    layer_counts = [st.layers for st in counts.stages]
    buckets = peak = 0
    for s in range(pp):
        lo, hi = sum(layer_counts[:s]), sum(layer_counts[: s + 1])
        mine = []
        experts: dict[int, int] = {}  # MoE layer -> its experts' bytes in full (EP > 1)
        for name in mapping.megatron_names():
            layer = int(name.split(".")[2]) if name.startswith("decoder.layers.") else None
            if layer is not None and lo <= layer < hi and counts.ep > 1 and is_expert_param(name):
                experts[layer] = experts.get(layer, 0) + math.prod(mapping.megatron_shape(name)) * dtype_bytes
            elif (layer is not None and lo <= layer < hi) or (name.startswith("embedding.") and s == 0) \
                    or (layer is None and not name.startswith("embedding.") and s == pp - 1):
                mine.append(name)
        for x in experts.values():
            peak = max(peak, 2 * x + (x if pp > 1 else 0))
            buckets += 1
        full = [math.prod(mapping.megatron_shape(n)) * dtype_bytes for n in mine]
        hf = [sum(aligned(t.numel() * dtype_bytes) for _, t in mapping.megatron_to_hf(
            n, torch.empty(mapping.megatron_shape(n), dtype=dtype, device="meta"))) for n in mine]
        for run in plan_buckets(hf, bucket_bytes):
            h = sum(hf[i] for i in run)
            g = sum(full[i] for i in run if tp > 1 and tp_kind(mine[i]) != "replicated")
            peak = max(peak, g // tp + 2 * g + h + (h if pp > 1 else 0))
            buckets += 1
    return buckets, peak


def plan_memory(cfg, counts: ModelCounts, *, world: int, gpu_bytes: int, wake: str = "staged",
                gpus_per_node: int = 8) -> Plan:
    """Every phase's bytes on one GPU (the pipeline stage with the largest update peak) for `cfg`."""
    m, p, r, a, o, d = cfg.model, cfg.parallel, cfg.rollout, cfg.algo, cfg.optim, cfg.data
    dims, tp, pp, ep = counts.dims, counts.tp, counts.pp, counts.ep
    dp = world // (tp * pp)
    edp = world // (tp * pp * ep)  # expert-DP: the ranks holding the same experts (expert-TP = tp)
    wb = DTYPE_BYTES[m.dtype]
    eb = DTYPE_BYTES[m.dtype if r.dtype == "auto" else r.dtype]
    shard, e_shard = (dp, edp) if p.use_distributed_optimizer else (1, 1)

    def sharded(per_param: float, n: int, n_experts: int) -> int:
        """Optimizer bytes of n params (n_experts of them routed experts, sharded over expert-DP only)."""
        return int((n - n_experts) * per_param / shard + n_experts * per_param / e_shard)

    opt_bytes = optimizer_bytes_per_param(m.dtype)
    master_bytes = 0 if m.dtype == "float32" else 4  # allocated at start-up; Adam's m, v at the first step
    has_ref = a.use_kl_loss or a.use_kl_in_reward
    tokens = o.max_tokens_per_micro_batch
    notes = []
    if dims.moe is not None:
        notes.append(f"MoE: {dims.moe.num_experts} experts over EP {ep} x expert-TP {tp}; their optimizer state is "
                     f"sharded over expert-DP {edp}, the rest over DP {dp}; vLLM (no expert parallelism in our "
                     f"engine config) holds every expert at 1/{r.engine_tp} of its width on each engine rank")

    # vLLM: one engine per engine_tp GPUs, its share of the GPU = weights + activations + KV cache
    etp = r.engine_tp
    vllm_weights = ((counts.hf_params - counts.hf_replicated) // etp + counts.hf_replicated) * eb
    mlp_width = dims.ffn_hidden_size if dims.moe is None else max(
        dims.ffn_hidden_size, dims.moe.topk * dims.moe.ffn_hidden_size + dims.moe.shared_expert_size)
    vllm_act = (VLLM_BATCHED_TOKENS * (3 * mlp_width // etp + 4 * dims.hidden_size) * eb
                + VLLM_MAX_SEQS * dims.vocab_size * 4 * 2)
    vllm_share = int(r.gpu_memory_utilization * gpu_bytes)
    kv = vllm_share - vllm_weights - vllm_act - VLLM_OUTSIDE_POOLS
    kv_per_token = 2 * dims.num_layers * math.ceil(dims.num_kv_heads / etp) * dims.head_dim * eb
    per_engine = math.ceil(d.train_batch_size * r.n / (world // etp))
    buckets, sync_extra = sync_plan(counts, r.sync_bucket_mb << 20, eb)
    asleep = VLLM_OUTSIDE_POOLS if r.sleep_between_steps else vllm_share
    ctx = {"CUDA context": CUDA_CONTEXT}

    best = None
    for s, st in enumerate(counts.stages):
        weights, grads, opt = st.actor * wb, st.actor * 4, sharded(opt_bytes, st.actor, st.actor_experts)
        ref = st.actor * wb if has_ref else 0
        c_w, c_g, c_o = ((st.critic * wb, st.critic * 4, sharded(opt_bytes, st.critic, st.critic_experts))
                         if a.uses_critic else (0, 0, 0))
        in_flight = (pp - s) * st.layers  # 1F1B: stage s holds up to pp - s micro-batches
        per_layer = activation_bytes_per_token_layer(dims, tp, sequence_parallel=p.sequence_parallel,
                                                     recompute=m.recompute, a_bytes=wb)
        acts = tokens * per_layer * in_flight
        if m.recompute == "full":  # one layer's activations while it is re-run in backward
            acts += tokens * activation_bytes_per_token_layer(dims, tp, sequence_parallel=p.sequence_parallel,
                                                              recompute="none", a_bytes=wb)
        head = tokens * head_bytes_per_token(dims, tp, a.entropy_coeff > 0) if st.last else 0
        states = {"actor weights": weights, "gradient buffer (fp32)": grads, "optimizer shard": opt,
                  "reference model": ref, "critic (weights+grads+optimizer)": c_w + c_g + c_o}
        start = Phase("start-up", {**states, "optimizer shard": sharded(master_bytes, st.actor, st.actor_experts),
                                   "critic (weights+grads+optimizer)": (c_w + c_g + sharded(master_bytes, st.critic,
                                                                                            st.critic_experts))
                                   if a.uses_critic else 0, **ctx, "vLLM share (must be free)": vllm_share})
        update = Phase("update peak", {**states, "reference model": 0 if m.ref_offload else ref,
                                       "activations": acts, "log-prob head": head, "vLLM asleep": asleep, **ctx})
        if wake == "staged":  # empty the cache, wake weights, sync, empty the cache, wake the KV cache
            resident = {"actor weights": 0 if m.param_offload else weights,
                        "gradient buffer (fp32)": 0 if m.grad_offload else grads,
                        "optimizer shard": 0 if m.optimizer_offload else opt,
                        "reference model": 0 if m.ref_offload else ref,
                        "critic (weights+grads+optimizer)": (0 if m.param_offload else c_w)
                        + (0 if m.grad_offload else c_g) + (0 if m.optimizer_offload else c_o)}
            sync = Phase("weight sync", {**resident, "actor weights": weights, "vLLM weights": vllm_weights,
                                         "sync buckets": sync_extra, "vLLM asleep": VLLM_OUTSIDE_POOLS, **ctx})
            roll = Phase("rollout", {**resident, "vLLM weights": vllm_weights, "vLLM activations": vllm_act,
                                     "vLLM KV cache": max(kv, 0), "vLLM asleep": VLLM_OUTSIDE_POOLS, **ctx})
        else:  # the trainer before issue 19: nothing offloaded, the update's cache kept, everything woken at once
            kept = {**states, "PyTorch cache (update)": acts + head}
            awake = {"vLLM weights": vllm_weights, "vLLM activations": vllm_act, "vLLM KV cache": max(kv, 0),
                     "vLLM asleep": VLLM_OUTSIDE_POOLS, **ctx}
            sync = Phase("weight sync", {**kept, **awake, "sync buckets": sync_extra})
            roll = Phase("rollout", {**kept, **awake})
        if best is None or update.total > best[1][1].total:
            best = (s, [start, update, sync, roll])
    s, phases = best
    st = counts.stages[s]
    host = vllm_weights if (r.sleep_level == 1 and r.sleep_between_steps) else 0  # pinned copy of vLLM's weights
    if wake == "staged":
        host += (st.actor + st.critic * a.uses_critic) * (wb * m.param_offload + 4 * m.grad_offload) \
            + (sharded(opt_bytes, st.actor, st.actor_experts)
               + sharded(opt_bytes, st.critic, st.critic_experts) * a.uses_critic) * m.optimizer_offload \
            + (st.actor * wb if has_ref and m.ref_offload else 0)
    if kv <= 0:
        notes.append(f"vLLM has no room for a KV cache: its share {vllm_share / GiB:.1f} GiB holds weights "
                     f"{vllm_weights / GiB:.1f} GiB + activations {vllm_act / GiB:.1f} GiB; raise "
                     "rollout.gpu_memory_utilization or rollout.engine_tp")
    return Plan(world=world, dp=dp, gpu_bytes=gpu_bytes, stage=s, phases=phases, kv_bytes=kv,
                kv_bytes_per_token=kv_per_token, trajectories_per_engine=per_engine,
                full_length=d.max_prompt_length + r.max_response_length, host_bytes_per_node=host * gpus_per_node,
                sync_buckets=buckets, sync_extra_bytes=sync_extra, notes=notes)


# ----------------------------------------------------------------------------------------------------------------
# The verdict: what would make it fit
# ----------------------------------------------------------------------------------------------------------------
def _with(cfg, overrides: dict):
    """A copy of cfg with {"section.field": value} applied (sections are re-validated by their __post_init__)."""
    sections = {}
    for key, value in overrides.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    return dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **kw) for s, kw in sections.items()})


def candidate_knobs(cfg) -> list[dict]:
    """Config changes that lower the peak, cheapest first (each only where it changes something)."""
    m, p, r, a = cfg.model, cfg.parallel, cfg.rollout, cfg.algo
    knobs = []
    if p.tp > 1 and not p.sequence_parallel:
        knobs.append({"parallel.sequence_parallel": True})
    if (a.use_kl_loss or a.use_kl_in_reward) and not m.ref_offload:
        knobs.append({"model.ref_offload": True})
    if not m.optimizer_offload:
        knobs.append({"model.optimizer_offload": True})
    if not m.grad_offload:
        knobs.append({"model.grad_offload": True})
    if m.recompute != "full":
        knobs.append({"model.recompute": "full"})
    least = cfg.data.max_prompt_length + r.max_response_length
    if cfg.optim.max_tokens_per_micro_batch > least:
        knobs.append({"optim.max_tokens_per_micro_batch": least})
    if not m.param_offload:
        knobs.append({"model.param_offload": True})
    if not p.use_distributed_optimizer:
        knobs.append({"parallel.use_distributed_optimizer": True})
    for util in (0.6, 0.5, 0.4, 0.3):
        if util < r.gpu_memory_utilization:
            knobs.append({"rollout.gpu_memory_utilization": util})
    return knobs


def find_fix(cfg, counts: ModelCounts, **plan_kw) -> Optional[dict]:
    """The first single knob that makes every phase fit, else the knobs together in order up to the first set that
    does; None when nothing in `candidate_knobs` is enough."""
    knobs = candidate_knobs(cfg)
    for knob in knobs:
        if plan_memory(_with(cfg, knob), counts, **plan_kw).fits:
            return knob
    together: dict = {}
    for knob in knobs:
        together.update(knob)
        if plan_memory(_with(cfg, together), counts, **plan_kw).fits:
            return together
    return None


def _gib(n: int) -> str:
    return f"{n / GiB:.1f}" if n else "-"


def summary_row(plan: Plan, cfg, counts: ModelCounts, config_path: str, nodes: int) -> str:
    """One markdown table row (the README's table of the shipped recipes)."""
    phase = {p.name: p.total for p in plan.phases}
    ep = f" (EP {counts.ep})" if counts.ep > 1 else ""
    return (f"| {os.path.basename(config_path)} | {nodes} | {counts.tp}x{counts.pp}x{plan.dp}{ep} | "
            + " | ".join(f"{phase[n] / GiB:.1f}" for n in ("start-up", "update peak", "weight sync", "rollout"))
            + f" | {plan.kv_tokens // 1000}k | {plan.kv_tokens // plan.full_length} of "
            f"{plan.trajectories_per_engine} | {plan.host_bytes_per_node / GiB:.0f} | "
            + ("fits" if plan.fits else "does NOT fit") + " |")


SUMMARY_HEADER = ("| recipe | nodes | TPxPPxDP | start-up | update peak | weight sync | rollout | KV tokens per engine "
                  "| full-length trajectories at once, of per engine | host GiB per node | verdict |\n"
                  "|---|---|---|---|---|---|---|---|---|---|---|")


def render(plan: Plan, cfg, counts: ModelCounts, fix: Optional[dict], wake: str) -> str:
    """The table and the verdict, as printed."""
    r = cfg.rollout
    rows: list[str] = []
    for ph in plan.phases:  # rows in first-seen order; a row that is zero everywhere (no critic) is left out
        rows += [k for k, v in ph.items.items() if k not in rows and any(p.items.get(k) for p in plan.phases)]
    width = max(len(k) for k in rows) + 2
    head = "GiB per GPU".ljust(width) + "".join(ph.name.rjust(13) for ph in plan.phases)
    ep = f" (EP {counts.ep})" if counts.ep > 1 else ""
    out = [f"{cfg.model.path or 'model'}: {counts.hf_params / 1e9:.2f}B params; world {plan.world} = TP {counts.tp} x "
           f"PP {counts.pp} x DP {plan.dp}{ep}; pipeline stage {plan.stage} shown ({_gib(plan.gpu_bytes)} GiB GPUs, "
           f"wake {wake})", head, "-" * len(head)]
    for k in rows:
        out.append(k.ljust(width) + "".join(_gib(ph.items.get(k, 0)).rjust(13) for ph in plan.phases))
    out.append("-" * len(head))
    out.append("total".ljust(width) + "".join(_gib(ph.total).rjust(13) for ph in plan.phases))
    out.append("free".ljust(width) + "".join(f"{(plan.gpu_bytes - ph.total) / GiB:.1f}".rjust(13)
                                             for ph in plan.phases))
    kv_tokens = plan.kv_tokens
    fit_traj = kv_tokens // plan.full_length
    out.append(f"KV cache: {kv_tokens:,} tokens per engine ({plan.kv_bytes_per_token / 1024:.0f} KiB per token, "
               f"engine_tp {r.engine_tp}); {fit_traj} trajectories at the full {plan.full_length} tokens fit at once, "
               f"a step gives each engine {plan.trajectories_per_engine}"
               + ("" if fit_traj >= plan.trajectories_per_engine else
                  " (sessions beyond that wait or are preempted and recomputed by vLLM: slower, not lost)"))
    out.append(f"weight sync: {plan.sync_buckets} buckets of <= {r.sync_bucket_mb} MiB, peak extra "
               f"{plan.sync_extra_bytes / GiB:.2f} GiB; host memory per node: {plan.host_bytes_per_node / GiB:.0f} GiB"
               + (" (sleep_level 1 keeps a pinned copy of vLLM's weights)" if r.sleep_level == 1 else "")
               + " pinned/offloaded")
    out += [f"note: {n}" for n in plan.notes]
    worst = plan.worst
    if plan.kv_bytes <= 0 and worst.total <= plan.gpu_bytes:
        out.append("verdict: does NOT fit; vLLM has no room for its KV cache (note above)")
    elif plan.fits:
        out.append(f"verdict: fits; tightest phase {worst.name} with {(plan.gpu_bytes - worst.total) / GiB:.1f} GiB "
                   "free")
    else:
        short = worst.total - plan.gpu_bytes
        line = f"verdict: does NOT fit; {worst.name} needs {worst.total / GiB:.1f} GiB, {short / GiB:.1f} GiB over"
        if fix:
            line += "; fits with " + " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                                              for k, v in fix.items())
        elif wake == "together":
            line += "; no config knob is enough: wake vLLM staged (empty the cache, weights, sync, KV cache)"
        else:
            line += "; no single config knob is enough: more GPUs or a larger parallel.tp"
        out.append(line)
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------
def load_plan_inputs(config_path: str, overrides: Sequence[str], world: int, model_config: Optional[str]):
    """(cfg, hf config dict): the run config validated for `world` GPUs and the model's config.json; UsageError
    naming what to change. Light: yaml and json only (no torch)."""
    from megatron_searchr1.config import ConfigError, load_config

    try:
        cfg = load_config(config_path, list(overrides))
        cfg.validate(world_size=world, check_files=False)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    path = model_config or os.path.join(cfg.model.path, "config.json")
    if not os.path.isfile(path):
        raise UsageError(f"model config {path!r} does not exist: download model.path={cfg.model.path!r}, or pass "
                         "--model-config FILE (a config.json; tests/models/real_configs/ holds Qwen2.5-3B/7B, "
                         "Qwen3-4B/8B, Qwen3-30B-A3B and Llama-3.1-8B)")
    try:
        with open(path) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"--model-config {path!r} is not a JSON config: {e}") from None
    if not isinstance(hf, dict):
        raise UsageError(f"--model-config {path!r} must hold a JSON object (a config.json)")
    return cfg, hf


def plan_config(cfg, hf: dict, *, nodes: int = 1, gpus_per_node: int = 8, gpu_memory_gib: float = 80.0,
                wake: str = "staged") -> tuple[Plan, ModelCounts, Optional[dict]]:
    """(plan, counts, fix or None) for a validated config and its model's config.json dict."""
    from megatron_searchr1.models.config import check_parallel_sizes
    from megatron_searchr1.models.families import read_dims

    try:
        dims = read_dims(hf)
        check_parallel_sizes(dims, cfg.parallel.tp, cfg.parallel.pp, ep=cfg.parallel.ep,
                             world_size=nodes * gpus_per_node)
    except ValueError as e:
        raise UsageError(f"{e} (parallel.tp / parallel.pp / parallel.ep)") from None
    counts = count_params(dims, cfg.parallel.tp, cfg.parallel.pp, ep=cfg.parallel.ep)
    kw = dict(world=nodes * gpus_per_node, gpu_bytes=int(gpu_memory_gib * GiB), wake=wake, gpus_per_node=gpus_per_node)
    plan = plan_memory(cfg, counts, **kw)
    return plan, counts, None if plan.fits else find_fix(cfg, counts, **kw)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = ArgumentParser(prog="python -m megatron_searchr1.plan", description=__doc__.split("\n\n")[0],
                       epilog="Overrides: dotted KEY=VALUE as for train.py, e.g. parallel.sequence_parallel=true")
    p.add_argument("config", help="run config YAML (examples/*.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted KEY=VALUE overrides")
    p.add_argument("--nodes", type=at_least(1), default=1, help="nodes")
    p.add_argument("--gpus-per-node", type=at_least(1), default=8, help="GPUs per node")
    p.add_argument("--gpu-memory-gib", type=above(0), default=80.0, help="memory of one GPU in GiB")
    p.add_argument("--model-config", default=None,
                   help="the model's config.json (default: <model.path>/config.json)")
    p.add_argument("--wake", choices=WAKE_MODES, default="staged",
                   help="staged: empty PyTorch's cache, wake vLLM's weights, sync, wake the KV cache (the trainer "
                        "after issue 19); together: weights and KV cache at once with the update's cache kept "
                        "(before issue 19)")
    p.add_argument("--summary", action="store_true", help="one markdown table row instead of the table")
    args = p.parse_args(argv)
    if not os.path.isfile(args.config):
        raise UsageError(f"config {args.config!r} does not exist (pass a run config YAML, e.g. "
                         "examples/grpo_qwen2.5-7b.yaml)")
    cfg, hf = load_plan_inputs(args.config, args.overrides, args.nodes * args.gpus_per_node, args.model_config)
    import warnings

    with warnings.catch_warnings():  # Megatron's CPU fallbacks (no Apex, no TE) say nothing about the planned run
        warnings.simplefilter("ignore")
        plan, counts, fix = plan_config(cfg, hf, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                                        gpu_memory_gib=args.gpu_memory_gib, wake=args.wake)
    print(summary_row(plan, cfg, counts, args.config, args.nodes) if args.summary
          else render(plan, cfg, counts, fix, args.wake))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
