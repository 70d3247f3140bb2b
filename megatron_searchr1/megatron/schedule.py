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

Metrics: "loss" is L; each loss_fn metric is averaged with weight mb.loss_token_weight (a token-weighted
mean over the mini-batch); plus "grad_norm" (before clipping, over the whole model), "lr" (the LR this
step used) and "update_successful".
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core import parallel_state as mpu
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_searchr1.collectives import collective_device
from megatron_searchr1.megatron.batching import MicroBatch, restore_order
from megatron_searchr1.megatron.moe_metrics import moe_step_metrics, start_moe_step
from megatron_searchr1.megatron.optimizer import current_lr
from megatron_searchr1.megatron.outputs import is_critic, model_outputs, unwrap

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


def _run_schedule(model, micro_batches: Sequence[MicroBatch], forward_only: bool,
                  post: Callable[[torch.Tensor, MicroBatch], object]) -> None:
    """Run the pipeline schedule over `micro_batches`; on the last stage `post(output, mb)` sees each output."""
    device = collective_device()
    config = unwrap(model).config  # sequence parallelism splits the sequence over TP: pad it to a multiple
    micro_batches = [mb.padded_to(config.tensor_model_parallel_size if config.sequence_parallel else 1)
                     for mb in micro_batches]

    def forward_step(data_iterator, model_chunk):
        mb = next(data_iterator).to(device)
        output = model_chunk(mb.input_ids, None, None)  # right-padded: RoPE positions 0..T-1, causal attention
        return output, lambda out, non_loss_data=False: post(out, mb)

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=max(mb.input_ids.shape[1] for mb in micro_batches),  # shapes travel with variable_seq_lengths
        micro_batch_size=max(mb.num_rows for mb in micro_batches),
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
            _run_schedule(model, micro_batches, forward_only=True, post=post)
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
    M = len(micro_batches)
    D = mpu.get_data_parallel_world_size()
    records: list[tuple[float, torch.Tensor, dict]] = []

    def post(output, mb):
        loss, metrics = loss_fn(model_outputs(model, output, mb, temperature=temperature,
                                              with_entropy=with_entropy, entropy_grad=entropy_grad), mb)
        records.append((mb.loss_token_weight, loss.detach(), {k: torch.as_tensor(v).detach().float()
                                                              for k, v in metrics.items()}))
        # The schedule divides by M before backward and DDP averages over D: undo both (module doc).
        return loss * (M * D), {}

    model.train()
    _run_schedule(model, micro_batches, forward_only=False, post=post)

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
