"""Advantage estimators against hand-computed values; whatever sits at mask-0 (retrieved) positions changes
nothing."""
import math
import statistics

import numpy as np
import pytest
import torch

from megatron_searchr1.algo import (
    compute_gae_advantage_return, compute_grpo_outcome_advantage, compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage, outcome_token_rewards,
)

NAN = float("nan")


def _whiten(xs):
    """Reference whitening of a plain list: mean 0, unbiased std 1."""
    mu, sd = statistics.mean(xs), statistics.stdev(xs)
    return [(x - mu) / sd for x in xs]


# One trajectory: two generated tokens, a two-token observation (mask 0), one generated token (the answer).
MASK = torch.tensor([[1, 1, 0, 0, 1]])
REWARDS = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]])
VALUES = torch.tensor([[0.1, 0.2, 5.0, -3.0, 0.4]])


def test_gae_steps_over_retrieved_tokens():
    adv, ret = compute_gae_advantage_return(REWARDS, VALUES, MASK, gamma=0.9, lam=0.8)
    # t=4: delta = 1 + 0 - 0.4 = 0.6;                      A4 = 0.6
    # t=1: next generated token is t=4 (V=0.4): delta = 0.9*0.4 - 0.2 = 0.16; A1 = 0.16 + 0.72*0.6 = 0.592
    # t=0: delta = 0.9*0.2 - 0.1 = 0.08;                   A0 = 0.08 + 0.72*0.592 = 0.50624
    raw = [0.50624, 0.592, 0.6]
    expected_ret = torch.tensor([[0.50624 + 0.1, 0.592 + 0.2, 0.0, 0.0, 0.6 + 0.4]])
    torch.testing.assert_close(ret, expected_ret)
    w = _whiten(raw)  # whitened over the three mask-1 tokens only
    torch.testing.assert_close(adv, torch.tensor([[w[0], w[1], 0.0, 0.0, w[2]]]), atol=1e-4, rtol=0)


def test_gae_ignores_anything_at_mask_zero():
    base = compute_gae_advantage_return(REWARDS, VALUES, MASK, 0.9, 0.8)
    rewards, values = REWARDS.clone(), VALUES.clone()
    rewards[0, 2:4] = torch.tensor([7.0, NAN])
    values[0, 2:4] = torch.tensor([NAN, 1e6])
    for out, ref in zip(compute_gae_advantage_return(rewards, values, MASK, 0.9, 0.8), base):
        torch.testing.assert_close(out, ref)


def test_gae_without_masked_tokens_is_plain_gae():
    # gamma = lam = 1: returns are rewards-to-go; mask all ones
    r = torch.tensor([[1.0, 0.0, 2.0]])
    v = torch.tensor([[0.5, 1.0, 1.5]])
    adv, ret = compute_gae_advantage_return(r, v, torch.ones(1, 3), gamma=1.0, lam=1.0)
    torch.testing.assert_close(ret, torch.tensor([[3.0, 2.0, 2.0]]))
    torch.testing.assert_close(adv, torch.tensor([_whiten([2.5, 1.0, 0.5])]), atol=1e-4, rtol=0)


def test_gae_trailing_padding_and_batch_rows_independent():
    # row 0: as above plus one padding token; row 1: a single-token answer then padding
    r = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0], [2.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    v = torch.tensor([[0.1, 0.2, 5.0, -3.0, 0.4, 9.0], [0.5, 9.0, 9.0, 9.0, 9.0, 9.0]])
    m = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0]])
    adv, ret = compute_gae_advantage_return(r, v, m, gamma=0.9, lam=0.8)
    # row 1: delta = 2 - 0.5 = 1.5 (nothing follows); return 2
    torch.testing.assert_close(ret[1], torch.tensor([2.0, 0, 0, 0, 0, 0]))
    torch.testing.assert_close(ret[0, :5], torch.tensor([0.60624, 0.792, 0.0, 0.0, 1.0]))
    w = _whiten([0.50624, 0.592, 0.6, 1.5])  # whitening pools the batch's mask-1 tokens
    torch.testing.assert_close(adv[m.bool()], torch.tensor(w), atol=1e-4, rtol=0)
    assert (adv[~m.bool()] == 0).all() and (ret[~m.bool()] == 0).all()


def test_outcome_token_rewards_on_last_generated_token():
    m = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1]])
    out = outcome_token_rewards(torch.tensor([1.0, 0.5, 3.0, -1.0]), m)
    expected = torch.tensor([
        [0.0, 1.0, 0.0, 0.0],   # ends with an observation: the reward goes to the last generated token
        [0.0, 0.0, 0.0, 0.5],
        [0.0, 0.0, 0.0, 0.0],   # nothing generated: nothing to credit
        [0.0, 0.0, 0.0, -1.0],
    ])
    torch.testing.assert_close(out, expected)
    assert outcome_token_rewards(np.array([2.0]), torch.tensor([[True, False]])).tolist() == [[2.0, 0.0]]
    with pytest.raises(ValueError, match="got 3 scores for 4 rows"):
        outcome_token_rewards([1.0, 2.0, 3.0], m)


# GRPO: group "a" scores 1, 0, 0; group "b" scores 2, 2; group "c" a single row scoring 0.5.
GROUP_SCORES = [1.0, 0.0, 0.0, 2.0, 2.0, 0.5]
GROUP_IDS = ["a", "a", "a", "b", "b", "c"]
GMASK = torch.tensor([[1, 1, 1], [1, 0, 1], [1, 1, 0], [1, 1, 1], [0, 1, 1], [1, 1, 1]])


def _group_batch():
    return outcome_token_rewards(GROUP_SCORES, GMASK), GMASK


def test_grpo_hand_computed():
    r, m = _group_batch()
    adv, ret = compute_grpo_outcome_advantage(r, m, GROUP_IDS)
    # a: mean 1/3, unbiased std sqrt(((2/3)^2 + 2*(1/3)^2)/2) = sqrt(1/3); b: std 0 -> 0; c: alone: 0.5 / 1
    sd = math.sqrt(1 / 3)
    per_row = torch.tensor([(2 / 3) / sd, (-1 / 3) / sd, (-1 / 3) / sd, 0.0, 0.0, 0.5])
    torch.testing.assert_close(adv, per_row[:, None] * m, atol=1e-5, rtol=0)
    assert ret is adv
    adv_dr, _ = compute_grpo_outcome_advantage(r, m, GROUP_IDS, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(adv_dr, torch.tensor([2 / 3, -1 / 3, -1 / 3, 0, 0, 0.5])[:, None] * m)


@pytest.mark.parametrize("index", [
    np.array(GROUP_IDS, dtype=object),
    [10, 10, 10, 20, 20, 30],
    torch.tensor([10, 10, 10, 20, 20, 30]),  # grouped by value, not by tensor identity
    np.array([10, 10, 10, 20, 20, 30]),
])
def test_grpo_index_types(index):
    r, m = _group_batch()
    torch.testing.assert_close(compute_grpo_outcome_advantage(r, m, index)[0],
                               compute_grpo_outcome_advantage(r, m, GROUP_IDS)[0])


def test_grpo_and_rloo_ignore_mask_zero_rewards():
    r, m = _group_batch()
    noisy = r.clone()
    noisy[~m.bool()] = 100.0
    for fn in (compute_grpo_outcome_advantage, compute_rloo_outcome_advantage):
        torch.testing.assert_close(fn(noisy, m, GROUP_IDS)[0], fn(r, m, GROUP_IDS)[0])
        assert (fn(noisy, m, GROUP_IDS)[0][~m.bool()] == 0).all()


def test_group_index_length_must_match():
    r, m = _group_batch()
    with pytest.raises(ValueError, match="index has 5 group ids for 6 rows"):
        compute_grpo_outcome_advantage(r, m, GROUP_IDS[:5])


def test_rloo_leave_one_out_baseline():
    r, m = _group_batch()
    adv, ret = compute_rloo_outcome_advantage(r, m, GROUP_IDS)
    # a: 1 - (0+0)/2 = 1; 0 - (1+0)/2 = -0.5 (twice); b: 2 - 2 = 0; c: alone keeps 0.5
    torch.testing.assert_close(adv, torch.tensor([1.0, -0.5, -0.5, 0.0, 0.0, 0.5])[:, None] * m)
    assert ret is adv


def test_reinforce_plus_plus_steps_over_retrieved_tokens():
    r = torch.tensor([[0.0, 0.0, 5.0, 1.0]])
    m = torch.tensor([[1, 1, 0, 1]])
    adv, ret = compute_reinforce_plus_plus_outcome_advantage(r, m, gamma=0.5)
    # G3 = 1; G1 = 0 + 0.5 * G3 (the observation is skipped, its 5 ignored) = 0.5; G0 = 0.25
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.5, 0.0, 1.0]]))
    w = _whiten([0.25, 0.5, 1.0])
    torch.testing.assert_close(adv, torch.tensor([[w[0], w[1], 0.0, w[2]]]), atol=1e-4, rtol=0)
    r2 = r.clone()
    r2[0, 2] = NAN
    torch.testing.assert_close(compute_reinforce_plus_plus_outcome_advantage(r2, m, gamma=0.5)[0], adv)
