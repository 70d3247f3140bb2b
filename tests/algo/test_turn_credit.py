"""Turn-level credit (algo/turn_credit.py) against hand-computed values."""
import doctest

import pytest
import torch

from megatron_searchr1.algo import turn_credit
from megatron_searchr1.algo.turn_credit import (
    anchor_keys, combine_turn_advantages, step_group_advantages, turn_returns, turn_segments, turn_token_advantages,
)

# three trajectories of one prompt: generated tokens (mask 1) 5/6, observations (mask 0) 70/71 or 80
#   t0: search -> observation X (70, 71) -> answer        outcome 1
#   t1: search -> observation X (70, 71) -> answer        outcome 0
#   t2: search -> observation Y (80)     -> answer        outcome 0
IDS = [[5, 5, 70, 71, 6], [5, 5, 70, 71, 6, 6], [5, 80, 6]]
MASKS = [[1, 1, 0, 0, 1], [1, 1, 0, 0, 1, 1], [1, 0, 1]]


def test_segments_and_anchor_keys():
    assert turn_segments(MASKS[0]) == ([(0, 2), (4, 5)], [(2, 4), (5, 5)])
    keys = [anchor_keys(i, m) for i, m in zip(IDS, MASKS)]
    assert keys == [[(), ((70, 71),)], [(), ((70, 71),)], [(), ((80,),)]]
    # observation tokens before the first generated one (a template's preamble) are part of every key
    assert anchor_keys([9, 5, 70, 6], [0, 1, 0, 1]) == [((9,),), ((9,), (70,))]


def test_step_groups_by_hand():
    """First turns: one step group {1, 0, 0} (mean 1/3, std sqrt(1/3)): +1.1547, -0.5774, -0.5774. Second turns:
    t0 and t1 saw the same observation X: {1, 0} -> +-0.7071; t2 saw Y alone -> 0."""
    keys = [anchor_keys(i, m) for i, m in zip(IDS, MASKS)]
    rets = [turn_returns(r, [0.0, 0.0], 1.0) for r in (1.0, 0.0, 0.0)]
    adv = step_group_advantages(rets, keys, ["g", "g", "g"])
    assert adv[0] == pytest.approx([1.154699, 0.707106], abs=1e-5)
    assert adv[1] == pytest.approx([-0.577349, -0.707106], abs=1e-5)
    assert adv[2] == pytest.approx([-0.577349, 0.0], abs=1e-5)
    # trajectories of another prompt never share a step group, even with equal keys
    adv = step_group_advantages(rets, keys, ["g", "h", "h"])
    assert adv[0] == [0.0, 0.0]
    # mean only
    adv = step_group_advantages(rets, keys, ["g", "g", "g"], norm_by_std=False)
    assert adv[0] == pytest.approx([2 / 3, 0.5]) and adv[2] == pytest.approx([-1 / 3, 0.0])


def test_per_turn_rewards_and_discount():
    """t0 and t1's first search earned 0.1 (it found the bridge entity); gamma 0.5: returns t0 (0.1 + 0.5, 1),
    t1 (0.1, 0), t2 (0, 0). First turns {0.6, 0.1, 0}: mean 0.2333, std 0.32146 -> 1.1406, -0.4148, -0.7259."""
    rets = [turn_returns(1.0, [0.1, 0.0], 0.5), turn_returns(0.0, [0.1, 0.0], 0.5), turn_returns(0.0, [0, 0], 0.5)]
    assert rets == [pytest.approx([0.6, 1.0]), pytest.approx([0.1, 0.0]), [0.0, 0.0]]
    keys = [anchor_keys(i, m) for i, m in zip(IDS, MASKS)]
    adv = step_group_advantages(rets, keys, ["g"] * 3)
    assert [a[0] for a in adv] == pytest.approx([1.140643, -0.414779, -0.725864], abs=1e-5)


def test_token_layout_and_combination():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 0, 0, 1, 1], [1, 0, 1, 0, 0, 0]])  # padded to 6
    tok = turn_token_advantages([[1.0, 0.5], [-1.0, -0.5], [-1.0, 0.0]], mask)
    assert tok.tolist() == [[1.0, 1.0, 0, 0, 0.5, 0], [-1.0, -1.0, 0, 0, -0.5, -0.5], [-1.0, 0, 0.0, 0, 0, 0]]
    outcome = torch.tensor([[0.8] * 6, [-0.4] * 6, [-0.4] * 6]) * mask
    both = combine_turn_advantages(outcome, tok, mask, weight=0.5)
    assert both[0].tolist() == pytest.approx([1.3, 1.3, 0, 0, 1.05, 0])
    assert both[2].tolist() == pytest.approx([-0.9, 0, -0.4, 0, 0, 0])


def test_doctests():
    assert doctest.testmod(turn_credit).failed == 0
