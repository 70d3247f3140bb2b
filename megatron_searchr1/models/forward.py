"""Forward-only passes through Megatron's pipeline schedule: full-vocabulary logits (actor) or values (critic).

    logits = forward_logits(model, input_ids)   # (B, T, V) on the last PP stage, None elsewhere

The call goes through `get_forward_backward_func()` with `forward_only=True`, so the same code runs at any
TP/PP: every rank of the model-parallel group calls it with the same `input_ids`; pipeline stages pass
activations to each other; the last stage returns the result, gathered over TP (every TP rank of the last
stage gets the full tensor). The trainer has its own `forward_step`; this module serves conversion checks,
evaluation and debugging, so it stays small.

Positions: Megatron's RoPE uses positions 0..T-1 for every row (it ignores `position_ids`), so batches must
be right-padded. `attention_mask` (B, T) of 1/0 is accepted to check exactly that; the model itself runs
plain causal attention, which leaves real tokens unaffected by the padding after them. Outputs at
padded positions are meaningless.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The bare model (GPTModel / CriticModel) inside Megatron DDP / Float16Module wrappers (each keeps the next one
    in `.module`). The one copy: checkpoints, weight sync and the model-output readers all unwrap through it."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def check_positions(input_ids: torch.Tensor, position_ids: Optional[torch.Tensor],
                    attention_mask: Optional[torch.Tensor]) -> None:
    """Raise unless the batch is right-padded with positions 0..T-1 (what Megatron's RoPE computes)."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (B, T), got shape {tuple(input_ids.shape)}")
    B, T = input_ids.shape
    if position_ids is not None:
        expected = torch.arange(T, device=position_ids.device).expand(B, T)
        if position_ids.shape != (B, T) or not torch.equal(position_ids.long(), expected):
            raise ValueError("Megatron's RoPE uses positions 0..T-1 in every row: right-pad the batch and "
                             "pass position_ids=None (left padding or packed positions are not supported).")
    if attention_mask is not None:
        if attention_mask.shape != (B, T):
            raise ValueError(f"attention_mask must be (B, T) = {(B, T)}, got {tuple(attention_mask.shape)}")
        m = attention_mask.long()
        # Right padding: along each row the mask never goes from 0 back to 1.
        if bool((m[:, 1:] > m[:, :-1]).any()):
            raise ValueError("attention_mask is not right-padded: Megatron's RoPE needs real tokens at "
                             "positions 0..n-1; move the padding to the end of each row.")


def forward_only(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    call: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    micro_batch_size: Optional[int] = None,
) -> Optional[torch.Tensor]:
    """Run `call(model, ids_micro_batch)` for each micro-batch through the pipeline schedule, no grad.

    Returns the last stage's outputs concatenated along the batch dim, None on other stages.
    """
    B, T = input_ids.shape
    mbs = micro_batch_size or B
    micro_batches = list(input_ids.split(mbs, dim=0))
    if len({mb.shape[0] for mb in micro_batches}) > 1:
        raise ValueError(f"batch size {B} is not a multiple of micro_batch_size {mbs}")
    config = unwrap(model).config
    pad = -T % config.tensor_model_parallel_size if config.sequence_parallel else 0
    if pad:  # sequence parallelism splits the sequence over TP: pad it, cut the outputs back to T (right padding)
        micro_batches = [torch.cat([mb, mb.new_zeros(mb.shape[0], pad)], dim=1) for mb in micro_batches]

    def forward_step(data_iterator, model_chunk):
        ids = next(data_iterator)
        out = call(model_chunk, ids)
        # Non-loss data: the schedule appends what this returns on the last stage (batch-first there).
        return out, lambda output, non_loss_data=True: output[:, :T]

    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=[model],
            num_microbatches=len(micro_batches),
            seq_length=T + pad,
            micro_batch_size=mbs,
            forward_only=True,
            collect_non_loss_data=True,
        )
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return torch.cat(outputs, dim=0)


def forward_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: Optional[torch.Tensor] = None,
    attention_mask: Optional[torch.Tensor] = None,
    micro_batch_size: Optional[int] = None,
    trim_vocab: bool = True,
) -> Optional[torch.Tensor]:
    """Full-vocabulary logits (B, T, V) in the model's dtype on the last PP stage (None on the others).

    V is `model.hf_vocab_size` (set by build_gpt_model: config.json's vocab_size, or the tokenizer's size when the
    model was built with a smaller `tokenizer_vocab_size`): the rows beyond it (Megatron's padding, and a
    checkpoint's own padding past its tokenizer) are cut off unless `trim_vocab=False` (then V is the padded size).
    `input_ids` (B, T) must be on the model's device; see the module doc for positions and padding.
    """
    check_positions(input_ids, position_ids, attention_mask)
    vocab = getattr(unwrap(model), "hf_vocab_size", None) if trim_vocab else None

    def call(m, ids):
        # runtime_gather_output: the output layer all-gathers the vocab shards over TP -> [b, s, V_pad]
        logits = m(ids, None, None, runtime_gather_output=True)
        return logits[..., :vocab] if vocab is not None else logits

    return forward_only(model, input_ids, call, micro_batch_size)


def forward_values(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: Optional[torch.Tensor] = None,
    attention_mask: Optional[torch.Tensor] = None,
    micro_batch_size: Optional[int] = None,
) -> Optional[torch.Tensor]:
    """Critic values (B, T) in fp32 on the last PP stage (None on the others); same batch rules as logits."""
    check_positions(input_ids, position_ids, attention_mask)
    return forward_only(model, input_ids, lambda m, ids: m(ids, None, None), micro_batch_size)
