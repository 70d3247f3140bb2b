"""DAPO's reward shaping and batch filters (Yu et al. 2025, arXiv 2503.14476) as pure functions.

- Overlong reward shaping: a linear penalty for responses that run into the last `overlong_buffer` tokens of
  the response budget, so that the policy learns to finish before the cut instead of being punished only by a
  wrong (truncated) answer;
- overlong filtering: the loss mask of truncated trajectories set to 0, so that a response cut by the budget,
  whose reward says nothing about its reasoning, does not train the policy. Only its *loss*: as in DAPO, its
  reward stays in its group's statistics (the mask is applied after the advantages), so four right answers beside
  one truncated one keep the advantage DAPO gives them;
- dynamic sampling: keep only the groups that carry a gradient. A group whose answers all scored the same has
  GRPO advantage 0 on every token and adds nothing to the gradient but dilutes the batch; the trainer samples more
  prompts until it has enough informative groups. A group counts as informative from the quantity the advantage
  is computed from (the training score, overlong shaping included), over the rows that stay in the group, and only
  if a row that can train (not overlong-filtered) gets a nonzero advantage.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_searchr1.algo.advantages import group_rows


def overlong_penalty(response_lengths: torch.Tensor, max_response_length: int, overlong_buffer: int,
                     penalty_factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment, (B,) lengths -> (B,) rewards to add to the scores. With
    ``L = max_response_length`` and ``N = overlong_buffer``::

        0                                    if len <= L - N
        (L - N - len) / N * penalty_factor   if L - N < len <= L       (from 0 down to -penalty_factor)
        -penalty_factor                      if len > L

    `response_lengths` are what the budget counts (in Search-R1: every response token, retrieved text included).

    >>> overlong_penalty(torch.tensor([10, 12, 14, 16, 20]), max_response_length=16, overlong_buffer=4)
    tensor([ 0.0000,  0.0000, -0.5000, -1.0000, -1.0000])
    """
    if not 0 < overlong_buffer <= max_response_length:
        raise ValueError(f"overlong_buffer must be in (0, max_response_length={max_response_length}], "
                         f"got {overlong_buffer}")
    if penalty_factor < 0:
        raise ValueError(f"overlong penalty_factor must be >= 0 (it is subtracted), got {penalty_factor}")
    lengths = torch.as_tensor(response_lengths).float()  # (B,)
    start = max_response_length - overlong_buffer
    ramp = (start - lengths) / overlong_buffer * penalty_factor  # (B,) negative past the start of the buffer
    return torch.clamp(ramp, min=-penalty_factor, max=0.0)


def overlong_filter_mask(response_mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """The loss mask (B, T) with every token of a truncated trajectory (`truncated`: (B,) bool, the budget cut it
    before it answered) set to 0; other rows unchanged.

    >>> overlong_filter_mask(torch.tensor([[1, 0, 1], [1, 1, 0]]), torch.tensor([True, False]))
    tensor([[0, 0, 0],
            [1, 1, 0]])
    """
    truncated = torch.as_tensor(truncated, dtype=torch.bool, device=response_mask.device).reshape(-1)  # (B,)
    if truncated.shape[0] != response_mask.shape[0]:
        raise ValueError(f"got {truncated.shape[0]} truncated flags for {response_mask.shape[0]} rows")
    return torch.where(truncated.unsqueeze(-1), torch.zeros_like(response_mask), response_mask)


def filter_groups(scores, index: Optional[Sequence] = None, group_size: Optional[int] = None, *,
                  trainable=None, counted=None) -> tuple[torch.Tensor, dict[str, int]]:
    """DAPO's dynamic-sampling filter: a (B,) bool keep-mask over rows, True on every row of an informative group,
    and counts ``{"groups", "kept_groups", "kept_rows"}``.

    scores: (B,) one training score per row (tensor, list or array). Groups are given by `index` (one group id per
    row, any order, e.g. ``extra_info.uid``) or by `group_size` (rows ``[0, n)``, ``[n, 2n)``, ...): exactly one.
    `counted` (B,) bool, default all: rows that stay in their group's statistics (False: a row that leaves its
    group, such as a failed search the trainer drops). `trainable` (B,) bool, default all: rows whose loss is
    trained (False: an overlong-filtered row, which stays in the statistics but carries no gradient).
    A group is informative when its counted scores are not all equal and a counted, trainable row's score differs
    from the counted mean (its GRPO advantage is nonzero). A group of one counted row has no spread.

    >>> keep, counts = filter_groups([1., 1., 0., 1., 0., 0.], group_size=2)
    >>> keep.tolist(), counts
    ([False, False, True, True, False, False], {'groups': 3, 'kept_groups': 1, 'kept_rows': 2})
    >>> filter_groups([1., 0., 0., 0.], group_size=2, trainable=[True, False, True, True])[0].tolist()
    [True, True, False, False]
    >>> filter_groups([1., 1., 0.], group_size=3, trainable=[False, False, True])[0].tolist()  # mean 2/3 != 0
    [True, True, True]
    """
    scores = torch.as_tensor(scores, dtype=torch.float64).reshape(-1)  # (B,)
    B = scores.shape[0]
    if (index is None) == (group_size is None):
        raise ValueError("filter_groups needs exactly one of index (a group id per row) and group_size")
    if group_size is not None:
        if group_size < 1 or B % group_size:
            raise ValueError(f"{B} rows do not split into groups of {group_size}")
        groups = [list(range(start, start + group_size)) for start in range(0, B, group_size)]
    else:
        groups = group_rows(index, B)
    trainable = torch.ones(B, dtype=torch.bool) if trainable is None else torch.as_tensor(trainable).bool()  # (B,)
    counted = torch.ones(B, dtype=torch.bool) if counted is None else torch.as_tensor(counted).bool()  # (B,)
    keep = torch.zeros(B, dtype=torch.bool)  # (B,)
    kept_groups = 0
    for rows in groups:
        rows_t = torch.tensor(rows, dtype=torch.long)
        inside = rows_t[counted[rows_t]]  # (k,) rows in the statistics
        if len(inside) < 2:
            continue
        group = scores[inside]  # (k,)
        moved = (group - group.mean()).abs() > 1e-12  # (k,) rows with a nonzero advantage
        if group.max() > group.min() and bool((moved & trainable[inside]).any()):
            keep[rows_t] = True
            kept_groups += 1
    return keep, {"groups": len(groups), "kept_groups": kept_groups, "kept_rows": int(keep.sum())}
