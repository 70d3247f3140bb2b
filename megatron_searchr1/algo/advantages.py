"""Advantage estimators (verl's names and argument order): GAE, GRPO, RLOO, REINFORCE++, and the helper that puts
an outcome reward on a token.

All tensors are ``(B, T)`` over the response tokens, ``B`` trajectories of (padded) length ``T``.
``response_mask`` is the loss mask: 1 on tokens the policy generated, 0 on retrieved ``<information>`` tokens and
on padding.

**Retrieved tokens are not actions.** The policy did not choose them, so they get no reward, no value, no
advantage, and they do not sit between two of the policy's decisions as a time step: the GAE and return
recursions step over them (the "next" token of a generated token is the next *generated* token). Their advantages
and returns are 0, and they are left out of every normalisation statistic. Search-R1 masks them only in the
policy loss: its GAE bootstraps through the retrieved text with the critic's values there, whitens over them, and
its GRPO advantage is spread over them before the loss mask is applied. Here changing anything at a mask-0
position changes no output (the tests check it).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_searchr1.algo.masked import Reduce, masked_sum, masked_whiten


def _zero(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=x.dtype, device=x.device)


def outcome_token_rewards(scores, response_mask: torch.Tensor) -> torch.Tensor:
    """Token-level rewards ``(B, T)`` holding each row's outcome score on its last mask-1 token, 0 elsewhere.

    The last mask-1 token is the last token the policy generated (``</answer>``, or where the budget cut it):
    the reward belongs to the action that ended the trajectory, never to an observation token or padding. (Search-R1
    puts it at ``valid_response_length - 1``, which is a retrieved token when a trajectory ends with an observation.)
    A row with no mask-1 token has no action to credit and stays all zero.

    scores: ``(B,)`` (tensor, list or array); response_mask: ``(B, T)``.

    >>> outcome_token_rewards([1.0, 0.5], torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0]]))
    tensor([[0.0000, 1.0000, 0.0000, 0.0000],
            [0.0000, 0.0000, 0.5000, 0.0000]])
    """
    mask = response_mask.bool()  # (B, T)
    B, T = mask.shape
    scores = torch.as_tensor(scores, dtype=torch.float32, device=mask.device).reshape(-1)  # (B,)
    if scores.shape[0] != B:
        raise ValueError(f"got {scores.shape[0]} scores for {B} rows of response_mask")
    last = T - 1 - mask.flip(-1).float().argmax(dim=-1)  # (B,) index of the last mask-1 token
    rows = torch.arange(B, device=mask.device)[mask.any(dim=-1)]
    out = torch.zeros(B, T, dtype=torch.float32, device=mask.device)
    out[rows, last[rows]] = scores[rows]
    return out


def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    reduce: Optional[Reduce] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the generated tokens; returns ``(advantages, returns)``, both (B, T).

    For a generated token t whose next generated token is t' (none at the end: V = 0, A = 0 there)::

        delta_t = r_t + gamma * V_t' - V_t
        A_t     = delta_t + gamma * lam * A_t'
        R_t     = A_t + V_t

    Retrieved tokens between t and t' are skipped: they neither earn reward nor pass on value. Advantages are then
    whitened over the mask-1 tokens of the whole batch (as verl does for GAE); returns are not. Both are 0 at
    mask-0 positions. Under data parallelism pass `reduce` (masked.Reduce: a sum over the DP ranks) so that the
    whitening statistics are the whole batch's, not this rank's shard's.

    >>> r = torch.tensor([[0., 0., 9., 1.]]); v = torch.tensor([[.5, .2, 7., .4]]); m = torch.tensor([[1, 1, 0, 1]])
    >>> _, R = compute_gae_advantage_return(r, v, m, gamma=1.0, lam=1.0)
    >>> R  # every generated token's return is the final reward 1; the observation's 9 and 7 play no part
    tensor([[1., 1., 0., 1.]])
    """
    with torch.no_grad():
        mask = response_mask.bool()  # (B, T)
        rewards, values = token_level_rewards.float(), values.float()  # (B, T)
        B, T = rewards.shape
        next_value = torch.zeros(B, device=rewards.device)  # (B,) V of the next generated token
        next_adv = torch.zeros(B, device=rewards.device)  # (B,) A of the next generated token
        adv = torch.zeros_like(rewards)  # (B, T)
        for t in reversed(range(T)):
            m = mask[:, t]  # (B,)
            a = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * next_adv  # (B,)
            adv[:, t] = torch.where(m, a, _zero(a))
            # a retrieved token passes its successor's value and advantage through unchanged
            next_value = torch.where(m, values[:, t], next_value)
            next_adv = torch.where(m, a, next_adv)
        returns = torch.where(mask, adv + values, _zero(adv))  # (B, T)
        advantages = masked_whiten(adv, mask, reduce=reduce)  # (B, T)
    return advantages, returns


def group_rows(index, batch_size: int) -> list[list[int]]:
    """Row numbers of each group, groups in order of first appearance. `index`: one group id per row (str or int;
    a list, numpy array or tensor; tensors are compared by value, not by object)."""
    ids = index.tolist() if hasattr(index, "tolist") else list(index)
    if len(ids) != batch_size:
        raise ValueError(f"index has {len(ids)} group ids for {batch_size} rows; give one group id per row")
    groups: dict = {}
    for row, gid in enumerate(ids):
        groups.setdefault(gid, []).append(row)
    return list(groups.values())


def _outcome_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return masked_sum(token_level_rewards.float(), response_mask, axis=-1)  # (B,) one score per row


def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: each row's score (sum of its mask-1 rewards) minus its group's mean, divided by the group's std
    (unbiased, + epsilon) unless ``norm_adv_by_std_in_grpo=False`` (Dr. GRPO). A group of one row gets mean 0 and
    std 1, as in verl. The row's advantage is spread over its mask-1 tokens; ``(advantages, returns)`` are the same
    (B, T) tensor.

    index: group id per row, e.g. ``extra_info.uid`` repeated ``n`` times.

    >>> r = torch.tensor([[0., 1.], [0., 0.], [0., 3.]]); m = torch.ones(3, 2)
    >>> compute_grpo_outcome_advantage(r, m, ["q", "q", "solo"])[0]  # group q: mean 0.5, std 0.7071
    tensor([[ 0.7071,  0.7071],
            [-0.7071, -0.7071],
            [ 3.0000,  3.0000]])
    """
    with torch.no_grad():
        mask = response_mask.bool()  # (B, T)
        scores = _outcome_scores(token_level_rewards, mask)  # (B,)
        adv = torch.empty_like(scores)  # (B,)
        for rows in group_rows(index, scores.shape[0]):
            s = scores[rows]  # (n,)
            mean, std = (s.mean(), s.std()) if len(rows) > 1 else (torch.tensor(0.0), torch.tensor(1.0))
            adv[rows] = (s - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else s - mean
        adv = torch.where(mask, adv[:, None], _zero(adv))  # (B, T)
    return adv, adv


def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: each row's score minus the mean score of the *other* rows of its group,
    ``s_i - (sum_j s_j - s_i) / (n - 1)``; a group of one keeps its score. Spread over mask-1 tokens; returns
    ``(advantages, advantages)``. `epsilon` is unused (kept for verl's signature).

    >>> r = torch.tensor([[1.], [0.], [0.]]); m = torch.ones(3, 1)
    >>> compute_rloo_outcome_advantage(r, m, [7, 7, 7])[0].flatten()  # 1 - 0, 0 - (1+0)/2, 0 - (1+0)/2
    tensor([ 1.0000, -0.5000, -0.5000])
    """
    del epsilon
    with torch.no_grad():
        mask = response_mask.bool()  # (B, T)
        scores = _outcome_scores(token_level_rewards, mask)  # (B,)
        adv = scores.clone()  # (B,)
        for rows in group_rows(index, scores.shape[0]):
            n = len(rows)
            if n > 1:
                s = scores[rows]  # (n,)
                adv[rows] = s - (s.sum() - s) / (n - 1)
        adv = torch.where(mask, adv[:, None], _zero(adv))  # (B, T)
    return adv, adv


def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    reduce: Optional[Reduce] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: the discounted return-to-go of each generated token, ``G_t = r_t + gamma * G_t'`` (t' the next
    generated token), whitened over the whole batch's mask-1 tokens (`reduce`: see GAE). Returns
    ``(advantages, returns)``, (B, T), 0 at mask-0 positions.

    verl resets the running return at every mask-0 token (meant for padding after EOS); with retrieved tokens in
    the middle of a response that would cut the reward off from every earlier turn, so here the recursion steps
    over them like GAE does.

    >>> r = torch.tensor([[0., 0., 5., 1.]]); m = torch.tensor([[1, 1, 0, 1]])
    >>> compute_reinforce_plus_plus_outcome_advantage(r, m, gamma=0.5)[1]  # 1 * 0.5**2, 1 * 0.5, -, 1
    tensor([[0.2500, 0.5000, 0.0000, 1.0000]])
    """
    with torch.no_grad():
        mask = response_mask.bool()  # (B, T)
        rewards = token_level_rewards.float()  # (B, T)
        B, T = rewards.shape
        running = torch.zeros(B, device=rewards.device)  # (B,) return of the next generated token
        returns = torch.zeros_like(rewards)  # (B, T)
        for t in reversed(range(T)):
            m = mask[:, t]  # (B,)
            g = rewards[:, t] + gamma * running  # (B,)
            returns[:, t] = torch.where(m, g, _zero(g))
            running = torch.where(m, g, running)
        advantages = masked_whiten(returns, mask, reduce=reduce)  # (B, T)
    return advantages, returns
