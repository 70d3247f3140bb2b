"""KL estimators, the fixed/adaptive coefficient controllers (update and checkpoint round trip), KL as a reward
penalty over generated tokens only."""
import math

import pytest
import torch

from megatron_searchr1.algo import AdaptiveKLController, FixedKLController, apply_kl_penalty, kl_penalty

LP = torch.tensor([[0.0, -1.0, -2.0]])
REF = torch.tensor([[-1.0, -1.0, -0.5]])  # logprob - ref = [1, 0, -1.5]


def test_each_kl_kind():
    torch.testing.assert_close(kl_penalty(LP, REF, "kl"), torch.tensor([[1.0, 0.0, -1.5]]))
    torch.testing.assert_close(kl_penalty(LP, REF, "abs"), torch.tensor([[1.0, 0.0, 1.5]]))
    torch.testing.assert_close(kl_penalty(LP, REF, "mse"), torch.tensor([[0.5, 0.0, 1.125]]))
    # k3 with d = ref - logprob = [-1, 0, 1.5]: e^d - d - 1
    k3 = [math.exp(-1) + 1 - 1, 0.0, math.exp(1.5) - 1.5 - 1]
    torch.testing.assert_close(kl_penalty(LP, REF, "low_var_kl"), torch.tensor([k3]))
    for alias, kind in (("k1", "kl"), ("k2", "mse"), ("k3", "low_var_kl")):
        torch.testing.assert_close(kl_penalty(LP, REF, alias), kl_penalty(LP, REF, kind))


def test_low_var_kl_is_clamped():
    lp = torch.tensor([0.0, 30.0, 0.0])
    ref = torch.tensor([30.0, 0.0, 0.0])
    # d = 30 -> clamped to 20 before the exp, e^20 - 21 -> clamped to 10; d = -30 -> -20: e^-20 + 19 -> 10
    torch.testing.assert_close(kl_penalty(lp, ref, "low_var_kl"), torch.tensor([10.0, 10.0, 0.0]))
    assert torch.isfinite(kl_penalty(torch.tensor([0.0]), torch.tensor([1e4]), "low_var_kl")).all()


def test_unknown_kl_kind():
    with pytest.raises(ValueError, match="unknown kl_penalty 'full'; choose one of kl, abs, mse, low_var_kl"):
        kl_penalty(LP, REF, "full")


def test_fixed_controller():
    c = FixedKLController(0.001)
    c.update(current_kl=5.0, n_steps=512)
    assert c.value == 0.001


def test_adaptive_controller_update():
    c = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.5, horizon=100)
    c.update(current_kl=0.6, n_steps=50)   # error 0.6/0.5 - 1 = 0.2: x (1 + 0.2 * 50/100) = 1.1
    assert c.value == pytest.approx(0.11)
    c.update(current_kl=0.45, n_steps=100)  # error -0.1: x 0.9
    assert c.value == pytest.approx(0.099)
    c.update(current_kl=50.0, n_steps=100)  # error clipped to 0.2: x 1.2
    assert c.value == pytest.approx(0.1188)
    c.update(current_kl=0.0, n_steps=100)   # error clipped to -0.2: x 0.8
    assert c.value == pytest.approx(0.09504)


def test_controllers_checkpoint_round_trip():
    a = AdaptiveKLController(0.1, target_kl=0.5, horizon=100)
    a.update(0.6, 50)
    b = AdaptiveKLController(0.1, target_kl=0.5, horizon=100)
    b.load_state_dict(a.state_dict())
    assert b.value == a.value and b.value != 0.1
    a.update(0.3, 10)
    b.update(0.3, 10)
    assert b.value == a.value
    f = FixedKLController(0.2)
    g = FixedKLController(0.0)
    g.load_state_dict(f.state_dict())
    assert g.value == 0.2


@pytest.mark.parametrize("kwargs, what", [(dict(target_kl=0.0, horizon=10), "target_kl"),
                                          (dict(target_kl=0.1, horizon=0), "horizon")])
def test_adaptive_controller_rejects_bad_settings(kwargs, what):
    with pytest.raises(ValueError, match=what):
        AdaptiveKLController(0.1, **kwargs)


def test_apply_kl_penalty_over_generated_tokens():
    scores = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    old = torch.tensor([[0.2, 9.0, 9.0, 0.4], [0.1, 0.3, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
    ref = torch.zeros(3, 4)
    m = torch.tensor([[1, 0, 0, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
    ctrl = AdaptiveKLController(0.5, target_kl=1.0, horizon=10)
    rewards, current_kl = apply_kl_penalty(scores, old, ref, m, ctrl, kl_penalty="kl")
    # beta 0.5: row 0: [-0.1, 0, 0, 1 - 0.2]; row 1: [-0.05, 0.5 - 0.15, 0, 0]; row 2 has no generated token
    torch.testing.assert_close(rewards, torch.tensor([[-0.1, 0, 0, 0.8], [-0.05, 0.35, 0, 0], [0.0, 0, 0, 0]]))
    # per-row mean KL: (0.2+0.4)/2 = 0.3, (0.1+0.3)/2 = 0.2; the empty row does not count
    assert current_kl == pytest.approx(0.25)
    assert ctrl.value == 0.5  # the trainer updates the controller after averaging KL over data-parallel ranks

    old2 = old.clone()
    old2[~m.bool()] = float("nan")
    rewards2, kl2 = apply_kl_penalty(scores, old2, ref, m, ctrl, kl_penalty="kl")
    torch.testing.assert_close(rewards2, rewards)
    assert kl2 == pytest.approx(current_kl)
