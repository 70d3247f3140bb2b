"""Forward and forward+backward passes through Megatron's pipeline schedule, and one optimizer step.

    per_seq = forward_per_sequence(model, micro_batches)              # no grad: log-probs / values per sequence
    metrics = train_step(model, optimizer, scheduler, micro_batches, loss_fn)   # one optimizer step

Every call goes through `get_forward_backward_func()`, so the same code runs at any TP/PP: every rank of a
model-parallel group calls it with the same micro-batches (the packing is deterministic, so the same input
gives the same plan); pipeline stages exchange activations, whose shapes may differ per micro-batch
(`variable_seq_lengths`); the last stage computes the outputs (outputs.py) and the loss. Results are then
broadcast from the last stage to the other stages of the pipeline, so every rank returns the same thing.

The loss contract. `loss_fn(outputs, mb) -> (loss, metrics)` receives the response-aligned outputs of
micro-batch `mb` (`{"log_probs", "entropy"?}` or `{"values"}`, each (b, R), 0 past a row's response) and the
micro-batch (fields padded the same way, `mb.response_mask`). It returns this micro-batch's *contribution*
to the mini-batch loss, so that the mini-batch loss is the plain sum over micro-batches and DP ranks:

    token-mean over the mini-batch:  (x * mask).sum() / mb.global_num_loss_tokens
                                  == masked_mean_over_micro_batch(x) * mb.loss_token_weight
    sequence-mean:                   per_seq.sum() / mb.global_num_seqs

`mb.global_num_loss_tokens` counts `mask_key` (default "loss_mask"; the response mask when the field is
absent) over all micro-batches of the mini-batch and all DP ranks (one all-reduce per step).

The arithmetic that makes the gradient that of the mini-batch loss L = sum_{dp ranks d, micro-batches k} l_dk:
Megatron's schedule divides each micro-batch loss by the number of micro-batches M_d of its rank before
backward, and DDP averages gradients over the D DP ranks (scales by 1/D, then sums). So we hand the schedule
l_dk * M_d * D: the gradient after the DP all-reduce is sum_d (1/D) sum_k (1/M_d) M_d D grad(l_dk) = grad(L).
M_d may differ between DP ranks (each rank packs its own share; only the stages of one DP rank share a
schedule): the factor is per rank. Tested: 1 micro-batch == 3 micro-batches, DP=2 == DP=1 on the union.

Expert parallelism (EP > 1) is the exception: every MoE layer of every micro-batch does an all-to-all over the
expert group, which spans DP ranks, so those ranks must run the same number of micro-batches (else the rank that
runs out first waits out the timeout, or pairs its next collective with the other rank's extra micro-batch).
`equal_micro_batch_count` takes the maximum over DP (one all-reduce) and appends empty micro-batches (one row, one
token of prompt and of response) that contribute nothing: their outputs are dropped, their loss is 0 x output
(the backward still runs through every layer, so the backward all-to-alls pair up too), their routers run in eval
mode (no aux loss, no z-loss, not counted in the load-balancing metrics), and the schedule's 1/M of the padded
count M is turned back into this rank's 1/M_d for the loss and the aux loss (`_scaled_for_real_count`). verl takes
the same MAX over DP for its dynamic batch sizes and cuts each rank's sequences into that many micro-batches; here
the packing stays batching.py's (least padding within the token budget) and the shorter ranks get empty ones.
Aux-loss-free balancing (`moe_router_enable_expert_bias`) would still count a padding micro-batch's routed tokens:
Megatron updates that bias whenever gradients are on, in eval mode too (no model here enables it).

Metrics: "loss" is L; each loss_fn metric is averaged with weight mb.loss_token_weight (a token-weighted
mean over the mini-batch); plus "grad_norm" (before clipping, over the whole model), "lr" (the LR this
step used) and "update_successful".
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core import parallel_state as mpu
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_searchr1.collectives import collective_device
from megatron_searchr1.megatron.batching import MicroBatch, make_micro_batches, restore_order
from megatron_searchr1.megatron.moe_metrics import moe_step_metrics, start_moe_step
from megatron_searchr1.megatron.optimizer import current_lr
from megatron_searchr1.megatron.outputs import is_critic, model_outputs, unwrap
from megatron_searchr1.megatron.routing_replay import replay_routing

LossFn = Callable[[dict, MicroBatch], tuple[torch.Tensor, dict]]


def _check_inputs(model: torch.nn.Module, micro_batches: Sequence[MicroBatch]) -> None:
    if not micro_batches:
        raise ValueError("no micro-batches: every rank needs at least one sequence")
    vocab = getattr(unwrap(model), "hf_vocab_size", None)
    if vocab is not None:
        top = max(int(mb.input_ids.max()) for mb in micro_batches)
        if top >= vocab:
            raise ValueError(f"token id {top} is outside the model's vocabulary of {vocab} ids: the sequences were "
                             "tokenized with a different tokenizer than the model's")


def _needs_equal_counts(model) -> bool:
    """Whether DP ranks must run the same number of micro-batches: an MoE model at EP > 1 (module doc)."""
    return (bool(getattr(unwrap(model).config, "num_moe_experts", None))
            and mpu.get_expert_model_parallel_world_size() > 1 and mpu.get_data_parallel_world_size() > 1)


def equal_micro_batch_count(model, micro_batches: Sequence[MicroBatch]) -> list[MicroBatch]:
    """`micro_batches` followed by empty ones up to the largest count over the DP group when the model's expert
    all-to-alls span DP ranks (`_needs_equal_counts`); as given otherwise. Padding micro-batches come last, so
    `micro_batches[:len(given)]` are the real ones. One all-reduce (MAX) on collective_device(), as the schedule's
    other counts: NCCL takes no CPU tensor where a group has no gloo beside it."""
    micro_batches = list(micro_batches)
    if not _needs_equal_counts(model):
        return micro_batches
    count = torch.tensor([len(micro_batches)], dtype=torch.int64, device=collective_device())
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=mpu.get_data_parallel_group())
    missing = int(count) - len(micro_batches)
    if missing > 0:
        # one prompt token and one response token (id 0, in every vocabulary), no loss tokens
        empty = make_micro_batches([{"prompt_ids": [0], "response_ids": [0], "loss_mask": torch.zeros(1)}], 2)[0]
        micro_batches += [empty] * missing
    return micro_batches


@contextlib.contextmanager
def _routers_in_eval(model_chunk, on: bool):
    """A padding micro-batch's forward with every MoE router in eval mode: Megatron attaches the aux and z losses
    (and the metrics count routed tokens) in training mode only, so the padding adds nothing to either. The routing
    itself and its all-to-alls are the same as in training."""
    routers = [m for name, m in model_chunk.named_modules() if name.endswith("mlp.router")] if on else []
    modes = [r.training for r in routers]
    for r in routers:
        r.training = False
    try:
        yield
    finally:
        for r, mode in zip(routers, modes):
            r.training = mode


@contextlib.contextmanager
def _scaled_for_real_count(model, factor: float):
    """Multiply what the schedule's `grad_scale_func` returns by `factor` (M / M_d) while it runs: Megatron scales
    the MoE aux loss by grad_scale_func(1) / M and each loss by grad_scale_func, so a rank with M_d real micro-batches
    padded to M keeps the aux-loss weight 1 / M_d it has without padding, and each loss, which forward_backward
    multiplies by M_d * D, reaches the backward as loss * D."""
    config = unwrap(model).config
    base = config.grad_scale_func
    if factor == 1.0:
        yield
        return
    config.grad_scale_func = (lambda t: t * factor) if base is None else (lambda t: base(t) * factor)
    try:
        yield
    finally:
        config.grad_scale_func = base


def _run_schedule(model, micro_batches: Sequence[MicroBatch], forward_only: bool,
                  post: Callable[[torch.Tensor, MicroBatch], object],
                  post_padding: Callable[[torch.Tensor], object], num_real: Optional[int] = None) -> None:
    """Run the pipeline schedule over `micro_batches`; on the last stage `post(output, mb)` sees the output of each
    of the first `num_real` (default: all) and `post_padding(output)` that of each padding micro-batch after them."""
    device = collective_device()
    num_real = len(micro_batches) if num_real is None else num_real
    config = unwrap(model).config  # sequence parallelism splits the sequence over TP: pad it to a multiple
    multiple = config.tensor_model_parallel_size if config.sequence_parallel else 1
    micro_batches = [(mb.padded_to(multiple), k >= num_real) for k, mb in enumerate(micro_batches)]

    def forward_step(data_iterator, model_chunk):
        mb, padding = next(data_iterator)
        mb = mb.to(device)
        with _routers_in_eval(model_chunk, padding), replay_routing(model_chunk, mb.routed_experts):
            output = mb.run(model_chunk)  # right-padded: RoPE positions 0..T-1, causal (packed: its mask)
        if padding:
            return output, lambda out, non_loss_data=False: post_padding(out)
        return output, lambda out, non_loss_data=False: post(out, mb)

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=max(mb.input_ids.shape[1] for mb, _ in micro_batches),  # shapes travel: variable_seq_lengths
        micro_batch_size=max(mb.input_ids.shape[0] for mb, _ in micro_batches),
        forward_only=forward_only,
        collect_non_loss_data=forward_only,
    )


def _broadcast_from_last_stage(flat: torch.Tensor) -> torch.Tensor:
    """The last pipeline stage's `flat` on every stage of this pipeline (same shape everywhere)."""
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(flat, src=mpu.get_pipeline_model_parallel_last_rank(),
                       group=mpu.get_pipeline_model_parallel_group())
    return flat


def forward_per_sequence(model: torch.nn.Module, micro_batches: Sequence[MicroBatch], *, temperature: float = 1.0,
                         with_entropy: bool = False) -> dict[str, list[torch.Tensor]]:
    """No-grad outputs per sequence, in the order the micro-batches were made from (restore_order), on the CPU.

    {"log_probs": [Tensor(len(response_i))], "entropy": [...]} for an actor/reference model, {"values": [...]}
    for a critic; fp32, the same on every rank of the model-parallel group.
    """
    _check_inputs(model, micro_batches)
    keys = ["values"] if is_critic(model) else ["log_probs"] + (["entropy"] if with_entropy else [])
    per_mb: list[dict[str, torch.Tensor]] = []

    def post(output, mb):
        per_mb.append(model_outputs(model, output, mb, temperature=temperature, with_entropy=with_entropy))
        return None

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            _run_schedule(model, equal_micro_batch_count(model, micro_batches), forward_only=True, post=post,
                          post_padding=lambda out: None, num_real=len(micro_batches))
    finally:
        model.train(was_training)

    # One flat tensor per key: the response tokens of every row, micro-batch by micro-batch. Every stage knows
    # the lengths (same data), so the other stages can receive it.
    lengths = [int(n) for mb in micro_batches for n in mb.response_lens]
    result = {}
    for key in keys:
        if mpu.is_pipeline_last_stage(ignore_virtual=True):
            flat = torch.cat([outs[key][row, : int(n)] for mb, outs in zip(micro_batches, per_mb)
                              for row, n in enumerate(mb.response_lens)]).float().contiguous()
        else:
            flat = torch.empty(sum(lengths), dtype=torch.float32, device=collective_device())
        flat = _broadcast_from_last_stage(flat).cpu()
        rows = list(flat.split(lengths))
        grouped, start = [], 0
        for mb in micro_batches:
            grouped.append(rows[start: start + mb.num_rows])
            start += mb.num_rows
        result[key] = restore_order(grouped, micro_batches)
    return result


def _set_global_counts(micro_batches: Sequence[MicroBatch], mask_key: str) -> None:
    """Fill num_loss_tokens / global_num_loss_tokens / global_num_seqs (one all-reduce over DP)."""
    local = []
    for mb in micro_batches:
        mask = mb.fields.get(mask_key, mb.response_mask)
        local.append(float((mask.float() * mb.response_mask).sum()))
    totals = torch.tensor([sum(local), float(sum(mb.num_rows for mb in micro_batches))], dtype=torch.float64,
                          device=collective_device())
    if mpu.get_data_parallel_world_size() > 1:
        dist.all_reduce(totals, group=mpu.get_data_parallel_group())
    for mb, n in zip(micro_batches, local):
        mb.num_loss_tokens = n
        mb.global_num_loss_tokens = float(totals[0])
        mb.global_num_seqs = int(totals[1])


def forward_backward(model: torch.nn.Module, micro_batches: Sequence[MicroBatch], loss_fn: LossFn, *,
                     temperature: float = 1.0, with_entropy: bool = False, entropy_grad: bool = True,
                     mask_key: str = "loss_mask") -> dict[str, float]:
    """Accumulate the gradient of the mini-batch loss (module doc) into the DDP buffers, all-reduced over DP.

    `entropy_grad=False`: outputs["entropy"] is a detached metric (the loss does not use it: entropy_coeff 0), so
    the backward keeps no second vocabulary-sized tensor (megatron/vocab_parallel.py).

    Does not zero gradients or step the optimizer (train_step does). Returns the loss metrics (same on every
    rank of the model-parallel group and across DP).
    """
    _check_inputs(model, micro_batches)
    _set_global_counts(micro_batches, mask_key)
    M = len(micro_batches)  # this rank's real micro-batches; the schedule may run more (equal_micro_batch_count)
    D = mpu.get_data_parallel_world_size()
    scheduled = equal_micro_batch_count(model, micro_batches)
    records: list[tuple[float, torch.Tensor, dict]] = []

    def post(output, mb):
        loss, metrics = loss_fn(model_outputs(model, output, mb, temperature=temperature,
                                              with_entropy=with_entropy, entropy_grad=entropy_grad), mb)
        records.append((mb.loss_token_weight, loss.detach(), {k: torch.as_tensor(v).detach().float()
                                                              for k, v in metrics.items()}))
        # The schedule divides by M before backward and DDP averages over D: undo both (module doc); with
        # padding the schedule divides by len(scheduled), and _scaled_for_real_count multiplies by len(scheduled)/M.
        return loss * (M * D), {}

    def post_padding(output):
        # zero loss, zero gradient, but a backward through every layer (its collectives pair with the other ranks')
        return output.float().sum() * 0.0, {}

    model.train()
    with _scaled_for_real_count(model, len(scheduled) / M):
        _run_schedule(model, scheduled, forward_only=False, post=post, post_padding=post_padding, num_real=M)

    # Sum the weighted metrics over micro-batches and DP ranks on the last stage, then share with the others.
    summary: Optional[dict[str, float]] = None
    if mpu.is_pipeline_last_stage(ignore_virtual=True):
        names = sorted(records[0][2])
        sums = torch.zeros(1 + len(names), dtype=torch.float64, device=collective_device())
        for weight, loss, metrics in records:
            sums[0] += loss.double()
            for j, name in enumerate(names):
                sums[1 + j] += weight * metrics[name].double()
        if D > 1:
            dist.all_reduce(sums, group=mpu.get_data_parallel_group())
        summary = {"loss": float(sums[0]), **{name: float(sums[1 + j]) for j, name in enumerate(names)}}
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        box = [summary]
        dist.broadcast_object_list(box, src=mpu.get_pipeline_model_parallel_last_rank(),
                                   group=mpu.get_pipeline_model_parallel_group())
        summary = box[0]
    return summary


def train_step(model: torch.nn.Module, optimizer, scheduler, micro_batches: Sequence[MicroBatch], loss_fn: LossFn,
               *, temperature: float = 1.0, with_entropy: bool = False, entropy_grad: bool = True,
               mask_key: str = "loss_mask") -> dict[str, float]:
    """One optimizer step on one mini-batch: zero grads, forward_backward, clip + step, scheduler.step(1).

    `scheduler=None` leaves the LR schedule to the caller (e.g. one scheduler step per RL step, as verl does).
    Returns forward_backward's metrics plus grad_norm (pre-clip), lr (used by this step), update_successful, and
    for an MoE model the load-balancing metrics (megatron/moe_metrics.py; the aux loss is in the gradient already).
    """
    model.zero_grad_buffer()
    optimizer.zero_grad()
    start_moe_step(unwrap(model))
    metrics = forward_backward(model, micro_batches, loss_fn, temperature=temperature, with_entropy=with_entropy,
                               entropy_grad=entropy_grad, mask_key=mask_key)
    metrics.update(moe_step_metrics(unwrap(model), len(micro_batches)))  # MoE: aux loss, tokens per expert
    lr = current_lr(optimizer)
    ok, grad_norm, _ = optimizer.step()
    if ok and scheduler is not None:
        scheduler.step(1)
    metrics.update(grad_norm=float("nan") if grad_norm is None else float(grad_norm), lr=lr,
                   update_successful=float(bool(ok)))
    return metrics
