"""Parameter counts of the model the trainer builds, per pipeline stage and rank, from the model built on the meta
device, and the weight sync's buckets: the inputs of the memory planner (planner/memory.py).

Every stage of the actor and the critic is built by the project's own builder pieces (`gpt_model_kwargs`,
`CriticModel`) on the meta device: no weights, no GPU, any family models/families/ supports. Tensor-parallel shards
follow each parameter's split rule (`families.tp_split`, the rule the converter loads shards with): Megatron's
layers read their TP size from a real process group, so a meta build at TP > 1 is not possible in one process.
Building a stage needs Megatron's parallel state: `meta_world()` starts a world of one process (gloo on loopback)
when none is running and tears it down again, and the pipeline rank/size overrides are set per stage.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence


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
    """Expert-parallel size (parallel.ep)."""
    etp: int = 0
    """Expert-tensor-parallel size (0: Megatron's default, tp)."""

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp


def read_dims_of(hf_config):
    """The model's families.ModelDims from a config.json dict (or a transformers config)."""
    from megatron_searchr1.models.families import read_dims

    return read_dims(hf_config)


@contextlib.contextmanager
def meta_world() -> Iterator[None]:
    """Megatron's parallel state for building meta stages: the running one, else a world of one process started
    here and torn down on exit (only what was started here: a process group that was already up stays up)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_searchr1.megatron.initialize import destroy_megatron, initialize_megatron

    if ps.model_parallel_is_initialized():
        yield
        return
    had_group = dist.is_initialized()
    # gloo on the CPU; where CUDA works (a GPU login node) the project's default (a world of one on one GPU)
    initialize_megatron(tp=1, pp=1, device=None if torch.cuda.is_available() else "cpu")
    try:
        yield
    finally:
        if had_group:
            ps.destroy_model_parallel()
        else:
            destroy_megatron()


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


def stage_param_numel(model, dims, tp: int, ep: int = 1, etp: Optional[int] = None) -> tuple[int, int]:
    """(all, routed experts): one rank's parameter counts of a meta stage built by `build_meta_stage` (at EP = 1,
    every expert) at TP = `tp`, EP = `ep` and expert-TP = `etp` (None: Megatron's default, tp): a rank holds E/ep
    experts, each at 1/etp of its width, and the attention, norms, router and shared expert at its TP alone."""
    from megatron_searchr1.models.families import is_expert_param
    from megatron_searchr1.rollout.weight_sync import global_param_names

    dense = experts = 0
    for _, g, p in global_param_names(model):
        expert = is_expert_param(g)
        n = shard_numel(g, p.shape, dims, (etp or tp) if expert else tp)
        if expert:
            experts += n
        else:
            dense += n
    dense += sum(p.numel() for n, p in model.named_parameters() if n.startswith("value_head."))
    if experts % ep:
        raise ValueError(f"EP={ep} does not split the {experts} expert parameters evenly (parallel.ep)")
    return dense + experts // ep, experts // ep


def count_params(dims, tp: int, pp: int, last_stage_layers: Optional[int] = None, ep: int = 1,
                 etp: Optional[int] = None) -> ModelCounts:
    """ModelCounts for `dims` at (tp, pp, ep, expert-TP `etp`, None: tp): every stage of the actor and the critic
    built on the meta device (`last_stage_layers`: an uneven split, Megatron's num_layers_in_last_pipeline_stage).
    The stages are built at EP = 1 (a world of one has no expert groups), the experts divided by `ep` and sharded
    over `etp` (`stage_param_numel`)."""
    from megatron_searchr1.models.families import mapping_for, stage_layer_counts, tp_kind

    layers = stage_layer_counts(dims.num_layers, pp, None, last_stage_layers)
    stages = []
    with meta_world():
        for s in range(pp):
            actor, actor_e = stage_param_numel(build_meta_stage(dims, pp, s, last_stage_layers=last_stage_layers),
                                               dims, tp, ep, etp)
            critic, critic_e = stage_param_numel(
                build_meta_stage(dims, pp, s, critic=True, last_stage_layers=last_stage_layers), dims, tp, ep, etp)
            stages.append(StageCounts(actor, critic, layers[s], s == 0, s == pp - 1, actor_e, critic_e))
    mapping = mapping_for(dims)
    hf_params = hf_replicated = 0
    for name in mapping.megatron_names():
        n = math.prod(mapping.megatron_shape(name))
        if tp_kind(name) == "vocab":
            n = n // dims.padded_vocab_size * dims.vocab_size
        hf_params += n
        hf_replicated += n if tp_kind(name) == "replicated" else 0
    return ModelCounts(dims, tp, pp, tuple(stages), hf_params, hf_replicated, ep,
                       0 if etp in (None, tp) else etp)


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
    from megatron_searchr1.rollout.buckets import aligned, plan_buckets

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
