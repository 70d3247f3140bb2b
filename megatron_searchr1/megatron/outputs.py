"""What a model stage's output means for one micro-batch: response log-probs (actor) or response values (critic).

    outs = model_outputs(model, output, mb, temperature=1.0, with_entropy=True)
    outs["log_probs"], outs["entropy"]       # (b, R) fp32, actor / reference / SFT model
    outs["values"]                           # (b, R) fp32, critic

Both read the model at the positions that *predict* the response tokens: response token j of row i is
predicted from position prompt_len_i + j - 1 (`MicroBatch.response_positions`). For the critic that is
verl's alignment, values[:, prompt_len - 1 : -1]: the value of the state in which token j is about to be
generated. Entries past a row's response length are 0. Called on the last pipeline stage only.
"""
from __future__ import annotations

import torch

from megatron.core import parallel_state

from megatron_searchr1.megatron.batching import MicroBatch
from megatron_searchr1.megatron.vocab_parallel import vocab_parallel_log_probs
from megatron_searchr1.models.forward import unwrap


def is_critic(model: torch.nn.Module) -> bool:
    from megatron_searchr1.models.critic import CriticModel

    return isinstance(unwrap(model), CriticModel)


def _at_response_positions(x: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """x (b, T, ...) -> (b, R, ...): x[i, prompt_len_i - 1 + j] (a copy; backward scatters into x's gradient)."""
    return x[mb.response_rows(), mb.response_positions()]  # rows, positions: (b, R)


def response_log_probs(logits: torch.Tensor, mb: MicroBatch, *, real_vocab_size: int, temperature: float = 1.0,
                       with_entropy: bool = False, entropy_grad: bool = True) -> dict[str, torch.Tensor]:
    """logits (b, T, V_pad/tp), this TP rank's vocab shard -> {"log_probs": (b, R)[, "entropy": (b, R)]}; the entropy
    is detached (a metric, no extra memory for backward) unless `entropy_grad`."""
    shard = _at_response_positions(logits, mb)  # (b, R, V_pad/tp)
    logp, ent = vocab_parallel_log_probs(shard, mb.response_targets(), real_vocab_size=real_vocab_size,
                                         temperature=temperature, with_entropy=with_entropy,
                                         entropy_grad=entropy_grad,
                                         group=parallel_state.get_tensor_model_parallel_group())
    out = {"log_probs": logp * mb.response_mask}
    if with_entropy:
        out["entropy"] = ent * mb.response_mask
    return out


def response_values(values: torch.Tensor, mb: MicroBatch) -> dict[str, torch.Tensor]:
    """Critic values (b, T) -> {"values": (b, R)}, the value at the position predicting each response token."""
    return {"values": _at_response_positions(values, mb) * mb.response_mask}


def model_outputs(model: torch.nn.Module, output: torch.Tensor, mb: MicroBatch, *, temperature: float = 1.0,
                  with_entropy: bool = False, entropy_grad: bool = True) -> dict[str, torch.Tensor]:
    """The last stage's `output` for `mb` as response-aligned tensors: values for a critic, log-probs otherwise."""
    if is_critic(model):
        return response_values(output, mb)
    return response_log_probs(output, mb, real_vocab_size=unwrap(model).hf_vocab_size, temperature=temperature,
                              with_entropy=with_entropy, entropy_grad=entropy_grad)
