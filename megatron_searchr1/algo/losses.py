"""PPO losses (verl's names and argument order): the clipped policy loss with dual clip and asymmetric clip
ranges, the clipped value loss, entropy, and the aggregation of a ``(B, T)`` loss matrix to a scalar.

Every token-level quantity is aggregated over ``response_mask`` only: retrieved ``<information>`` tokens (mask 0)
were not chosen by the policy, so they enter neither the policy loss (as in Search-R1), nor the value loss, nor
the entropy (Search-R1 trains its critic and reports entropy over them too). Masked entries are selected away, so
garbage there (a NaN log-prob) cannot leak into a loss.
"""
from __future__ import annotations

import torch

from megatron_searchr1.algo.masked import masked_mean, masked_sum

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    denominator: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce a (B, T) loss matrix to a scalar over the mask-1 tokens.

    - ``token-mean``: sum over all selected tokens / number of selected tokens (long answers weigh more);
    - ``seq-mean-token-sum``: each row's token sum, averaged over rows that have a selected token;
    - ``seq-mean-token-mean``: each row's token mean, averaged over rows that have a selected token;
    - ``seq-mean-token-sum-norm`` (Dr. GRPO): each row's token sum divided by a constant, `loss_scale_factor`
      (the response budget; default the padded width T), averaged over rows that have a selected token. Unlike
      the token mean of a row, the constant does not shrink the weight of each token of a long response.

    `denominator` replaces this batch's own count (tokens for token-mean, rows for the seq-mean modes): pass the
    count of the whole mini-batch so that the losses of its micro-batches add up to the mini-batch's loss. Pass
    `loss_scale_factor` as a constant of the run (max response length): the padded width changes from batch to
    batch. (verl's mode of this name sums the rows instead of averaging them: here it is averaged like the other
    seq-mean modes, so the trainer's per-row micro-batch weighting stays the same for all three.)

    >>> L = torch.tensor([[1., 2., 3.], [4., 0., 0.]]); M = torch.tensor([[1, 1, 1], [1, 0, 0]])
    >>> [round(agg_loss(L, M, mode).item(), 4) for mode in AGG_MODES]  # 10/4, (6+4)/2, (2+4)/2, (6/3+4/3)/2
    [2.5, 5.0, 3.0, 1.6667]
    """
    mask = loss_mask.bool()  # (B, T)
    if loss_agg_mode == "token-mean":
        count = mask.sum() if denominator is None else denominator
        return masked_sum(loss_mat, mask) / torch.as_tensor(count, dtype=loss_mat.dtype).clamp(min=1)
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        reduce_row = masked_mean if loss_agg_mode == "seq-mean-token-mean" else masked_sum
        per_row = reduce_row(loss_mat, mask, axis=-1)  # (B,)
        if loss_agg_mode == "seq-mean-token-sum-norm":
            scale = loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor
            if scale <= 0:
                raise ValueError(f"loss_scale_factor must be > 0 (the max response length), got {scale}")
            per_row = per_row / scale
        has_tokens = mask.any(dim=-1)  # (B,) rows made only of retrieved tokens/padding do not count
        count = has_tokens.sum() if denominator is None else denominator
        return masked_sum(per_row, has_tokens) / torch.as_tensor(count, dtype=loss_mat.dtype).clamp(min=1)
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; choose one of {', '.join(AGG_MODES)}")


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float | None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate; returns ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``, all scalars.

    With ratio ``rho = exp(log_prob - old_log_prob)`` (log-ratio clamped to +-20 for safety), per token::

        loss = max(-A * rho, -A * clip(rho, 1 - cliprange_low, 1 + cliprange_high))
        if A < 0 and clip_ratio_c is not None:  loss = min(loss, -A * clip_ratio_c)      # dual clip

    Low/high ranges default to `cliprange` (a larger high range, "clip-higher", lets unlikely tokens grow).
    The dual clip bounds the loss of a negative-advantage token whose ratio has exploded; ``clip_ratio_c=None``
    turns it off. ``pg_clipfrac``: share of tokens where the clipped term was taken; ``pg_clipfrac_lower``: share
    where the dual clip bound; ``ppo_kl``: mean of ``old_log_prob - log_prob``. All over mask-1 tokens.

    >>> old = torch.zeros(1, 2); new = torch.log(torch.tensor([[1.5, 0.5]])); A = torch.tensor([[1., -1.]])
    >>> pg, frac, _, _ = compute_policy_loss(old, new, A, torch.ones(1, 2), cliprange=0.2)
    >>> round(pg.item(), 4), frac.item()  # token 1: -min(1.5, 1.2)*1 = -1.2; token 2: max(0.5, 0.8) = 0.8
    (-0.2, 1.0)
    """
    low = cliprange if cliprange_low is None else cliprange_low
    high = cliprange if cliprange_high is None else cliprange_high
    if low is None or high is None:
        raise ValueError("compute_policy_loss needs cliprange (or both cliprange_low and cliprange_high)")
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (the dual-clip bound on the ratio), got {clip_ratio_c}; "
                         "pass None to turn the dual clip off")
    mask = response_mask.bool()  # (B, T)
    losses, clipped, dual, log_ratio = ppo_clip_token_losses(old_log_prob, log_prob, advantages, mask, low, high,
                                                             clip_ratio_c)
    pg_loss = agg_loss(losses, mask, loss_agg_mode)
    return pg_loss, masked_mean(clipped.float(), mask), masked_mean(-log_ratio, mask), masked_mean(dual.float(), mask)


def ppo_clip_token_losses(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    low: float,
    high: float,
    clip_ratio_c: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-token clipped surrogate of `compute_policy_loss` before aggregation; returns
    ``(losses, clipped, dual_clipped, log_ratio)``, all (B, T): the loss matrix, where the clipped term was taken,
    where the dual clip bound, and the clamped ``log_prob - old_log_prob``; all 0 / False at mask-0 tokens."""
    mask = mask.bool()  # (B, T)
    # select mask-0 entries away *before* the exp, so that not even their gradients can be NaN
    log_ratio = torch.where(mask, torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0), 0.0)  # (B, T)
    advantages = torch.where(mask, advantages, 0.0)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)

    unclipped = -advantages * ratio  # (B, T)
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)  # (B, T)
    losses = torch.maximum(unclipped, clipped)  # (B, T)
    was_clipped = (clipped > unclipped) & mask  # (B, T)

    if clip_ratio_c is None:
        dual = torch.zeros_like(mask)
    else:
        bound = -advantages * clip_ratio_c  # (B, T) only binds where A < 0
        negative = advantages < 0
        dual = (losses > bound) & negative & mask  # (B, T)
        losses = torch.where(negative, torch.minimum(losses, bound), losses)
    return losses, was_clipped, dual, log_ratio


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss; returns ``(vf_loss, vf_clipfrac)``.

    The new prediction is also evaluated clipped to ``values +- cliprange_value`` (the values at rollout time);
    the larger of the two squared errors counts: ``0.5 * agg(max((v - R)^2, (v_clip - R)^2))``. The critic learns
    only on generated tokens: a value at a retrieved token is never used by GAE, so there is nothing to fit there.

    >>> vf, frac = compute_value_loss(torch.tensor([[2.0]]), torch.tensor([[0.0]]), torch.tensor([[0.0]]),
    ...                               torch.ones(1, 1), cliprange_value=0.5)
    >>> vf.item(), frac.item()  # unclipped (2-0)^2 = 4 wins over clipped (0.5-0)^2: 0.5 * 4
    (2.0, 0.0)
    """
    mask = response_mask.bool()  # (B, T)
    vclipped = values + torch.clamp(vpreds - values, -cliprange_value, cliprange_value)  # (B, T)
    loss_unclipped = torch.where(mask, vpreds - returns, 0.0) ** 2  # (B, T)
    loss_clipped = torch.where(mask, vclipped - returns, 0.0) ** 2  # (B, T)
    vf_loss = 0.5 * agg_loss(torch.maximum(loss_unclipped, loss_clipped), mask, loss_agg_mode)
    vf_clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), mask)
    return vf_loss, vf_clipfrac


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the last axis: ``(..., V) -> (...)``, ``logsumexp(z) - sum(softmax(z) * z)``.

    >>> entropy_from_logits(torch.zeros(1, 4))  # uniform over 4: log 4
    tensor([1.3863])
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def compute_entropy_loss(logits: torch.Tensor, response_mask: torch.Tensor,
                         loss_agg_mode: str = "token-mean") -> torch.Tensor:
    """Mean entropy (B, T, V) -> scalar over the mask-1 tokens (an entropy bonus subtracts it from the loss)."""
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode)
