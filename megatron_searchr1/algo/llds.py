"""LLDS, the likelihood-displacement regulariser of Deng et al. 2025 (arXiv 2512.04220, "On GRPO Collapse in
Search-R1: the Lazy Likelihood-Displacement Death Spiral").

Why: in GRPO on search-integrated QA the log-likelihood of *correct* responses drifts down (lazy likelihood
displacement): the negative gradient of wrong responses that share tokens and prefixes with the right one pulls
the right one down too. Lower likelihood means less confident responses, larger gradients, and eventually a
collapse. LLDS adds a penalty that acts only where that happened: on tokens of non-negative-advantage
trajectories whose log-prob fell below its value under the old (rollout-time) policy::

    penalty = agg over mask-1 tokens of  c_t * gate_t * max(0, old_log_prob_t - log_prob_t) * [A_t >= 0]

The gate opens on a whole unit whose likelihood fell, so a unit that rose overall is left to the policy loss. As in
the LLDS reference (its ``dp_actor.py``), units are made of the *eligible* tokens, mask x [A >= 0]: under GRPO the
advantage is one number per response, so that is the response's mask-1 tokens; under GAE a token with A < 0 splits
an action and never counts in a gate sum:

- ``gate="response"``: the summed decrease ``sum_t (old_log_prob_t - log_prob_t)`` over the response's eligible
  tokens is > 0;
- ``gate="action"``: per action, i.e. each contiguous run of eligible tokens (between retrieved ``<information>``
  blocks: a search call, the final answer), that run's summed decrease is > 0.

``c_t`` is `coef`, and on the answer span (given as `answer_mask`, or else the last action of each response)
``min(answer_coef, coef)``: the reference holds the answer at most as tightly as the rest (its answer weight is
capped by the main one), and its adaptive variant scales the answer weight by the batch's mean number of searches
beyond the first (``llds_answer_weight``), so the answer of a one-search batch is not held at all.
Retrieved tokens (mask 0) never enter a gate, a sum or the penalty. Gates and the old log-probs carry no
gradient; the penalty's gradient raises exactly the gated tokens whose log-prob fell. At the first update on a
fresh rollout ``log_prob == old_log_prob`` and the penalty is 0: it acts from the second mini-batch / epoch on.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_searchr1.algo.losses import agg_loss
from megatron_searchr1.algo.masked import masked_mean, masked_sum

LLDS_GATES = ("response", "action")


def action_spans(response_mask: torch.Tensor) -> torch.Tensor:
    """Index of the action each token belongs to, (B, T) -> (B, T) long: actions are the contiguous runs of
    mask-1 tokens, numbered 0, 1, ... within each row; -1 on mask-0 tokens.

    >>> action_spans(torch.tensor([[1, 1, 0, 0, 1, 0, 1, 1]]))
    tensor([[ 0,  0, -1, -1,  1, -1,  2,  2]])
    """
    mask = response_mask.bool()  # (B, T)
    prev = torch.zeros_like(mask)
    prev[:, 1:] = mask[:, :-1]
    starts = mask & ~prev  # (B, T) first token of each run
    ids = torch.cumsum(starts.long(), dim=-1) - 1  # (B, T)
    return torch.where(mask, ids, torch.full_like(ids, -1))


def last_action_mask(response_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the tokens of each row's last action (where the answer is, in a trajectory that answered).

    >>> last_action_mask(torch.tensor([[1, 0, 1, 1, 0]]))
    tensor([[False, False,  True,  True, False]])
    """
    spans = action_spans(response_mask)  # (B, T)
    last = spans.max(dim=-1, keepdim=True).values  # (B, 1)
    return (spans == last) & (spans >= 0)


def llds_answer_weight(answer_coef: float, mean_searches: Optional[float] = None) -> float:
    """The answer span's LLDS weight before the ``min`` with `coef`: `answer_coef`, or with the reference's adaptive
    weighting (`mean_searches` given: the batch's mean number of searches per trajectory)
    ``answer_coef * max(mean_searches - 1, 0)``, so the answer is held more the more a batch searched.

    >>> llds_answer_weight(0.1), llds_answer_weight(0.1, mean_searches=2.5), llds_answer_weight(0.1, 0.5)
    (0.1, 0.15000000000000002, 0.0)
    """
    if mean_searches is None:
        return float(answer_coef)
    return float(answer_coef) * max(float(mean_searches) - 1.0, 0.0)


def _span_sums(values: torch.Tensor, spans: torch.Tensor) -> torch.Tensor:
    """(B, T) values summed per action, broadcast back to (B, T) (0 on mask-0 tokens)."""
    B, T = values.shape
    n = T + 1  # slot T collects the mask-0 tokens
    slot = torch.where(spans >= 0, spans, torch.full_like(spans, T))  # (B, T)
    sums = torch.zeros(B, n, dtype=values.dtype, device=values.device).scatter_add_(1, slot, values)  # (B, T+1)
    return torch.where(spans >= 0, sums.gather(1, slot), torch.zeros_like(values))


def compute_llds_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    coef: float,
    gate: str = "action",
    answer_coef: Optional[float] = None,
    answer_mask: Optional[torch.Tensor] = None,
    loss_agg_mode: str = "token-mean",
    denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The LLDS penalty (add it to the policy loss) and its metrics; tensors (B, T).

    ``min(answer_coef, coef)`` (`answer_coef` None: `coef`) applies on `answer_mask` (None: each row's last action);
    pass ``llds_answer_weight(...)`` as `answer_coef` for the adaptive weighting. `loss_agg_mode` /
    `denominator` aggregate the penalty matrix as the policy loss is aggregated (``agg_loss``), so the two add up
    the same way over micro-batches.

    metrics (detached 0-dim tensors): ``llds_penalty``; ``llds_action_gate_frac`` and
    ``llds_response_gate_frac``: share of the actions / responses of non-negative-advantage rows whose gate is
    open (both measured whichever `gate` is used); ``logp_pos_sum`` / ``logp_pos_count`` (and ``_neg_``): sum and
    count of the old log-probs of mask-1 tokens with advantage > 0 / < 0, whose ratio (``logp_pos_mean``, this
    batch's) is the quantity whose fall LLDS watches (see ``collapse``); ``logp_pos_avg_llds``: the reference's
    curve, the old log-probs of A >= 0 tokens over all mask-1 tokens.

    >>> old = torch.zeros(1, 4); new = torch.tensor([[-0.5, 0.2, 0., -0.1]]); m = torch.tensor([[1, 1, 0, 1]])
    >>> pen, _ = compute_llds_loss(old, new, torch.ones(1, 4), m, coef=1.0, gate="action")
    >>> round(pen.item(), 4)  # action 0 sums 0.5 - 0.2 > 0: gated, its 1st token adds 0.5; action 1 adds 0.1; / 3
    0.2
    """
    if gate not in LLDS_GATES:
        raise ValueError(f"unknown llds gate {gate!r}; choose one of {', '.join(LLDS_GATES)}")
    mask = response_mask.bool()  # (B, T)
    log_prob = torch.where(mask, log_prob, 0.0)  # (B, T)
    old_log_prob = torch.where(mask, old_log_prob, 0.0).detach()  # (B, T)
    adv = torch.where(mask, advantages, 0.0).detach()  # (B, T)
    eligible = mask & (adv >= 0)  # (B, T) the reference's mask x [A >= 0]
    decrease = torch.where(eligible, old_log_prob - log_prob, 0.0).detach()  # (B, T) > 0 where it fell

    spans = action_spans(eligible)  # (B, T) actions = runs of eligible tokens
    action_open = (_span_sums(decrease, spans) > 0) & eligible  # (B, T)
    response_open = (decrease.sum(dim=-1, keepdim=True) > 0) & eligible  # (B, T)
    gate_open = action_open if gate == "action" else response_open

    token_coef = torch.full_like(log_prob, float(coef))  # (B, T)
    if answer_coef is not None:
        answer = last_action_mask(mask) if answer_mask is None else answer_mask.bool() & mask  # (B, T)
        token_coef = torch.where(answer, min(float(answer_coef), float(coef)), token_coef)
    active = eligible & gate_open  # (B, T)
    penalty_mat = torch.where(active, token_coef * torch.relu(old_log_prob - log_prob), 0.0)  # (B, T)
    penalty = agg_loss(penalty_mat, mask, loss_agg_mode, denominator=denominator)

    # shares over the actions / responses of eligible tokens
    first = eligible & (spans >= 0) & torch.cat([torch.ones_like(mask[:, :1]), spans[:, 1:] != spans[:, :-1]], -1)
    rows = eligible.any(dim=-1)  # (B,)
    pos, neg = mask & (adv > 0), mask & (adv < 0)  # (B, T)
    metrics = {
        "llds_penalty": penalty.detach(),
        "llds_action_gate_frac": masked_mean(action_open.float(), first),
        "llds_response_gate_frac": masked_mean(response_open.any(dim=-1).float(), rows),
        # the collapse watch's quantity as sums and counts, so that micro-batches add up exactly and a batch
        # without a positive-advantage token has no value (not 0); logp_pos_mean is this batch's ratio
        "logp_pos_sum": masked_sum(old_log_prob, pos), "logp_pos_count": pos.sum().to(old_log_prob.dtype),
        "logp_neg_sum": masked_sum(old_log_prob, neg), "logp_neg_count": neg.sum().to(old_log_prob.dtype),
        "logp_pos_mean": masked_mean(old_log_prob, pos),
        "logp_neg_mean": masked_mean(old_log_prob, neg),
        # the LLDS reference's curve (dp_actor.py's pos_avg_old_log_prob): old log-probs of A >= 0 tokens summed
        # over *all* mask-1 tokens, so it moves with the share of positive tokens as well as with their likelihood
        "logp_pos_avg_llds": masked_mean(torch.where(adv >= 0, old_log_prob, 0.0), mask),
    }
    return penalty, metrics
