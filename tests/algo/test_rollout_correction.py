"""Rollout correction weights and masks against hand-computed values and verl's recorded weights; retrieved
(mask-0) tokens have no ratio and change nothing."""
import json
import math
from pathlib import Path

import pytest
import torch

from megatron_searchr1.algo.rollout_correction import (
    ROLLOUT_CORRECTIONS, compute_rollout_correction, mismatch_kl,
)

NAN = float("nan")
VERL = json.loads((Path(__file__).parent / "data" / "verl_reference.json").read_text())


def _lp(*ratios):  # log-probs whose ratio to a behaviour log-prob of 0 is `ratios`
    return torch.log(torch.tensor([list(ratios)]))


def test_token_tis_truncates_at_the_cap():
    prox, beh = _lp(3.0, 1.5, 0.25, 1.0), torch.tensor([[0.0, 0.0, 0.0, NAN]])
    mask = torch.tensor([[1, 1, 1, 0]])
    w, keep, m = compute_rollout_correction(prox, beh, mask, "token_tis", cap=2.0)
    assert w.tolist() == [pytest.approx([2.0, 1.5, 0.25, 0.0])]  # min(r, 2); the retrieved token gets 0
    assert keep.tolist() == [[True, True, True, False]]
    assert m["clipped_frac"].item() == pytest.approx(1 / 3) and m["masked_frac"].item() == 0
    assert (m["ratio_min"].item(), m["ratio_max"].item()) == (pytest.approx(0.25), pytest.approx(3.0))
    assert m["ratio_mean"].item() == pytest.approx((3.0 + 1.5 + 0.25) / 3)
    # k3 over the 3 sampled tokens: r - ln r - 1 = (3 - ln3 - 1) + (1.5 - ln1.5 - 1) + (.25 - ln.25 - 1)
    k3 = (2 - math.log(3)) + (0.5 - math.log(1.5)) + (-0.75 + math.log(4))
    assert m["mismatch_kl"].item() == pytest.approx(k3 / 3)


def test_seq_tis_uses_the_product_over_generated_tokens_only():
    prox = torch.log(torch.tensor([[1.5, 99.0, 1.2], [0.5, 0.5, 1.0]]))
    beh = torch.zeros(2, 3)
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]])
    w, keep, m = compute_rollout_correction(prox, beh, mask, "seq_tis", cap=1.5)
    # row 0: 1.5 * 1.2 = 1.8 (the 99 is a retrieved token) -> capped at 1.5; row 1: 0.5 * 0.5 = 0.25
    assert w.tolist() == [pytest.approx([1.5, 0.0, 1.5]), pytest.approx([0.25, 0.25, 0.0])]
    assert m["clipped_frac"].item() == pytest.approx(2 / 4)  # row 0's two tokens of four
    assert (m["ratio_min"].item(), m["ratio_max"].item()) == (pytest.approx(0.25), pytest.approx(1.8))


def test_mis_masks_outside_the_band_and_keeps_the_ratio_inside():
    prox, beh, mask = _lp(3.0, 1.5, 0.25), torch.zeros(1, 3), torch.ones(1, 3)
    w, keep, m = compute_rollout_correction(prox, beh, mask, "token_mis", cap=2.0)  # band [1/2, 2] (verl: 1/upper)
    assert w.tolist() == [pytest.approx([0.0, 1.5, 0.0])] and keep.tolist() == [[False, True, False]]
    assert m["masked_frac"].item() == pytest.approx(2 / 3) and m["clipped_frac"].item() == 0
    w, keep, m = compute_rollout_correction(prox, beh, mask, "token_mis", cap=2.0, low=0.0)  # only an upper bound
    assert w.tolist() == [pytest.approx([0.0, 1.5, 0.25])] and keep.tolist() == [[False, True, True]]
    w, keep, _ = compute_rollout_correction(prox, beh, mask, "token_mis", low=0.5, high=4.0)
    assert keep.tolist() == [[True, True, False]] and w.tolist() == [pytest.approx([3.0, 1.5, 0.0])]
    w, keep, _ = compute_rollout_correction(prox, beh, mask, "icepop")  # IcePop's band [0.5, 2]
    assert keep.tolist() == [[False, True, False]] and w.tolist() == [pytest.approx([0.0, 1.5, 0.0])]
    prox2 = torch.log(torch.tensor([[1.5, 1.5], [1.1, 1.0]]))  # sequence ratios 2.25 and 1.1
    w, keep, m = compute_rollout_correction(prox2, torch.zeros(2, 2), torch.ones(2, 2), "seq_mis", cap=2.0)
    assert keep.tolist() == [[False, False], [True, True]] and w.tolist() == [[0, 0], pytest.approx([1.1, 1.1])]
    assert m["masked_frac"].item() == pytest.approx(0.5)


def test_geo_mask_drops_sequences_whose_geometric_mean_ratio_leaves_the_band():
    # with the band [0.99, 1.01]:
    # row 0: log-ratios +0.02, -0.01 -> mean 0.005, exp = 1.00501 inside [0.99, 1.01]: kept, weight 1
    # row 1: +0.03, +0.01 -> mean 0.02, exp = 1.0202: masked; its product 1.0408 would pass a TIS cap of 2
    # row 2: mean over its one generated token (-0.005) = 0.995: kept (the retrieved 3.0 is not looked at)
    prox = torch.tensor([[0.02, -0.01], [0.03, 0.01], [-0.005, 3.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]])
    w, keep, m = compute_rollout_correction(prox, torch.zeros(3, 2), mask, "geo_mask", low=0.99, high=1.01)
    assert keep.tolist() == [[True, True], [False, False], [True, False]]
    assert w.tolist() == [[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]]
    assert m["masked_frac"].item() == pytest.approx(2 / 5)
    assert m["ratio_max"].item() == pytest.approx(math.exp(0.02))
    assert m["ratio_min"].item() == pytest.approx(math.exp(-0.005))


@pytest.mark.parametrize("mode", ROLLOUT_CORRECTIONS)
def test_retrieved_tokens_change_nothing_and_weights_are_detached(mode):
    mask = torch.tensor([[1, 0, 1, 1]])
    beh = torch.tensor([[-1.0, 0.0, -0.5, -2.0]])
    outs = []
    for junk in (NAN, -40.0):
        prox = torch.tensor([[-1.001, junk, -0.499, -2.0]], requires_grad=True)
        w, keep, m = compute_rollout_correction(prox, beh, mask, mode)
        assert not w.requires_grad and w[0, 1] == 0 and not keep[0, 1]
        outs.append((w.tolist(), keep.tolist(), {k: v.item() for k, v in m.items()}))
    assert outs[0] == outs[1]


def test_none_gives_unit_weights_and_still_measures_the_gap():
    prox, beh = torch.tensor([[0.0, -1.0]]), torch.tensor([[0.0, -1.5]])
    w, keep, m = compute_rollout_correction(prox, beh, torch.tensor([[1, 1]]), "none")
    assert w.tolist() == [[1.0, 1.0]] and keep.all()
    r = math.exp(0.5)  # token 2: r = exp(-1 + 1.5)
    assert m["mismatch_kl"].item() == pytest.approx((0 + r - 0.5 - 1) / 2)


def test_matches_verl_truncated_is_weights_and_k3():
    t = {k: torch.tensor(VERL[k], dtype=torch.float64) for k in ("old_log_prob", "engine_log_prob", "response_mask")}
    for mode, level in (("token_tis", "is_token"), ("seq_tis", "is_sequence")):
        w, _, _ = compute_rollout_correction(t["old_log_prob"], t["engine_log_prob"], t["response_mask"], mode,
                                             cap=VERL["cases"][level]["cap"])
        assert w.tolist() == [pytest.approx(row, rel=1e-9) for row in VERL["cases"][level]["weights"]]
    k3 = mismatch_kl(t["old_log_prob"], t["engine_log_prob"], t["response_mask"])
    assert k3.item() == pytest.approx(VERL["cases"]["k3_kl"], rel=1e-6)


def test_bad_arguments_are_refused():
    x, m = torch.zeros(1, 2), torch.ones(1, 2)
    with pytest.raises(ValueError, match="choose one of none, token_tis"):
        compute_rollout_correction(x, x, m, "tis")
    with pytest.raises(ValueError, match="cap must be > 0"):
        compute_rollout_correction(x, x, m, "token_tis", cap=0)
    with pytest.raises(ValueError, match="0 <= low < high"):
        compute_rollout_correction(x, x, m, "icepop", low=2.0, high=0.5)


def test_default_bands_are_verls():
    """MIS's lower bound defaults to 1/upper (verl's rejection sampling; slime's 0.5 at an upper 2), the geometric
    band to verl's 0.1 %: on main the MIS band was [0, cap] and the geometric one [0.99, 1.01]."""
    prox, beh, mask = _lp(0.4, 1.0, 1.9), torch.zeros(1, 3), torch.ones(1, 3)
    _, keep, _ = compute_rollout_correction(prox, beh, mask, "token_mis", cap=2.0)
    assert keep.tolist() == [[False, True, True]]  # 0.4 < 1/2
    _, keep, _ = compute_rollout_correction(prox, beh, mask, "token_mis", cap=2.0, high=4.0)
    assert keep.tolist() == [[True, True, True]]  # band [1/4, 4]
    # a geometric-mean ratio of 1.005 (0.5 % per token) passes a 1 % band, not verl's 0.1 %
    geo = torch.full((1, 4), 0.005)
    _, keep, _ = compute_rollout_correction(geo, torch.zeros(1, 4), torch.ones(1, 4), "geo_mask")
    assert keep.tolist() == [[False] * 4]
    _, keep, _ = compute_rollout_correction(geo / 10, torch.zeros(1, 4), torch.ones(1, 4), "geo_mask")
    assert keep.tolist() == [[True] * 4]
