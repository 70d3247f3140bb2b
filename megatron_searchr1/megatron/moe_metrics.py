"""Load-balancing metrics of a mixture-of-experts model's training step: the router aux loss and tokens per expert.

    start_moe_step(model)                                           # before the step's forward_backward
    metrics.update(moe_step_metrics(model, num_micro_batches))     # after it; {} for a dense model

The aux loss itself needs nothing here: in training mode each Megatron router attaches its load-balancing loss
(coefficient `moe_aux_loss_coeff` = HF router_aux_loss_coef) to its output with MoEAuxLossAutoScaler, and
Megatron's pipeline schedule scales it by 1/num_micro_batches, so the actor's (or critic's) gradient is that of
loss + coeff * mean over micro-batches (and DP ranks) of the sum over layers of each layer's aux loss. What this
module adds is what was routed, read back for logging:
  moe/load_balancing_loss            the per-layer aux loss (without the coefficient) averaged over MoE layers and
                                     micro-batches, as Megatron's tracker records it (transformers' value per layer
                                     is topk times it: tests/models/test_moe.py)
  moe/load_balancing_loss/layer_{i}  the same, layer i (global index)
  moe/tokens_per_expert/layer_{i}/max, .../min   routed token slots of the busiest / idlest expert over the mean
                                     (1.0 = perfectly balanced), over the whole mini-batch (all DP ranks)
Collectives: the tracker is reduced over PP, TP and DP by Megatron's reduce_aux_losses_tracker_across_ranks; the
token counts are summed over DP (and TP under sequence parallelism, where each TP rank routes its slice of the
tokens) and over PP (each stage counts its own layers).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(global layer index, router) of this stage's MoE layers."""
    decoder = getattr(model, "decoder", None) or getattr(getattr(model, "module", None), "decoder", None)
    return [(int(layer.layer_number) - 1, layer.mlp.router) for layer in getattr(decoder, "layers", ())
            if hasattr(layer.mlp, "router")]


def _count_tokens(router, _inputs, output) -> None:
    """Forward hook: add this call's routed token slots per expert (routing_map (tokens, E), bool) in training."""
    if router.training:
        routing_map = output[1]
        counts = routing_map.sum(dim=0).double().cpu()
        previous = getattr(router, "_searchr1_tokens", None)
        router._searchr1_tokens = counts if previous is None else previous + counts


def start_moe_step(model: torch.nn.Module) -> None:
    """Before a training step: count routed tokens per expert on every router of `model` from zero (the hook is
    installed once) and clear Megatron's aux-loss tracker, so that moe_step_metrics sees this step only."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    for _, router in _routers(model):
        if not getattr(router, "_searchr1_counting", False):
            router.register_forward_hook(_count_tokens)
            router._searchr1_counting = True
        router._searchr1_tokens = None
    clear_aux_losses_tracker()


def moe_step_metrics(model: torch.nn.Module, num_micro_batches: int) -> dict[str, float]:
    """The metrics of the module doc for the training step that just ran, and reset the counters; every rank of the
    model calls it (collectives), each gets the same dict. {} for a dense model."""
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker, reduce_aux_losses_tracker_across_ranks,
    )

    config = getattr(model, "config", None) or getattr(getattr(model, "module", None), "config", None)
    if config is None or not config.num_moe_experts:
        return {}
    out: dict[str, float] = {}
    moe_layers = [i for i, f in enumerate(config.moe_layer_freq) if f] if isinstance(config.moe_layer_freq, list) \
        else list(range(config.num_layers))
    tracker = get_moe_layer_wise_logging_tracker()
    if "load_balancing_loss" in tracker:
        reduce_aux_losses_tracker_across_ranks(["load_balancing_loss"])
        values = tracker["load_balancing_loss"]["values"].double().cpu() / max(num_micro_batches, 1)
        for i in moe_layers:
            out[f"moe/load_balancing_loss/layer_{i}"] = float(values[i])
        out["moe/load_balancing_loss"] = float(values[moe_layers].mean())
        clear_aux_losses_tracker()

    counts = torch.zeros(config.num_layers, config.num_moe_experts, dtype=torch.float64)
    for i, router in _routers(model):
        c = getattr(router, "_searchr1_tokens", None)
        if c is not None:
            counts[i] = c
            router._searchr1_tokens = None
    from megatron_searchr1.collectives import collective_device

    counts = counts.to(collective_device())
    groups = [mpu.get_data_parallel_group()] + ([mpu.get_tensor_model_parallel_group()]
                                                if config.sequence_parallel else [])
    groups.append(mpu.get_pipeline_model_parallel_group())
    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
    counts = counts.cpu()
    for i in moe_layers:
        mean = counts[i].mean()
        if mean > 0:
            out[f"moe/tokens_per_expert/layer_{i}/max"] = float(counts[i].max() / mean)
            out[f"moe/tokens_per_expert/layer_{i}/min"] = float(counts[i].min() / mean)
    return out
