"""KL to the reference policy: per-token estimators, the KL coefficient controllers, and KL as a reward penalty.

Two ways to use it (as in verl): as a loss term (``agg_loss(kl_penalty(log_prob, ref_log_prob, "low_var_kl"),
mask)`` times a coefficient, Search-R1's GRPO setting), or subtracted from the token rewards before the advantage
(``apply_kl_penalty``, with a fixed or adaptive coefficient). Either way only generated tokens (mask 1) count:
the KL of a retrieved token measures how surprised the policy is by the search engine's text, which the policy
cannot change; Search-R1 leaves it in its KL loss and reward penalty.
"""
from __future__ import annotations

import torch

from megatron_searchr1.algo.masked import masked_mean

KL_ESTIMATORS = ("kl", "abs", "mse", "low_var_kl")
_ALIASES = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs, (B, T) -> (B, T).

    - ``kl`` (k1): ``logprob - ref_logprob``, unbiased, can be negative;
    - ``abs``: ``|logprob - ref_logprob|``;
    - ``mse`` (k2): ``0.5 * (logprob - ref_logprob)^2``;
    - ``low_var_kl`` (k3, Schulman's estimator): ``exp(d) - d - 1`` with ``d = ref_logprob - logprob``; d is
      clamped to +-20 before the exp and the result to [-10, 10], as verl does, so one extreme token cannot blow
      up the loss.

    >>> lp, ref = torch.tensor([0.0]), torch.log(torch.tensor([0.5]))
    >>> [round(kl_penalty(lp, ref, k).item(), 4) for k in KL_ESTIMATORS]  # d = ln .5: e^d - d - 1 = 0.1931
    [0.6931, 0.6931, 0.2402, 0.1931]
    """
    kind = _ALIASES.get(kl_penalty, kl_penalty)
    diff = logprob - ref_logprob
    if kind == "kl":
        return diff
    if kind == "abs":
        return diff.abs()
    if kind == "mse":
        return 0.5 * diff.square()
    if kind == "low_var_kl":
        d = torch.clamp(-diff, min=-20.0, max=20.0)
        return torch.clamp(torch.exp(d) - d - 1.0, min=-10.0, max=10.0)
    raise ValueError(f"unknown kl_penalty {kl_penalty!r}; choose one of {', '.join(KL_ESTIMATORS)} "
                     f"(or k1, k2, k3)")


# apply_kl_penalty's argument `kl_penalty` (verl's name) shadows the function inside it
_kl_estimate = kl_penalty


class FixedKLController:
    """A constant KL coefficient (``.value``); ``update`` does nothing."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """The KL coefficient of Ziegler et al. 2019 (arXiv 1909.08593): moved toward the value that keeps the
    measured KL at `target_kl`. Each update multiplies it by ``1 + e * n_steps / horizon`` with
    ``e = clip(current_kl / target_kl - 1, -0.2, 0.2)``.

    >>> c = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.5, horizon=100)
    >>> c.update(current_kl=1.0, n_steps=50); round(c.value, 6)  # e = clip(1, ...) = 0.2: 0.1 * 1.1
    0.11
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0 for the adaptive KL controller, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0 for the adaptive KL controller, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        """The coefficient reached so far (target and horizon come from the run's config)."""
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, float]:
    """KL in the reward: ``rewards = scores - kl_ctrl.value * KL`` on mask-1 tokens, 0 on mask-0 tokens;
    returns ``(token_level_rewards (B, T), current_kl)``, where `current_kl` is the per-row mean KL over generated
    tokens, averaged over the rows that have any.

    Unlike verl's, this does **not** call ``kl_ctrl.update``: under data parallelism each rank sees only its
    shard, and ranks that updated from their own KL would drift to different coefficients. The trainer averages
    `current_kl` over the data-parallel group and then calls ``kl_ctrl.update(kl, n_steps=global_batch_size)``.

    >>> scores = torch.tensor([[0., 0., 1.]]); m = torch.tensor([[1, 0, 1]])
    >>> old, ref = torch.tensor([[0.2, 5.0, 0.4]]), torch.zeros(1, 3)
    >>> apply_kl_penalty(scores, old, ref, m, FixedKLController(0.5))  # 0 - .5*.2, -, 1 - .5*.4; kl (.2+.4)/2
    (tensor([[-0.1000,  0.0000,  0.8000]]), 0.30000001192092896)
    """
    mask = response_mask.bool()  # (B, T)
    zero = torch.zeros((), dtype=token_level_scores.dtype, device=token_level_scores.device)
    kld = torch.where(mask, _kl_estimate(old_log_prob, ref_log_prob, kl_penalty), zero)  # (B, T)
    rewards = torch.where(mask, token_level_scores - kl_ctrl.value * kld, zero)  # (B, T)
    per_row = masked_mean(kld, mask, axis=-1)  # (B,)
    current_kl = masked_mean(per_row, mask.any(dim=-1)).item()
    return rewards, current_kl
