"""Turn-level credit for multi-turn search: GiGPO-style step groups (Feng et al. 2025, "Group-in-Group Policy
Optimization for LLM Agent Training", arXiv 2505.10978) and optional per-turn rewards, added to the outcome advantage.

Outcome-only GRPO gives every token of a trajectory the same advantage, so a search that found the bridge entity and
one that retrieved nothing useful are credited alike. GiGPO adds a second, finer group: the turns of a prompt's
trajectories that act from the *same state* (its anchor state). In a search agent the state a turn acts from is the
prompt plus what the environment returned so far, so the anchor key of turn k is the sequence of observations
(retrieved ``<information>`` blocks and feedback, the mask-0 runs) before it; the first turn of every trajectory of
a group shares the key ``()``. Within a step group the return from the turn on is normalised like GRPO's outcome::

    G_k   = sum_{j >= k} gamma^(j - k) r_j  +  gamma^(K - 1 - k) R          # r_j per-turn reward, R outcome
    A^S_k = (G_k - mean_{step group} G) / (std_{step group} G + eps)        # 0 in a step group of one
    A_t   = A^E_i + weight * A^S_{turn(t)}                                  # on each generated token t of turn k

where ``A^E`` is the ordinary outcome advantage (GRPO / RLOO), K the trajectory's number of turns. A turn is a
contiguous run of generated tokens (loss mask 1). Turns whose keys differ across trajectories fall in step groups
of one and get no step advantage: credit is only redistributed between turns that faced the same evidence.

Pure functions over lists and (B, T) tensors; the trainer (trainer/losses.py) supplies the per-turn rewards.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Hashable, Sequence

import torch

from megatron_searchr1.algo.llds import action_spans


def turn_segments(loss_mask: Sequence[int]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The turns (runs of mask-1 tokens) and, for each, the mask-0 run that follows it (its observation; an empty
    span at the end), as ``[start, end)`` index pairs.

    >>> turn_segments([1, 1, 0, 0, 1, 0, 1])
    ([(0, 2), (4, 5), (6, 7)], [(2, 4), (5, 6), (7, 7)])
    """
    mask = [int(bool(m)) for m in loss_mask]
    turns, obs = [], []
    t, n = 0, len(mask)
    while t < n:
        if mask[t]:
            start = t
            while t < n and mask[t]:
                t += 1
            turns.append((start, t))
            o = t
            while t < n and not mask[t]:
                t += 1
            obs.append((o, t))
        else:
            t += 1
    return turns, obs


def anchor_keys(response_ids: Sequence[int], loss_mask: Sequence[int]) -> list[tuple]:
    """Per turn, the anchor state it acts from: the tuple of observation token-id tuples seen before it (observation
    tokens before the first turn count too). Token ids, so two observations are the same state exactly when the
    environment returned the same bytes.

    >>> anchor_keys([5, 6, 9, 9, 7, 8, 4], [1, 1, 0, 0, 1, 0, 1])
    [(), ((9, 9),), ((9, 9), (8,))]
    """
    turns, obs = turn_segments(loss_mask)
    first = turns[0][0] if turns else len(loss_mask)
    seen: list[tuple] = [tuple(response_ids[:first])] if first > 0 else []
    keys = []
    for (_, _), (o0, o1) in zip(turns, obs):
        keys.append(tuple(seen))
        if o1 > o0:
            seen.append(tuple(response_ids[o0:o1]))
    return keys


def turn_returns(outcome: float, turn_rewards: Sequence[float], gamma: float) -> list[float]:
    """Discounted return from each turn on: per-turn rewards plus the outcome at the last turn.

    >>> [round(g, 4) for g in turn_returns(1.0, [0.1, 0.0, 0.0], gamma=0.5)]  # 0.1 + .25, .25, 1
    [0.35, 0.5, 1.0]
    """
    K = len(turn_rewards)
    out = [0.0] * K
    acc = float(outcome)
    for k in range(K - 1, -1, -1):
        acc = float(turn_rewards[k]) + (acc if k == K - 1 else gamma * acc)
        out[k] = acc
    return out


def step_group_advantages(returns: Sequence[Sequence[float]], keys: Sequence[Sequence[Hashable]],
                          groups: Sequence[Hashable], norm_by_std: bool = True,
                          epsilon: float = 1e-6) -> list[list[float]]:
    """Per trajectory and turn, the step advantage: the turn's return normalised within its step group (the turns
    with the same trajectory group id and the same anchor key). Mean-centred; divided by the group's std
    (unbiased, as GRPO's) + `epsilon` when `norm_by_std`. A step group of one gets 0.

    >>> adv = step_group_advantages([[1.0, 1.0], [0.0, 0.0]], [[(), ("a",)], [(), ("b",)]], ["g", "g"])
    >>> [[round(a, 4) for a in row] for row in adv]  # first turns: one step group (std 0.7071); second: two of one
    [[0.7071, 0.0], [-0.7071, 0.0]]
    """
    members: dict = defaultdict(list)
    for i, (g, ks) in enumerate(zip(groups, keys)):
        for k, key in enumerate(ks):
            members[(g, key)].append((i, k))
    out = [[0.0] * len(ks) for ks in keys]
    for rows in members.values():
        if len(rows) < 2:
            continue
        vals = [float(returns[i][k]) for i, k in rows]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
        for (i, k), v in zip(rows, vals):
            a = v - mean
            out[i][k] = a / (std + epsilon) if norm_by_std else a
    return out


def turn_token_advantages(step_advantages: Sequence[Sequence[float]], response_mask: torch.Tensor) -> torch.Tensor:
    """(B, T): each generated token carries its turn's step advantage; 0 on mask-0 tokens. Row i's turns are the
    runs of mask-1 tokens of `response_mask` (B, T), in order; turns beyond the list get 0.

    >>> turn_token_advantages([[0.5, -1.0]], torch.tensor([[1, 1, 0, 1]]))
    tensor([[ 0.5000,  0.5000,  0.0000, -1.0000]])
    """
    spans = action_spans(response_mask)  # (B, T) turn index, -1 on mask 0
    B, T = spans.shape
    width = max([len(a) for a in step_advantages] + [1])
    table = torch.zeros(B, width + 1, dtype=torch.float32)  # (B, K+1) slot K: tokens past the list / mask 0
    for i, adv in enumerate(step_advantages):
        if adv:
            table[i, : len(adv)] = torch.tensor([float(a) for a in adv])
    slot = torch.where((spans >= 0) & (spans < width), spans, torch.full_like(spans, width))  # (B, T)
    return table.gather(1, slot)


def combine_turn_advantages(outcome_advantages: torch.Tensor, step_token_advantages: torch.Tensor,
                            response_mask: torch.Tensor, weight: float) -> torch.Tensor:
    """``A^E + weight * A^S`` on mask-1 tokens, 0 elsewhere; (B, T) each.

    >>> combine_turn_advantages(torch.tensor([[1., 1., 1.]]), torch.tensor([[.5, 0., -.5]]), torch.tensor([[1, 0, 1]]),
    ...                         weight=2.0)
    tensor([[2., 0., 0.]])
    """
    mask = response_mask.bool()
    return torch.where(mask, outcome_advantages + weight * step_token_advantages, 0.0)
