"""Policy losses chosen by name (``algo.policy_loss``): PPO's token-level clip, GSPO's sequence-level clip, and
CISPO's clipped, detached importance weight. Each returns ``(loss, metrics)``.

All three share one signature, so the trainer picks one with `policy_loss` and nothing else changes:
``(old_log_prob, log_prob, advantages, response_mask, *, clip_ratio_low, clip_ratio_high, ...)``, tensors
(B, T) over the response. Only mask-1 tokens count (retrieved ``<information>`` text and padding are selected
away), including in GSPO's per-sequence ratio: a response's length there is its number of *generated* tokens.

`rollout_is_weights` (B, T), detached, multiplies each token's loss: the truncated importance weights of
``rollout_correction`` (behaviour policy -> proximal policy), 1 where nothing is corrected. `denominator` and
`loss_scale_factor` are passed to ``agg_loss`` unchanged.

Metrics are detached 0-dim tensors: ``pg_clipfrac`` (share of mask-1 tokens whose clipped term was taken or
whose weight was clipped), ``pg_clipfrac_lower`` (PPO's dual clip; 0 for the others), ``ppo_kl`` (mean of
``old_log_prob - log_prob``), and ``ratio_mean`` / ``ratio_min`` / ``ratio_max`` (per token; per sequence for
GSPO, whose ratio is one number per sequence).
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_searchr1.algo.losses import agg_loss, ppo_clip_token_losses
from megatron_searchr1.algo.masked import masked_mean

POLICY_LOSSES = ("ppo", "gspo", "cispo")

_SAFETY = 20.0  # log-ratios are clamped to +-20 before an exp, as in losses.compute_policy_loss


def ratio_stats(ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """``ratio_mean`` / ``ratio_min`` / ``ratio_max`` of the selected entries, detached; all 0 when nothing is
    selected (a micro-batch of dropped trajectories).

    >>> {k: v.item() for k, v in ratio_stats(torch.tensor([0.5, 2.0, 9.0]), torch.tensor([1, 1, 0])).items()}
    {'ratio_mean': 1.25, 'ratio_min': 0.5, 'ratio_max': 2.0}
    """
    r, m = ratio.detach(), mask.bool()
    if not m.any():
        zero = torch.zeros((), dtype=r.dtype, device=r.device)
        return {"ratio_mean": zero, "ratio_min": zero, "ratio_max": zero}
    return {"ratio_mean": masked_mean(r, m), "ratio_min": r[m].min(), "ratio_max": r[m].max()}


def _weighted(losses: torch.Tensor, rollout_is_weights: Optional[torch.Tensor]) -> torch.Tensor:
    return losses if rollout_is_weights is None else losses * rollout_is_weights.detach()


def compute_policy_loss_ppo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: Optional[float] = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: Optional[torch.Tensor] = None,
    denominator: float | torch.Tensor | None = None,
    loss_scale_factor: Optional[float] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate per token (the same numbers as ``losses.compute_policy_loss``), with the dual
    clip at `clip_ratio_c` (None: off) and optional rollout-correction weights.

    >>> old = torch.zeros(1, 2); new = torch.log(torch.tensor([[1.5, 0.5]])); A = torch.tensor([[1., -1.]])
    >>> loss, m = compute_policy_loss_ppo(old, new, A, torch.ones(1, 2))
    >>> round(loss.item(), 4), m["pg_clipfrac"].item()  # (-min(1.5, 1.2) + max(0.5, 0.8)) / 2
    (-0.2, 1.0)
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (the dual-clip bound on the ratio), got {clip_ratio_c}; "
                         "pass None to turn the dual clip off")
    mask = response_mask.bool()  # (B, T)
    losses, clipped, dual, log_ratio = ppo_clip_token_losses(old_log_prob, log_prob, advantages, mask,
                                                             clip_ratio_low, clip_ratio_high, clip_ratio_c)
    loss = agg_loss(_weighted(losses, rollout_is_weights), mask, loss_agg_mode, denominator=denominator,
                    loss_scale_factor=loss_scale_factor)
    metrics = {"pg_clipfrac": masked_mean(clipped.float(), mask), "pg_clipfrac_lower": masked_mean(dual.float(), mask),
               "ppo_kl": masked_mean(-log_ratio, mask).detach(), **ratio_stats(torch.exp(log_ratio), mask)}
    return loss, metrics


def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    clip_ratio_c: Optional[float] = None,
    loss_agg_mode: str = "seq-mean-token-mean",
    rollout_is_weights: Optional[torch.Tensor] = None,
    denominator: float | torch.Tensor | None = None,
    loss_scale_factor: Optional[float] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): one importance ratio per sequence, clipped in sequence space.

    For response i with generated tokens G_i (mask 1)::

        s_i   = exp(mean_{t in G_i} (log_prob_t - old_log_prob_t))          # the length-normalised ratio
        s_i,t = sg[s_i] * exp(log_prob_t - sg[log_prob_t])                  # value s_i, gradient s_i * dlogp_t
        loss  = max(-A * s_i,t, -A * clip(s_i,t, 1 - clip_ratio_low, 1 + clip_ratio_high))

    so every token of a sequence shares one ratio and one clip decision, and a clipped sequence passes no
    gradient. The clip ranges are those of a sequence-level ratio, far smaller than PPO's (the paper uses 3e-4
    and 4e-4). There is no dual clip (`clip_ratio_c` must be None; it is accepted so that all losses share one
    signature). Aggregated seq-mean-token-mean by default, as the paper does.

    >>> old = torch.zeros(2, 2); m = torch.tensor([[1, 1], [1, 0]]); A = torch.tensor([[1., 1.], [-1., -1.]])
    >>> new = torch.tensor([[0.1, -0.1], [0.0, 5.0]])  # row 0: mean 0 -> s = 1; row 1: mean 0 (5.0 is masked)
    >>> loss, metrics = compute_policy_loss_gspo(old, new, A, m)
    >>> loss.item(), metrics["ratio_max"].item()  # (-1 * 1 + 1 * 1) / 2
    (0.0, 1.0)
    """
    if clip_ratio_c is not None:
        raise ValueError("GSPO has no dual clip: leave clip_ratio_c at None")
    mask = response_mask.bool()  # (B, T)
    log_prob = torch.where(mask, log_prob, 0.0)  # (B, T) NaN-free where mask 0, also its gradient
    log_ratio = torch.where(mask, log_prob - old_log_prob, 0.0)  # (B, T)
    seq_log_ratio = torch.clamp(masked_mean(log_ratio, mask, axis=-1), -_SAFETY, _SAFETY)  # (B,)
    # value log s_i at every token, gradient d log_prob_t: the sequence ratio's stop-gradient form
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)  # (B, T)
    ratio = torch.exp(token_log_ratio)  # (B, T)
    advantages = torch.where(mask, advantages, 0.0)  # (B, T)
    unclipped = -advantages * ratio  # (B, T)
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)  # (B, T)
    losses = torch.maximum(unclipped, clipped)  # (B, T)
    loss = agg_loss(_weighted(losses, rollout_is_weights), mask, loss_agg_mode, denominator=denominator,
                    loss_scale_factor=loss_scale_factor)
    zero = torch.zeros((), dtype=losses.dtype, device=losses.device)
    metrics = {"pg_clipfrac": masked_mean((clipped > unclipped).float(), mask), "pg_clipfrac_lower": zero,
               "ppo_kl": masked_mean(-log_ratio, mask).detach(),
               **ratio_stats(torch.exp(seq_log_ratio), mask.any(dim=-1))}
    return loss, metrics


def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: Optional[float] = None,
    clip_ratio_high: float,
    clip_ratio_c: Optional[float] = None,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: Optional[torch.Tensor] = None,
    denominator: float | torch.Tensor | None = None,
    loss_scale_factor: Optional[float] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): clip the importance weight, not the update. Per token::

        w    = sg[clip(exp(log_prob - old_log_prob), 1 - clip_ratio_low, 1 + clip_ratio_high)]
        loss = -w * A * log_prob

    The weight is detached, so its gradient is ``-w * A * dlog_prob``: a token whose ratio left the range still
    contributes (with a bounded weight) instead of being dropped as PPO's clip drops it, which keeps the rare
    tokens that open a new line of reasoning in the update. MiniMax bounds only the top (`clip_ratio_low=None`:
    no lower bound). No dual clip (`clip_ratio_c` must be None).

    >>> old = torch.zeros(1, 2); new = torch.log(torch.tensor([[2.0, 0.5]])); A = torch.ones(1, 2)
    >>> loss, m = compute_policy_loss_cispo(old, new, A, torch.ones(1, 2), clip_ratio_high=0.2)
    >>> round(loss.item(), 4), m["pg_clipfrac"].item()  # w = (1.2, 0.5): -(1.2 ln 2 + 0.5 ln .5) / 2
    (-0.2426, 0.5)
    """
    if clip_ratio_c is not None:
        raise ValueError("CISPO has no dual clip: leave clip_ratio_c at None")
    mask = response_mask.bool()  # (B, T)
    log_prob = torch.where(mask, log_prob, 0.0)  # (B, T)
    log_ratio = torch.where(mask, torch.clamp(log_prob - old_log_prob, -_SAFETY, _SAFETY), 0.0)  # (B, T)
    ratio = torch.exp(log_ratio).detach()  # (B, T)
    low = None if clip_ratio_low is None else 1.0 - clip_ratio_low
    weight = torch.clamp(ratio, min=low, max=1.0 + clip_ratio_high)  # (B, T) detached
    losses = -weight * torch.where(mask, advantages, 0.0) * log_prob  # (B, T)
    loss = agg_loss(_weighted(losses, rollout_is_weights), mask, loss_agg_mode, denominator=denominator,
                    loss_scale_factor=loss_scale_factor)
    zero = torch.zeros((), dtype=losses.dtype, device=losses.device)
    metrics = {"pg_clipfrac": masked_mean((weight != ratio).float(), mask), "pg_clipfrac_lower": zero,
               "ppo_kl": masked_mean(-log_ratio, mask).detach(), **ratio_stats(ratio, mask)}
    return loss, metrics


_LOSSES = {"ppo": compute_policy_loss_ppo, "gspo": compute_policy_loss_gspo, "cispo": compute_policy_loss_cispo}


def policy_loss_fn(name: str):
    """The policy loss called `name` (one of ``POLICY_LOSSES``).

    >>> policy_loss_fn("gspo").__name__
    'compute_policy_loss_gspo'
    """
    if name not in _LOSSES:
        raise ValueError(f"unknown policy_loss {name!r}; choose one of {', '.join(POLICY_LOSSES)}")
    return _LOSSES[name]
