"""The actor, the frozen reference and the SFT model: build them, and read log-probs (and entropy) per sequence.

    actor = build_actor(hf_config, load_weights=lambda m: load_hf_weights(m, reader, bind_mapping(hf_config, m)),
                        **model_settings(hf_config, tp=1, pp=1, params_dtype=torch.float32))   # models/gpt.py
    optimizer, scheduler = build_optimizer(actor, lr=1e-6, clip_grad=1.0)        # megatron/optimizer.py
    ref = build_reference(hf_config, load_weights=...)
    old_lp = compute_log_probs(actor, seqs, max_tokens_per_micro_batch=8192, temperature=rollout_temperature)
    ref_lp = compute_log_probs(ref, seqs, max_tokens_per_micro_batch=8192, temperature=rollout_temperature)
    metrics = train_step(actor, optimizer, scheduler, mbs, ppo_loss_fn, temperature=..., with_entropy=True)

Log-probs are over the real vocabulary (vocab_parallel.py) and divided by `temperature` first, as the rollout
sampled: pass the rollout's temperature so old log-probs match the engine's.

SFT reuses the same step. Each example becomes a sequence whose "prompt" is its first token and whose
"response" is the rest, so log-probs cover every token after the first; the loss is masked_nll_loss:

    seqs = [sft_sequence(ids, loss_mask) for ids, loss_mask in examples]      # loss_mask per token of ids
    for mini in split_mini_batches(len(seqs), num_steps_per_batch):
        mbs = make_micro_batches([seqs[i] for i in mini], max_tokens_per_micro_batch)
        metrics = train_step(model, optimizer, scheduler, mbs, masked_nll_loss)   # metrics["loss"]: token-mean NLL

(Keeping the real prompt as the prompt works the same way and skips the prompt's log-probs.)
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from megatron.core.distributed import DistributedDataParallel

from megatron_searchr1.megatron.batching import MicroBatch, TrainSequence, make_micro_batches
from megatron_searchr1.megatron.optimizer import wrap_ddp
from megatron_searchr1.models.gpt import build_gpt_model
from megatron_searchr1.workers.schedule import forward_per_sequence

LoadWeights = Optional[Callable[[torch.nn.Module], None]]


def build_actor(hf_config, *, params_dtype: torch.dtype = torch.float32, load_weights: LoadWeights = None,
                use_distributed_optimizer: bool = False, config=None, use_te: Optional[bool] = None
                ) -> DistributedDataParallel:
    """This rank's actor stage, weights loaded by `load_weights(bare_model)` (before DDP and the optimizer copy
    them), wrapped in Megatron DDP. bf16 on GPU: params_dtype=torch.bfloat16 (the optimizer keeps fp32 masters).
    `config`, `use_te`: as models.gpt.model_settings makes them (None: build_gpt_model's defaults)."""
    model = build_gpt_model(hf_config, params_dtype=params_dtype, config=config, use_te=use_te)
    if load_weights is not None:
        load_weights(model)
    return wrap_ddp(model, use_distributed_optimizer=use_distributed_optimizer)


def build_reference(hf_config, *, params_dtype: torch.dtype = torch.float32, load_weights: LoadWeights = None,
                    config=None, use_te: Optional[bool] = None) -> torch.nn.Module:
    """This rank's frozen reference stage: no DDP, no optimizer, no gradients, eval mode."""
    model = build_gpt_model(hf_config, params_dtype=params_dtype, config=config, use_te=use_te)
    if load_weights is not None:
        load_weights(model)
    model.requires_grad_(False)
    return model.eval()


def compute_log_probs(model: torch.nn.Module, seqs: Sequence[TrainSequence], *, max_tokens_per_micro_batch: int,
                      temperature: float = 1.0, with_entropy: bool = False, pad_id: int = 0):
    """Log-probs of each sequence's response tokens: list[Tensor(len(response_ids))] fp32 on the CPU, in input
    order, the same on every rank of the model-parallel group; (log_probs, entropies) with `with_entropy`.

    Every rank of the model-parallel group must pass the same `seqs` (its DP rank's share).
    """
    mbs = make_micro_batches(seqs, max_tokens_per_micro_batch, pad_id=pad_id)
    out = forward_per_sequence(model, mbs, temperature=temperature, with_entropy=with_entropy)
    return (out["log_probs"], out["entropy"]) if with_entropy else out["log_probs"]


def sft_sequence(token_ids, loss_mask) -> TrainSequence:
    """One SFT example as a worker sequence: prompt = the first token, response = the rest (with its mask).

    >>> s = sft_sequence([5, 6, 7], [0, 1, 1]); s.prompt_ids, s.response_ids, s.loss_mask.tolist()
    ([5], [6, 7], [1.0, 1.0])
    """
    ids = [int(t) for t in token_ids]
    mask = torch.as_tensor(loss_mask, dtype=torch.float32).reshape(-1)
    if len(ids) < 2 or mask.numel() != len(ids):
        raise ValueError(f"an SFT example needs >= 2 tokens and one mask value per token (got {len(ids)} tokens, "
                         f"{mask.numel()} mask values)")
    return TrainSequence(prompt_ids=ids[:1], response_ids=ids[1:], loss_mask=mask[1:])


def masked_nll_loss(outputs: dict, mb: MicroBatch) -> tuple[torch.Tensor, dict]:
    """SFT loss_fn: -log p over the loss-mask tokens, this micro-batch's share of the mini-batch token-mean."""
    mask = mb["loss_mask"]  # (b, R)
    nll = -(outputs["log_probs"] * mask).sum()
    return nll / max(mb.global_num_loss_tokens, 1.0), {"nll": nll.detach() / mask.sum().clamp(min=1)}
