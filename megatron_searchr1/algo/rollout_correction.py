"""Rollout correction (``algo.rollout_correction``): importance weights and masks for tokens that were sampled by
a different policy than the one the PPO ratio is taken against.

Two log-probs per token go in:

- `behaviour_log_prob`: the policy that *sampled* the token: the inference engine (vLLM / SGLang, whose kernels
  and precision differ from the trainer's), or any older policy when the trainer runs asynchronously;
- `proximal_log_prob`: the trainer's own log-prob under the policy the update is anchored to (``old_log_prob``
  of the PPO ratio, recomputed by the trainer before the update).

With ``log r_t = proximal_log_prob_t - behaviour_log_prob_t`` (clamped to +-20 before any exp), the modes:

- ``none``: weights 1, nothing masked (the metrics still measure the gap);
- ``token_tis``: truncated importance sampling per token, ``w_t = min(r_t, cap)``;
- ``seq_tis``: per sequence, ``w_i = min(exp(sum_t log r_t), cap)`` for every token of the sequence;
- ``token_mis`` / ``seq_mis``: masked importance sampling: the weight is the (token / sequence) ratio itself
  where it lies in ``[low, high]`` and the token (sequence) is masked out where it does not (default band
  ``[1 / cap, cap]``: verl's rejection sampling takes the reciprocal of the upper threshold when no lower one is
  given, and slime's MIS uses 0.5 with an upper 2; a ratio near 0 is as far from the engine as one near 2 and
  carries as little of the engine's evidence, so it is masked too);
- ``icepop``: ``token_mis`` with the two-sided band of IcePop (Ling team, Ring-1T): ``[0.5, 2]`` by default;
- ``geo_mask``: masks whole sequences whose geometric-mean ratio ``exp(mean_t log r_t)`` leaves ``[low, high]``
  (default ``[0.999, 1.001]``, verl's geometric rejection band of 0.1 %: a per-token mean ratio off by 1 % is a
  large mismatch over a few hundred tokens, which a 1 % band would let through); kept sequences get weight 1.

The masked modes (MIS, IcePop, geo_mask) return the rejection mask: the trainer applies it to every token-level
term of the actor loss (policy loss, KL, entropy, LLDS), not only to the policy gradient, since a rejected token
is one whose numbers the trainer should not trust at all.

Sums and means run over the mask-1 tokens only (retrieved ``<information>`` tokens and padding have no ratio:
the engine did not sample them). The weights are detached: they scale the policy-gradient term and pass no
gradient. Use them as ``rollout_is_weights`` of ``policy_losses`` and the returned mask as the loss mask.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_searchr1.algo.masked import masked_mean, masked_sum
from megatron_searchr1.algo.policy_losses import ratio_stats

ROLLOUT_CORRECTIONS = ("none", "token_tis", "seq_tis", "token_mis", "seq_mis", "icepop", "geo_mask")

_SAFETY = 20.0
_ICEPOP_BAND = (0.5, 2.0)
_GEO_BAND = (0.999, 1.001)


def mismatch_kl(proximal_log_prob: torch.Tensor, behaviour_log_prob: torch.Tensor,
                response_mask: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(behaviour || proximal) from tokens the behaviour policy sampled, the mean over mask-1
    tokens of ``r - log r - 1`` with ``r = exp(proximal - behaviour)`` (never negative, 0 when they agree).

    >>> mismatch_kl(torch.log(torch.tensor([[2.0, 1.0]])), torch.zeros(1, 2), torch.tensor([[1, 0]]))  # 2-ln2-1
    tensor(0.3069)
    """
    mask = response_mask.bool()  # (B, T)
    log_r = torch.where(mask, torch.clamp(proximal_log_prob - behaviour_log_prob, -_SAFETY, _SAFETY), 0.0)
    return masked_mean(torch.exp(log_r) - log_r - 1.0, mask).detach()


def _band(mode: str, cap: float, low: Optional[float], high: Optional[float]) -> tuple[float, float]:
    if mode == "icepop":
        default = _ICEPOP_BAND
    elif mode == "geo_mask":
        default = _GEO_BAND
    else:
        default = (1.0 / cap, cap) if high is None else (1.0 / high, high)
    band = (default[0] if low is None else low, default[1] if high is None else high)
    if not 0.0 <= band[0] < band[1]:
        raise ValueError(f"rollout correction {mode}: the band needs 0 <= low < high, got low={band[0]}, "
                         f"high={band[1]}")
    return band


def compute_rollout_correction(
    proximal_log_prob: torch.Tensor,
    behaviour_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str,
    *,
    cap: float = 2.0,
    low: Optional[float] = None,
    high: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights and a loss mask for `mode` (one of ``ROLLOUT_CORRECTIONS``); returns
    ``(weights, mask, metrics)``: weights (B, T) detached, 0 wherever `mask` is 0; mask (B, T) bool, the
    response mask less the masked-out tokens.

    `cap` truncates the TIS weights and is the upper end of the MIS band unless `high` is given; `low` / `high`
    set the band of ``token_mis`` / ``seq_mis`` / ``icepop`` / ``geo_mask`` (defaults in the module docstring).

    metrics (detached 0-dim tensors, over mask-1 tokens of `response_mask`): ``mismatch_kl`` (k3),
    ``clipped_frac`` (share of tokens whose weight was truncated at `cap`), ``masked_frac`` (share masked out),
    ``ratio_mean`` / ``ratio_min`` / ``ratio_max`` of the ratio the mode looks at (per token; per sequence for
    ``seq_*``; the geometric mean for ``geo_mask``; sequence statistics over rows with a mask-1 token).

    >>> prox = torch.log(torch.tensor([[3.0, 1.5, 0.25]])); beh = torch.zeros(1, 3); m = torch.ones(1, 3)
    >>> w, keep, _ = compute_rollout_correction(prox, beh, m, "token_tis", cap=2.0); w
    tensor([[2.0000, 1.5000, 0.2500]])
    >>> w, keep, _ = compute_rollout_correction(prox, beh, m, "icepop"); w, keep  # band [0.5, 2]
    (tensor([[0.0000, 1.5000, 0.0000]]), tensor([[False,  True, False]]))
    """
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"unknown rollout_correction {mode!r}; choose one of {', '.join(ROLLOUT_CORRECTIONS)}")
    if cap <= 0:
        raise ValueError(f"rollout correction cap must be > 0, got {cap}")
    valid = response_mask.bool()  # (B, T)
    rows = valid.any(dim=-1)  # (B,) sequences with a sampled token
    log_r = torch.where(valid, (proximal_log_prob - behaviour_log_prob).detach(), 0.0)  # (B, T)
    token_ratio = torch.exp(torch.clamp(log_r, -_SAFETY, _SAFETY))  # (B, T)
    seq_log_r = masked_sum(log_r, valid, axis=-1)  # (B,)
    seq_ratio = torch.exp(torch.clamp(seq_log_r, -_SAFETY, _SAFETY))  # (B,)
    geo_ratio = torch.exp(torch.clamp(masked_mean(log_r, valid, axis=-1), -_SAFETY, _SAFETY))  # (B,)

    ones = torch.ones_like(token_ratio)  # (B, T)
    clipped = torch.zeros_like(valid)  # (B, T)
    keep = valid  # (B, T)
    if mode == "none":
        weights, looked_at, level_mask = ones, token_ratio, valid
    elif mode == "token_tis":
        weights, looked_at, level_mask = token_ratio.clamp(max=cap), token_ratio, valid
        clipped = valid & (token_ratio > cap)
    elif mode == "seq_tis":
        weights = seq_ratio.clamp(max=cap).unsqueeze(-1).expand_as(token_ratio)  # (B, T)
        looked_at, level_mask = seq_ratio, rows
        clipped = valid & (seq_ratio > cap).unsqueeze(-1)
    else:
        lo, hi = _band(mode, cap, low, high)
        if mode in ("token_mis", "icepop"):
            weights, looked_at, level_mask = token_ratio, token_ratio, valid
            inside = (token_ratio >= lo) & (token_ratio <= hi)  # (B, T)
        else:
            per_seq = seq_ratio if mode == "seq_mis" else geo_ratio  # (B,)
            weights = ones if mode == "geo_mask" else per_seq.unsqueeze(-1).expand_as(token_ratio)
            looked_at, level_mask = per_seq, rows
            inside = ((per_seq >= lo) & (per_seq <= hi)).unsqueeze(-1)  # (B, 1)
        keep = valid & inside

    weights = torch.where(keep, weights, 0.0).detach()  # (B, T)
    metrics = {
        "mismatch_kl": mismatch_kl(proximal_log_prob, behaviour_log_prob, valid),
        "clipped_frac": masked_mean(clipped.float(), valid),
        "masked_frac": masked_mean((valid & ~keep).float(), valid),
    }
    metrics.update(ratio_stats(looked_at, level_mask))
    return weights, keep, metrics
