"""GSPO / CISPO / PPO policy losses by name against hand-computed values and gradients; mask-0 tokens change
nothing; the same numbers as verl's functions on a recorded batch (data/verl_reference.json)."""
import json
import math
from pathlib import Path

import pytest
import torch

from megatron_searchr1.algo.losses import agg_loss, compute_policy_loss
from megatron_searchr1.algo.policy_losses import (
    POLICY_LOSSES, compute_policy_loss_cispo, compute_policy_loss_gspo, compute_policy_loss_ppo, policy_loss_fn,
)

NAN = float("nan")
VERL = json.loads((Path(__file__).parent / "data" / "verl_reference.json").read_text())


def test_gspo_one_ratio_per_sequence_clipped_in_sequence_space():
    old = torch.zeros(2, 3)
    new = torch.tensor([[0.002, 0.0, NAN], [-0.0002, 0.0002, 7.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    adv = torch.tensor([[1.0, 1.0, 5.0], [-1.0, -1.0, 5.0]])
    loss, m = compute_policy_loss_gspo(old, new, adv, mask)  # paper's ranges 3e-4 / 4e-4
    # row 0: s = exp((0.002 + 0) / 2) = exp(0.001) = 1.0010005 > 1.0004, A = +1: max(-1.0010, -1.0004) = -1.0004
    #        clipped: no gradient.
    # row 1: s = exp((-0.0002 + 0.0002) / 2) = 1, A = -1: loss +1 at each token, unclipped
    # seq-mean-token-mean: (mean(-1.0004, -1.0004) + mean(1, 1)) / 2 = -0.0002
    assert loss.item() == pytest.approx(-0.0002, abs=1e-7)
    assert m["pg_clipfrac"].item() == pytest.approx(2 / 4)
    assert m["ratio_max"].item() == pytest.approx(math.exp(0.001))
    assert m["ratio_min"].item() == pytest.approx(1.0)
    loss.backward()
    # d/dlogp_t of (1/B)(1/|G_i|) * (-A * s_i,t) with ds_i,t/dlogp_t = s_i: row 1: -(-1) * 1 / (2 * 2) = 0.25
    assert torch.equal(new.grad, torch.tensor([[0.0, 0.0, 0.0], [0.25, 0.25, 0.0]]))


def test_gspo_gradient_of_an_unclipped_sequence_is_the_sequence_ratio_on_every_token():
    old = torch.tensor([[0.0, 0.0, 0.0]])
    new = torch.tensor([[0.3, -0.1, 0.1]], requires_grad=True)
    loss, _ = compute_policy_loss_gspo(old, new, torch.full((1, 3), 2.0), torch.ones(1, 3),
                                       clip_ratio_low=0.5, clip_ratio_high=0.5)
    s = math.exp((0.3 - 0.1 + 0.1) / 3)  # exp(0.1) = 1.10517, inside [0.5, 1.5]
    assert loss.item() == pytest.approx(-2.0 * s)  # one row, token mean of -A*s
    loss.backward()
    assert new.grad[0].tolist() == pytest.approx([-2.0 * s / 3] * 3)  # not the token's own ratio exp(0.3) etc.


def test_gspo_equals_ppo_without_dual_clip_when_every_response_is_one_token():
    old = torch.zeros(3, 2)
    new = torch.tensor([[0.4, NAN], [-0.5, NAN], [0.05, NAN]])
    mask = torch.tensor([[1, 0], [1, 0], [1, 0]])
    adv = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [1.0, 0.0]])
    gspo, _ = compute_policy_loss_gspo(old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    ppo, _, _, _ = compute_policy_loss(old, new, adv, mask, cliprange=0.2, clip_ratio_c=None,
                                       loss_agg_mode="seq-mean-token-mean")
    # by hand: -min(e^.4=1.49, 1.2) = -1.2; max(e^-.5=.607, .8) = .8; -e^.05 = -1.0513
    assert gspo.item() == pytest.approx(ppo.item()) == pytest.approx((-1.2 + 0.8 - math.exp(0.05)) / 3)


def test_cispo_clips_the_detached_weight_and_keeps_the_gradient_of_clipped_tokens():
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[2.0, 0.5, 1.0]])).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    loss, m = compute_policy_loss_cispo(old, new, adv, torch.ones(1, 3), clip_ratio_high=0.2)
    # w = sg(clip(r, -, 1.2)) = (1.2, 0.5, 1.0) (no lower bound); loss_t = -w * A * logp:
    #   -1.2 * ln 2 = -0.8318;  -0.5 * ln 0.5 = 0.3466;  -1.0 * -1 * ln 1 = 0;  token mean over 3
    assert loss.item() == pytest.approx((-1.2 * math.log(2) + 0.5 * math.log(2) + 0.0) / 3)
    assert m["pg_clipfrac"].item() == pytest.approx(1 / 3)
    assert (m["ratio_min"].item(), m["ratio_max"].item()) == (pytest.approx(0.5), pytest.approx(2.0))
    loss.backward()
    # d/dlogp = -w * A / 3: the clipped first token still pushes up, with weight 1.2 (PPO would give it 0)
    assert new.grad[0].tolist() == pytest.approx([-1.2 / 3, -0.5 / 3, 1.0 / 3])
    loss, m = compute_policy_loss_cispo(old, new, adv, torch.ones(1, 3), clip_ratio_low=0.2, clip_ratio_high=0.2)
    # with a lower bound 0.8: w = (1.2, 0.8, 1.0): -(1.2 ln 2 - 0.8 ln 2) / 3
    assert loss.item() == pytest.approx(-(1.2 - 0.8) * math.log(2) / 3)
    assert m["pg_clipfrac"].item() == pytest.approx(2 / 3)


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_mask_zero_tokens_change_nothing_not_even_gradients(name):
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 0, 1]])
    adv = torch.tensor([[1.0, 9.0, -0.5]])
    kw = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}
    results = []
    for junk in (NAN, 123.0):
        new = torch.tensor([[-0.9, junk, -1.2]], requires_grad=True)
        loss, metrics = policy_loss_fn(name)(old, new, adv, mask, **kw, clip_ratio_c=3.0 if name == "ppo" else None)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(new.grad).all() and new.grad[0, 1] == 0
        results.append((loss.item(), new.grad.tolist(), {k: v.item() for k, v in metrics.items()}))
    assert results[0] == results[1]


def test_ppo_by_name_is_compute_policy_loss_and_rollout_weights_scale_each_token():
    old = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[1.5, 0.9]]))
    adv = torch.tensor([[1.0, -1.0]])
    loss, m = compute_policy_loss_ppo(old, new, adv, torch.ones(1, 2), clip_ratio_low=0.2, clip_ratio_high=0.2)
    ref = compute_policy_loss(old, new, adv, torch.ones(1, 2), cliprange=0.2)
    assert (loss.item(), m["pg_clipfrac"].item(), m["ppo_kl"].item()) == (ref[0].item(), ref[1].item(), ref[2].item())
    w = torch.tensor([[0.5, 2.0]])
    loss, _ = compute_policy_loss_ppo(old, new, adv, torch.ones(1, 2), rollout_is_weights=w)
    # token 1: -min(1.5, 1.2) = -1.2, times 0.5; token 2: max(0.9, 0.9) = 0.9, times 2
    assert loss.item() == pytest.approx((-1.2 * 0.5 + 0.9 * 2.0) / 2)


def test_unknown_names_and_dual_clip_are_refused():
    with pytest.raises(ValueError, match="choose one of ppo, gspo, cispo"):
        policy_loss_fn("grpo")
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="GSPO has no dual clip"):
        compute_policy_loss_gspo(x, x, x, torch.ones(1, 1), clip_ratio_c=3.0)
    with pytest.raises(ValueError, match="CISPO has no dual clip"):
        compute_policy_loss_cispo(x, x, x, torch.ones(1, 1), clip_ratio_high=0.2, clip_ratio_c=3.0)


def _verl_batch(requires_grad=False):
    t = {k: torch.tensor(VERL[k], dtype=torch.float64)
         for k in ("old_log_prob", "log_prob", "advantages", "response_mask")}
    t["log_prob"].requires_grad_(requires_grad)
    return t["old_log_prob"], t["log_prob"], t["advantages"], t["response_mask"]


def test_ppo_matches_verl():
    case = VERL["cases"]["ppo"]
    old, new, adv, mask = _verl_batch()
    loss, m = compute_policy_loss_ppo(old, new, adv, mask, clip_ratio_low=case["clip_ratio_low"],
                                      clip_ratio_high=case["clip_ratio_high"], clip_ratio_c=case["clip_ratio_c"])
    assert loss.item() == pytest.approx(case["loss"], rel=1e-6)
    assert m["pg_clipfrac"].item() == pytest.approx(case["pg_clipfrac"], rel=1e-6)


@pytest.mark.parametrize("name", ["gspo", "cispo"])
def test_gspo_and_cispo_match_verl_in_value_and_gradient(name):
    case = VERL["cases"][name]
    old, new, adv, mask = _verl_batch(requires_grad=True)
    loss, m = policy_loss_fn(name)(old, new, adv, mask, clip_ratio_low=case["clip_ratio_low"],
                                   clip_ratio_high=case["clip_ratio_high"])
    assert loss.item() == pytest.approx(case["loss"], rel=1e-6)
    assert m["pg_clipfrac"].item() == pytest.approx(case["pg_clipfrac"], rel=1e-6)
    assert 0 < case["pg_clipfrac"] < 1  # the recorded batch exercises both clipped and unclipped tokens
    loss.backward()
    assert new.grad.tolist() == [pytest.approx(row, rel=1e-6, abs=1e-12) for row in case["grad"]]


def test_seq_mean_token_sum_norm_matches_verl_up_to_its_sum_over_rows():
    case = VERL["cases"]["seq_mean_token_sum_norm"]
    _, new, adv, mask = _verl_batch()
    ours = agg_loss(new * adv, mask, "seq-mean-token-sum-norm", loss_scale_factor=case["loss_scale_factor"])
    # verl divides the sum over all rows by the constant; here the rows are averaged (4 rows, all with tokens)
    assert ours.item() == pytest.approx(case["verl_sum"] / 4, rel=1e-9)
