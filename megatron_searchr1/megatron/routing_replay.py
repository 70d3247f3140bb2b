"""Routing replay: Megatron's MoE routers take the experts the rollout engine chose for each token.

    enable_routing_replay(model)                       # once, after the model is built (actor, reference)
    with replay_routing(model_chunk, mb.routed_experts):   # in forward_step: (b, T, moe_layers, topk), -1 = own
        output = model_chunk(mb.input_ids, None, None)

The engine records the top-k expert ids of every token it computed (rollout/engines/vllm_routing.py); they travel
with the trajectory (TrainSequence.routed_experts, collated per micro-batch by batching.py) and here each router
selects those experts instead of its own top-k. The gate weights are the router's own scores gathered at the replayed
experts (softmax over them when the model renormalises its top-k, as Qwen3-MoE does), so the router's gradient flows
as usual; only the selection is the engine's. A token whose ids are -1 (the engine never computed it: a trajectory's
last token, padding) is routed by the router itself.

The seam is megatron-core 0.16's: `topk_routing_with_score_function` hands `router.router_replay.get_replay_topk` the
scores and its own top-k function. Megatron's `RouterReplay` class (moe_enable_routing_replay) keeps one global list
of every router built in the process, which would mix the actor's and the reference's routers, and replays whole
micro-batches only; so each router gets its own `_Replay` here (the same method, the same call), set per micro-batch.

Layouts. Megatron routes [s, b] flattened (token s * b + row); with sequence parallelism (required for MoE at TP > 1)
each TP rank routes its contiguous sequence chunk; a pipeline stage holds a slice of the layers and each router knows
its global `layer_number`; expert parallelism dispatches after routing, so each rank replays its own micro-batch.
`replay_targets` does that slicing. Activation recompute (model.recompute=full) routes again in the backward, after
later micro-batches have set their own ids: refused in the config for now.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch


def moe_layer_indices(num_layers: int, moe_layer_freq) -> list[int]:
    """0-based indices of the MoE layers (TransformerConfig.moe_layer_freq: an int N = every N-th layer, or a 0/1
    list), in order: column l of the routed ids belongs to layer moe_layer_indices(...)[l].

    >>> moe_layer_indices(4, 1), moe_layer_indices(4, [0, 1, 1, 0]), moe_layer_indices(4, 2)
    ([0, 1, 2, 3], [1, 2], [0, 2])
    """
    if isinstance(moe_layer_freq, int):
        return [i for i in range(num_layers) if i % moe_layer_freq == 0]
    return [i for i, f in enumerate(moe_layer_freq) if f]


def replay_targets(routed: torch.Tensor, columns: Sequence[int], tp_rank: int = 0, tp_size: int = 1,
                   sequence_parallel: bool = False) -> list[torch.Tensor]:
    """Per router of this rank (`columns`: its column in `routed`), the (tokens, topk) ids in the order it routes.

    routed: (b, T, L, K), T a multiple of tp_size under sequence parallelism. Megatron's router sees [s, b]
    flattened, s = this TP rank's chunk of T under sequence parallelism (all of T otherwise).

    >>> r = torch.arange(2 * 4).view(2, 4, 1, 1)        # row 0: 0..3, row 1: 4..7
    >>> replay_targets(r, [0])[0].flatten().tolist()     # s-major: (s0,b0), (s0,b1), (s1,b0), ...
    [0, 4, 1, 5, 2, 6, 3, 7]
    >>> replay_targets(r, [0], tp_rank=1, tp_size=2, sequence_parallel=True)[0].flatten().tolist()
    [2, 6, 3, 7]
    """
    b, T, L, K = routed.shape
    if sequence_parallel and tp_size > 1:
        if T % tp_size:
            raise ValueError(f"routed ids of {T} positions do not split over {tp_size} sequence-parallel ranks")
        chunk = T // tp_size
        routed = routed[:, tp_rank * chunk:(tp_rank + 1) * chunk]
    flat = routed.transpose(0, 1).reshape(-1, L, K)  # (s * b, L, K)
    return [flat[:, c] for c in columns]


def merge_topk(scores: torch.Tensor, own: torch.Tensor,
               target: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids): `target`'s ids where a token has them (no -1), the router's `own` elsewhere; values are
    `scores` at those ids. scores (N, E), own and target (N, K).

    >>> s = torch.tensor([[0.1, 0.9, 0.5], [0.3, 0.2, 0.7]])
    >>> merge_topk(s, torch.tensor([[1], [2]]), torch.tensor([[0], [-1]]))
    (tensor([[0.1000],
            [0.7000]]), tensor([[0],
            [2]]))
    """
    if target is None:
        return scores.gather(1, own), own
    if target.shape != own.shape:
        raise ValueError(f"replayed ids {tuple(target.shape)} do not match the router's top-k {tuple(own.shape)}: "
                         "the routed ids were made for another micro-batch layout or model")
    target = target.to(own.device, own.dtype)
    ids = torch.where((target >= 0).all(dim=1, keepdim=True), target, own)
    return scores.gather(1, ids), ids


class _Replay:
    """One router's replay: Megatron calls get_replay_topk(scores, topk, ...) in place of its own top-k."""

    def __init__(self, column: int):
        self.column = column
        """This router's column in the routed ids (its MoE layer's order)."""
        self.target: Optional[torch.Tensor] = None
        """(tokens, topk) ids for the current micro-batch, None: route as usual."""
        self.chosen: Optional[torch.Tensor] = None
        """The ids the last forward used (for checks)."""

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.target is not None:
            values, own = merge_topk(scores, own, self.target)
        self.chosen = own.detach()
        return values, own


def _routers(model_chunk) -> list:
    return [m for name, m in model_chunk.named_modules() if name.endswith("mlp.router")]


def enable_routing_replay(model) -> int:
    """Give every MoE router of `model` (a chunk or a DDP-wrapped model) a replay slot; returns how many. Raises on a
    dense model."""
    from megatron_searchr1.models.forward import unwrap

    config = unwrap(model).config
    if not getattr(config, "num_moe_experts", None):
        raise ValueError("routing replay needs a mixture-of-experts model (this one has no experts)")
    if getattr(config, "moe_router_fusion", False):
        raise ValueError("routing replay goes through Megatron's unfused top-k: set moe_router_fusion=False")
    layers = moe_layer_indices(config.num_layers, config.moe_layer_freq)
    routers = _routers(model)
    for r in routers:
        r.router_replay = _Replay(layers.index(int(r.layer_number) - 1))
    return len(routers)


@contextlib.contextmanager
def replay_routing(model_chunk, routed: Optional[torch.Tensor]):
    """While the block runs, this chunk's routers replay `routed` (b, T, L, K) (None: they route themselves; a model
    without enable_routing_replay: nothing happens)."""
    replays = [r.router_replay for r in _routers(model_chunk) if isinstance(getattr(r, "router_replay", None), _Replay)]
    if not replays:
        yield
        return
    if routed is not None:
        from megatron.core import parallel_state as mpu

        from megatron_searchr1.models.forward import unwrap

        config = unwrap(model_chunk).config
        targets = replay_targets(routed, [rp.column for rp in replays], mpu.get_tensor_model_parallel_rank(),
                                 mpu.get_tensor_model_parallel_world_size(), bool(config.sequence_parallel))
        for rp, t in zip(replays, targets):
            rp.target = t
    try:
        yield
    finally:
        for rp in replays:
            rp.target = None


def chosen_experts(model) -> list[torch.Tensor]:
    """The ids each replaying router used in its last forward, in layer order (checks and benchmarks)."""
    replays = [r.router_replay for r in _routers(model) if isinstance(getattr(r, "router_replay", None), _Replay)]
    return [rp.chosen for rp in sorted(replays, key=lambda rp: rp.column)]
