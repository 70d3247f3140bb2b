"""Tree-GRPO's advantages (arXiv 2509.21240, repository AMAP-ML/Tree-GRPO) and the weights that keep a prefix shared
by several leaves from counting several times in the loss.

A prompt's group is M trees; each leaf of a tree is one complete trajectory (rollout/tree.py grows them). Every
leaf is scored on its own (outcome reward), and its advantage is the sum of two GRPO advantages:

    inter-tree  A_inter(i) = (R_i - mean(R over the prompt's leaves, all M trees)) / (std(same) + eps)
    intra-tree  A_intra(i) = (R_i - mean(R over the leaves of i's tree))          / (std(same) + eps)
    A(i)        = A_inter(i) + A_intra(i)

with the unbiased std (torch's default) and eps = 1e-6: the repository's `tree` estimator (its trainer calls
verl's GRPO once with the prompt's uid and once with the tree's uid and adds the two). A group of one row gets mean
0 and std 1 there (its raw score); `single_group_zero=True` gives it 0 instead, the trainer's rule for a lone sample
(trainer/losses.py): with nothing to compare, it carries no signal.

Shared prefixes. The paper trains each leaf as its own sequence: a turn shared by c leaves sits in c sequences,
each copy carrying its own leaf's advantage (so the token's summed signal is the sum of its leaves' advantages, which
is how the intra-tree term turns into a preference between the branches below a node). Kept as that, a token of the
first turn would weigh c times as much as a token generated once. Here each copy keeps its leaf's advantage and is
weighted 1/c (`shared_token_weights`): the token counts once, with the mean of its leaves' advantages. The policy
losses (PPO clip with dual clip, GSPO, CISPO) are positively homogeneous in the advantage per token
(loss(w*A) = w*loss(A) for w > 0), so the trainer applies the weight by scaling the copy's advantage
(`weighted_advantages`): each copy is still clipped by its own leaf's sign, as in the paper.

Which leaves share a position is read from the tree's structure, not compared token by token: a leaf forked from a
node of another leaf holds that leaf's tokens up to the node. `segments` records, per leaf, which leaf generated
each stretch of its response ("owner"); two leaves of one tree share position p when the same leaf owns p in both.

All tensors are (B, T) over response tokens, B leaves padded to T.
"""
from __future__ import annotations

from typing import Sequence

import torch

from megatron_searchr1.algo.advantages import _outcome_scores, _zero, group_rows


def _grpo_scores(scores: torch.Tensor, index, epsilon: float, norm_by_std: bool,
                 single_group_zero: bool) -> torch.Tensor:
    """(B,) GRPO-normalised scores within the groups named by `index` (verl's rule for a group of one unless
    `single_group_zero`)."""
    out = torch.empty_like(scores)  # (B,)
    for rows in group_rows(index, scores.shape[0]):
        s = scores[rows]  # (n,)
        if len(rows) == 1:
            out[rows] = 0.0 if single_group_zero else s  # verl: mean 0, std 1
            continue
        d = s - s.mean()
        out[rows] = d / (s.std() + epsilon) if norm_by_std else d
    return out


def compute_tree_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence,
    tree_index: Sequence,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    single_group_zero: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tree-GRPO: inter-tree GRPO over `index` (the prompt's group: every leaf of its trees) plus intra-tree GRPO
    over `tree_index` (one id per tree), spread over each row's mask-1 tokens. Returns ``(advantages, inter,
    intra)``, each (B, T), 0 at mask-0 positions; advantages = inter + intra.

    token_level_rewards: (B, T) the outcome score on the last generated token (outcome_token_rewards);
    response_mask: (B, T); index, tree_index: one id per row.

    >>> r = torch.tensor([[1.], [0.], [1.], [1.]]); m = torch.ones(4, 1)
    >>> a, inter, intra = compute_tree_grpo_outcome_advantage(r, m, ["q"] * 4, ["t0", "t0", "t1", "t1"])
    >>> [round(x, 3) for x in inter.flatten().tolist()], [round(x, 3) for x in intra.flatten().tolist()]
    ([0.5, -1.5, 0.5, 0.5], [0.707, -0.707, 0.0, 0.0])
    """
    with torch.no_grad():
        mask = response_mask.bool()  # (B, T)
        scores = _outcome_scores(token_level_rewards, mask)  # (B,)
        inter = _grpo_scores(scores, index, epsilon, norm_adv_by_std_in_grpo, single_group_zero)  # (B,)
        intra = _grpo_scores(scores, tree_index, epsilon, norm_adv_by_std_in_grpo, single_group_zero)  # (B,)
        inter = torch.where(mask, inter[:, None], _zero(inter))  # (B, T)
        intra = torch.where(mask, intra[:, None], _zero(intra))  # (B, T)
    return inter + intra, inter, intra


def segment_owners(segments: Sequence[Sequence[tuple[int, int]]], lengths: Sequence[int]) -> torch.Tensor:
    """(B, T) the id of the leaf that generated each response position, -1 on padding. T = max(lengths).

    segments[i]: leaf i's response as consecutive stretches ``(owner, end)``: positions [previous end, end) were
    generated by leaf `owner` (the leaves it was forked from, then itself). The last stretch may end past the
    response (a leaf's own stretch is open-ended).

    >>> segment_owners([[(0, 9)], [(0, 2), (1, 9)]], [3, 4])
    tensor([[ 0,  0,  0, -1],
            [ 0,  0,  1,  1]])
    """
    T = max(lengths, default=0)
    out = torch.full((len(lengths), T), -1, dtype=torch.long)  # (B, T)
    for i, (segs, n) in enumerate(zip(segments, lengths)):
        start = 0
        for owner, end in segs:
            out[i, start:min(end, n)] = owner
            start = end
        if start < n:
            raise ValueError(f"leaf {i}'s segments end at {start}, before its {n} response tokens")
    return out


def shared_token_counts(owners: torch.Tensor, tree_index: Sequence) -> torch.Tensor:
    """(B, T) how many rows of the same tree hold each position (the same leaf generated it there); 0 on padding.

    owners: (B, T) from segment_owners; tree_index: one tree id per row.

    >>> shared_token_counts(torch.tensor([[0, 0, 0, -1], [0, 0, 1, 1], [5, 5, -1, -1]]), ["a", "a", "b"])
    tensor([[2, 2, 1, 0],
            [2, 2, 1, 1],
            [1, 1, 0, 0]])
    """
    B, T = owners.shape
    counts = torch.zeros(B, T, dtype=torch.long)  # (B, T)
    for rows in group_rows(tree_index, B):
        o = owners[rows]  # (n, T)
        same = (o[:, None, :] == o[None, :, :]) & (o[None, :, :] >= 0)  # (n, n, T) row j holds row i's token
        counts[rows] = same.sum(dim=1) * (o >= 0)
    return counts


def shared_token_weights(owners: torch.Tensor, tree_index: Sequence, response_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) 1 / (rows of the tree sharing the position) on mask-1 tokens, 0 elsewhere: over the copies of one
    token the weights add up to 1.

    >>> shared_token_weights(torch.tensor([[0, 0, 0], [0, 1, 1]]), [7, 7], torch.tensor([[1, 1, 0], [1, 1, 1]]))
    tensor([[0.5000, 1.0000, 0.0000],
            [0.5000, 1.0000, 1.0000]])
    """
    counts = shared_token_counts(owners, tree_index).float()  # (B, T)
    keep = response_mask.bool() & (counts > 0)
    return torch.where(keep, 1.0 / counts.clamp(min=1), torch.zeros((), dtype=torch.float32))


def weighted_advantages(advantages: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(B, T) each copy's advantage times its weight: a token shared by c leaves then adds up, over its copies, to
    the mean of their advantages, once (the policy losses are positively homogeneous in the advantage)."""
    return advantages * weights
