"""The critic: build it and read its values per response token.

    critic = build_critic(hf_config, load_weights=lambda m: load_hf_weights(m, reader, bind_mapping(hf_config, m)))
    optimizer, scheduler = build_optimizer(critic, lr=1e-5)                       # megatron/optimizer.py
    values = compute_values(critic, seqs, max_tokens_per_micro_batch=8192)       # list[Tensor(len(response))]
    metrics = train_step(critic, optimizer, scheduler, mbs, value_loss_fn)       # outputs["values"] (b, R)

Alignment: the value of response token j is the critic's output at position prompt_len + j - 1, the state
just before token j is generated (verl's values[:, prompt_len - 1 : -1]); GAE then uses values[j + 1] as the
next state's value. The value head (critic.py in models) starts at zero, loaded trunks keep the actor's weights.
"""
from __future__ import annotations

from typing import Sequence

import torch

from megatron.core.distributed import DistributedDataParallel

from megatron_searchr1.megatron.batching import TrainSequence, make_micro_batches
from megatron_searchr1.megatron.optimizer import wrap_ddp
from megatron_searchr1.models.critic import build_critic_model
from megatron_searchr1.workers.actor import LoadWeights
from megatron_searchr1.workers.schedule import forward_per_sequence


def build_critic(hf_config, *, params_dtype: torch.dtype = torch.float32, load_weights: LoadWeights = None,
                 use_distributed_optimizer: bool = False, config=None, use_te=None) -> DistributedDataParallel:
    """This rank's critic stage, trunk weights loaded by `load_weights(bare_model)`, wrapped in Megatron DDP."""
    model = build_critic_model(hf_config, params_dtype=params_dtype, config=config, use_te=use_te)
    if load_weights is not None:
        load_weights(model)
    return wrap_ddp(model, use_distributed_optimizer=use_distributed_optimizer)


def compute_values(critic: torch.nn.Module, seqs: Sequence[TrainSequence], *, max_tokens_per_micro_batch: int,
                   pad_id: int = 0) -> list[torch.Tensor]:
    """Critic values per response token: list[Tensor(len(response_ids))] fp32 on the CPU, in input order, the
    same on every rank of the model-parallel group (which must all pass the same `seqs`)."""
    mbs = make_micro_batches(seqs, max_tokens_per_micro_batch, pad_id=pad_id)
    return forward_per_sequence(critic, mbs)["values"]
