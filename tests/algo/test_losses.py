"""PPO policy/value losses, entropy and loss aggregation against hand-computed values; mask-0 tokens change
nothing, not even gradients."""
import math

import pytest
import torch

from megatron_searchr1.algo import (
    agg_loss, compute_entropy_loss, compute_policy_loss, compute_value_loss, entropy_from_logits,
)

NAN = float("nan")


def _log(*ratios):
    return torch.log(torch.tensor([list(ratios)]))


def test_policy_loss_standard_clip():
    old = torch.zeros(1, 4)
    new = _log(1.5, 0.5, 1.1, 0.9)
    adv = torch.tensor([[1.0, -1.0, 2.0, -2.0]])
    pg, clipfrac, ppo_kl, lower = compute_policy_loss(old, new, adv, torch.ones(1, 4), cliprange=0.2)
    # per token max(-A*r, -A*clip(r, .8, 1.2)):
    #   A=1,  r=1.5: max(-1.5, -1.2) = -1.2 (clipped)    A=-1, r=0.5: max(0.5, 0.8) = 0.8 (clipped)
    #   A=2,  r=1.1: max(-2.2, -2.2) = -2.2              A=-2, r=0.9: max(1.8, 1.8) = 1.8
    assert pg.item() == pytest.approx((-1.2 + 0.8 - 2.2 + 1.8) / 4)
    assert clipfrac.item() == pytest.approx(0.5)
    assert ppo_kl.item() == pytest.approx(-(math.log(1.5) + math.log(0.5) + math.log(1.1) + math.log(0.9)) / 4)
    assert lower.item() == 0.0


def test_dual_clip_bounds_negative_advantage_with_huge_ratio():
    old, new = torch.zeros(1, 2), _log(5.0, 5.0)
    adv = torch.tensor([[-1.0, 1.0]])
    # A=-1, r=5: max(5, 1.2) = 5, dual clip min(5, -A*c = 3) = 3.  A=1, r=5: max(-5, -1.2) = -1.2 (clipped)
    pg, clipfrac, _, lower = compute_policy_loss(old, new, adv, torch.ones(1, 2), cliprange=0.2, clip_ratio_c=3.0)
    assert pg.item() == pytest.approx((3.0 - 1.2) / 2)
    assert clipfrac.item() == pytest.approx(0.5)
    assert lower.item() == pytest.approx(0.5)
    pg, _, _, lower = compute_policy_loss(old, new, adv, torch.ones(1, 2), cliprange=0.2, clip_ratio_c=None)
    assert pg.item() == pytest.approx((5.0 - 1.2) / 2)
    assert lower.item() == 0.0
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        compute_policy_loss(old, new, adv, torch.ones(1, 2), cliprange=0.2, clip_ratio_c=1.0)


def test_separate_low_and_high_clip_ranges():
    old, new, m = torch.zeros(1, 2), _log(1.25, 0.75), torch.ones(1, 2)
    adv = torch.tensor([[1.0, -1.0]])
    # symmetric 0.2: -clip(1.25)= -1.2 and clip(0.75)=0.8 both clip
    pg, frac, _, _ = compute_policy_loss(old, new, adv, m, cliprange=0.2)
    assert (pg.item(), frac.item()) == (pytest.approx((-1.2 + 0.8) / 2), 1.0)
    # clip-higher 0.28 lets 1.25 through: -1.25; low 0.2 still clips 0.75 -> 0.8
    pg, frac, _, _ = compute_policy_loss(old, new, adv, m, cliprange=0.2, cliprange_high=0.28)
    assert (pg.item(), frac.item()) == (pytest.approx((-1.25 + 0.8) / 2), 0.5)
    # low 0.3 lets 0.75 through: 0.75; high 0.2 clips 1.25
    pg, frac, _, _ = compute_policy_loss(old, new, adv, m, cliprange=0.2, cliprange_low=0.3)
    assert (pg.item(), frac.item()) == (pytest.approx((-1.2 + 0.75) / 2), 0.5)
    pg, _, _, _ = compute_policy_loss(old, new, adv, m, cliprange=None, cliprange_low=0.3, cliprange_high=0.28)
    assert pg.item() == pytest.approx((-1.25 + 0.75) / 2)
    with pytest.raises(ValueError, match="needs cliprange"):
        compute_policy_loss(old, new, adv, m, cliprange=None)


def test_policy_loss_ignores_mask_zero_tokens_and_their_gradients():
    m = torch.tensor([[1, 0, 1], [0, 1, 1]])
    old = torch.tensor([[0.0, 0.0, -1.0], [0.0, -0.5, -0.2]])
    new = torch.tensor([[0.1, 0.0, -1.3], [0.0, -0.4, -0.1]], requires_grad=True)
    adv = torch.tensor([[1.0, 0.0, -0.5], [0.0, 2.0, 1.0]])
    outs = compute_policy_loss(old, new, adv, m, cliprange=0.2, loss_agg_mode="seq-mean-token-mean")
    outs[0].backward()
    grad = new.grad.clone()

    new2 = new.detach().clone()
    new2[~m.bool()] = torch.tensor([NAN, 40.0])
    old2, adv2 = old.clone(), adv.clone()
    old2[~m.bool()] = torch.tensor([-30.0, NAN])
    adv2[~m.bool()] = torch.tensor([1e9, NAN])
    new2.requires_grad_(True)
    outs2 = compute_policy_loss(old2, new2, adv2, m, cliprange=0.2, loss_agg_mode="seq-mean-token-mean")
    for a, b in zip(outs, outs2):
        torch.testing.assert_close(a, b)
    outs2[0].backward()
    assert (new2.grad[~m.bool()] == 0).all()
    torch.testing.assert_close(new2.grad, grad)


def test_value_loss_clipping_and_mask():
    vpreds = torch.tensor([[0.9, 2.0, 7.0]])
    values = torch.tensor([[0.0, 0.0, NAN]])
    returns = torch.tensor([[1.0, 0.0, -7.0]])
    m = torch.tensor([[1, 1, 0]])
    vf, frac = compute_value_loss(vpreds, returns, values, m, cliprange_value=0.2)
    # t0: (0.9-1)^2 = 0.01 vs clipped (0.2-1)^2 = 0.64 -> 0.64 (clipped wins)
    # t1: (2-0)^2 = 4 vs clipped (0.2-0)^2 = 0.04 -> 4; t2 masked. vf = 0.5 * (0.64 + 4) / 2
    assert vf.item() == pytest.approx(0.5 * 4.64 / 2)
    assert frac.item() == pytest.approx(0.5)
    vf_sum, _ = compute_value_loss(vpreds, returns, values, m, 0.2, loss_agg_mode="seq-mean-token-sum")
    assert vf_sum.item() == pytest.approx(0.5 * 4.64)


L = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
M = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # the third row is all observation/padding


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", (1 + 2 + 3 + 4) / 4),
    ("seq-mean-token-sum", (6 + 4) / 2),    # the empty row does not count as a sequence
    ("seq-mean-token-mean", (2 + 4) / 2),
])
def test_agg_modes(mode, expected):
    assert agg_loss(L, M, mode).item() == pytest.approx(expected)


def test_agg_denominator_lets_micro_batches_add_up():
    full = agg_loss(L, M, "token-mean")
    halves = [agg_loss(L[i:i + 1], M[i:i + 1], "token-mean", denominator=int(M.sum())) for i in range(3)]
    assert sum(h.item() for h in halves) == pytest.approx(full.item())
    rows = int(M.any(-1).sum())
    halves = [agg_loss(L[i:i + 1], M[i:i + 1], "seq-mean-token-mean", denominator=rows) for i in range(3)]
    assert sum(h.item() for h in halves) == pytest.approx(agg_loss(L, M, "seq-mean-token-mean").item())


def test_agg_errors_and_empty_mask():
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'; choose one of token-mean"):
        agg_loss(L, M, "mean")
    assert agg_loss(L, torch.zeros_like(M), "token-mean").item() == 0.0


def test_entropy_from_logits():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0], [100.0, 0.0, 0.0, 0.0]]])
    ent = entropy_from_logits(logits)
    p = torch.softmax(logits[0, 1], -1)
    assert ent.shape == (1, 3)
    assert ent[0, 0].item() == pytest.approx(math.log(4))
    assert ent[0, 1].item() == pytest.approx(-(p * p.log()).sum().item(), rel=1e-5)
    assert ent[0, 2].item() == pytest.approx(0.0, abs=1e-6)
    # the mean over generated tokens only: the third token (mask 0) does not count
    loss = compute_entropy_loss(logits, torch.tensor([[1, 1, 0]]))
    assert loss.item() == pytest.approx((ent[0, 0] + ent[0, 1]).item() / 2)


def test_seq_mean_token_sum_norm_divides_each_row_sum_by_a_constant():
    L = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, NAN, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    M = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    # rows with tokens: 0 (sum 6) and 1 (sum 4; the NaN is masked); row 2 has none and does not count
    assert agg_loss(L, M, "seq-mean-token-sum-norm", loss_scale_factor=8).item() == pytest.approx((6 / 8 + 4 / 8) / 2)
    # default constant: the padded width T = 4
    assert agg_loss(L, M, "seq-mean-token-sum-norm").item() == pytest.approx((6 / 4 + 4 / 4) / 2)
    # unlike seq-mean-token-mean, a short row is not up-weighted: row 1's token weighs 1/8 as each of row 0's
    assert agg_loss(L, M, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert agg_loss(L, M, "seq-mean-token-sum-norm", loss_scale_factor=8, denominator=4).item() == \
        pytest.approx((6 / 8 + 4 / 8) / 4)
    with pytest.raises(ValueError, match="loss_scale_factor must be > 0"):
        agg_loss(L, M, "seq-mean-token-sum-norm", loss_scale_factor=0)
