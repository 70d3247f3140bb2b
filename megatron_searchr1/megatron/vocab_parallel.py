"""Log-probs of target tokens and entropy from vocab-parallel logits, over the real vocabulary only.

    logp, ent = vocab_parallel_log_probs(logits, targets, real_vocab_size=model.hf_vocab_size,
                                         temperature=1.0, with_entropy=True)   # (b, s) each, fp32
    logp, ent = vocab_parallel_log_probs(..., with_entropy=True, entropy_grad=False)  # entropy: a detached metric

`logits` is this TP rank's shard [..., V_pad / tp] of the output layer (models built with parallel_output=True):
rank r holds global vocabulary columns [r * V_pad/tp, (r + 1) * V_pad/tp). Megatron pads the vocabulary to a
multiple of 128 x TP, so the padded columns (global index >= real_vocab_size) differ between TP=1 and TP=2;
they are sliced off on the rank that holds them before anything is summed, so no padded column ever enters a
softmax and the result is the same at any TP (tests/megatron/test_vocab_parallel.py checks TP=2 == TP=1 == HF).

The softmax statistics are combined over the TP group with three explicit all-reduces: the max (for stability),
the sum of exp, and the target logit (from the one rank whose shard holds it); the entropy needs a fourth, the
expectation of the logit. Backward (an autograd.Function, so only the softmax and, for entropy, the shifted
logits are saved) writes this shard's gradient; the output layer's own backward then all-reduces the hidden-state
gradient over TP, as for Megatron's vocab-parallel cross-entropy. Every TP rank computes the same loss.

Memory: the saved softmax is one fp32 tensor of the micro-batch's response tokens x V / tp (5 GB for 8k tokens at a
152k vocabulary); an entropy with a gradient saves the shifted logits too, a second one. When the loss does not use
the entropy (entropy_coeff 0), `entropy_grad=False` computes it as a detached metric in the forward, with a batched
dot product that makes no vocabulary-sized temporary, and saves nothing more than the log-probs alone.

With z = logits / temperature restricted to the real vocabulary, p = softmax(z):
    log p(target) = z_t - logsumexp(z),          d/dz_k = 1[k = t] - p_k
    H             = logsumexp(z) - sum_k p_k z_k, d/dz_k = -p_k (z_k - sum_i p_i z_i)
and d/dlogits = d/dz / temperature (padded columns: 0).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, real_vocab_size, temperature, with_entropy, entropy_grad, group):
        local = logits.shape[-1]
        n_real = max(0, min(local, real_vocab_size - vocab_start))  # real columns on this rank (a tail is padding)
        z = logits[..., :n_real].float() / temperature  # (..., n_real), a fresh fp32 tensor
        if n_real > 0:
            m = z.max(dim=-1).values
        else:  # this rank holds padding only
            m = torch.full(logits.shape[:-1], float("-inf"), device=logits.device)
        _all_reduce(m, dist.ReduceOp.MAX, group)
        z -= m.unsqueeze(-1)  # shifted logits, max 0

        # The target logit lives on one rank; the others contribute 0.
        local_t = targets - vocab_start
        here = (local_t >= 0) & (local_t < n_real)
        idx = torch.where(here, local_t, torch.zeros_like(local_t)).unsqueeze(-1)
        z_t = torch.gather(z, -1, idx).squeeze(-1) * here if n_real > 0 else torch.zeros_like(m)
        _all_reduce(z_t, dist.ReduceOp.SUM, group)

        p = z.exp()  # unnormalised until the global sum is known
        sum_exp = p.sum(dim=-1)
        _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
        p /= sum_exp.unsqueeze(-1)
        log_z = sum_exp.log()
        log_probs = z_t - log_z

        entropy = None
        if with_entropy and entropy_grad:
            mean_z = _expected_logit(p, z, group)
            entropy = log_z - mean_z
            ctx.save_for_backward(p, z, mean_z, idx, here)
        else:
            if with_entropy:
                entropy = _entropy_metric(p, z, log_z, group)
                ctx.mark_non_differentiable(entropy)
            ctx.save_for_backward(p, idx, here)
        ctx.with_entropy = with_entropy and entropy_grad
        ctx.temperature = temperature
        ctx.local = local
        ctx.n_real = n_real
        ctx.logits_dtype = logits.dtype
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        if ctx.with_entropy:
            p, z, mean_z, idx, here = ctx.saved_tensors
        else:
            p, idx, here = ctx.saved_tensors
        if grad_logp is None:
            grad_logp = torch.zeros(p.shape[:-1], device=p.device)
        # d log p_t / dz = onehot(t) - p
        grad_z = p * (-grad_logp).unsqueeze(-1)
        if ctx.n_real > 0:
            grad_z.scatter_add_(-1, idx, (grad_logp * here).unsqueeze(-1))
        if ctx.with_entropy and grad_ent is not None:
            # dH/dz = -p (z - E_p[z])
            grad_z -= grad_ent.unsqueeze(-1) * p * (z - mean_z.unsqueeze(-1))
        grad_z /= ctx.temperature
        grad_logits = torch.zeros(*p.shape[:-1], ctx.local, dtype=ctx.logits_dtype, device=p.device)
        grad_logits[..., : ctx.n_real] = grad_z
        return grad_logits, None, None, None, None, None, None, None


def _expected_logit(p: torch.Tensor, z: torch.Tensor, group) -> torch.Tensor:
    """E_p[z] over the whole vocabulary, (...): the entropy's second term when it takes part in the loss (its
    backward then needs z, which the caller saves)."""
    mean_z = (p * z).sum(dim=-1)  # partial over this shard
    _all_reduce(mean_z, dist.ReduceOp.SUM, group)
    return mean_z


@torch.no_grad()
def _entropy_metric(p: torch.Tensor, z: torch.Tensor, log_z: torch.Tensor, group) -> torch.Tensor:
    """log Z - E_p[z], (...), as a metric: no gradient, and E_p[z] as a batched dot product (no (..., V) product
    tensor), so reporting entropy costs no vocabulary-sized memory beyond the log-probs' own."""
    mean_z = torch.matmul(p.unsqueeze(-2), z.unsqueeze(-1)).reshape(p.shape[:-1])
    _all_reduce(mean_z, dist.ReduceOp.SUM, group)
    return log_z - mean_z


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    real_vocab_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    group: Optional[dist.ProcessGroup] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(log p(targets), entropy or None), both fp32 of targets' shape, from this rank's vocab shard.

    entropy_grad: the entropy carries a gradient (an entropy bonus in the loss); False: a detached metric that
    saves no extra memory for backward (module doc).

    logits:  (..., V_pad / tp), any float dtype; global column of local column c is tp_rank * V_pad/tp + c
    targets: (...) long, global token ids < real_vocab_size
    group:   the TP group (None or a group of one: no communication, logits hold the whole vocabulary)
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets {tuple(targets.shape)} must match logits {tuple(logits.shape)} without the "
                         "vocab dim")
    rank = dist.get_rank(group) if group is not None and dist.get_world_size(group) > 1 else 0
    vocab_start = rank * logits.shape[-1]
    return _VocabParallelLogProbs.apply(logits, targets.long(), vocab_start, int(real_vocab_size),
                                        float(temperature), bool(with_entropy), bool(entropy_grad), group)
