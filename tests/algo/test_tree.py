"""Tree-GRPO's advantages and the shared-prefix weights on hand-built trees, against hand-computed values."""
import math

import pytest
import torch

from megatron_searchr1 import algo
from megatron_searchr1.algo.tree import (
    compute_tree_grpo_outcome_advantage, segment_owners, shared_token_counts, shared_token_weights,
    weighted_advantages,
)


def _rewards(scores, T=3):
    mask = torch.ones(len(scores), T)
    return algo.outcome_token_rewards(scores, mask), mask


def test_inter_plus_intra_on_two_trees_matches_hand_values():
    # one prompt, two trees of three leaves: tree A scores 1, 0, 1; tree B scores 0, 0, 1
    rewards, mask = _rewards([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    adv, inter, intra = compute_tree_grpo_outcome_advantage(rewards, mask, ["q"] * 6, ["A"] * 3 + ["B"] * 3)
    # inter: mean 1/2 over six leaves, unbiased std sqrt(6 * 1/4 / 5) = sqrt(0.3)
    s = math.sqrt(0.3)
    want_inter = [0.5 / s, -0.5 / s, 0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s]
    # intra A: mean 2/3, std sqrt((1/9 + 4/9 + 1/9) / 2) = sqrt(1/3); B: mean 1/3, same std
    t = math.sqrt(1 / 3)
    want_intra = [(1 / 3) / t, (-2 / 3) / t, (1 / 3) / t, (-1 / 3) / t, (-1 / 3) / t, (2 / 3) / t]
    assert inter[:, 0].tolist() == pytest.approx(want_inter, abs=1e-5)
    assert intra[:, 0].tolist() == pytest.approx(want_intra, abs=1e-5)
    assert adv[:, 0].tolist() == pytest.approx([a + b for a, b in zip(want_inter, want_intra)], abs=1e-5)
    assert adv[:, 0].tolist() == pytest.approx([1.4903, -2.0676, 1.4903, -1.4903, -1.4903, 2.0676], abs=1e-4)
    # the advantage covers every token of the row (the outcome spread over the response)
    assert torch.equal(adv[:, 0:1].expand(-1, 3), adv)


def test_the_repository_definition_is_two_grpo_calls_added():
    # AMAP-ML/Tree-GRPO's `tree` estimator: verl GRPO with the prompt's uid plus verl GRPO with the tree's uid
    torch.manual_seed(0)
    scores = torch.randint(0, 2, (12,)).float() + torch.rand(12) * 0.1
    rewards, mask = _rewards(scores.tolist(), T=4)
    mask[3, 2:] = 0  # an observation in one row: nothing there
    rewards = algo.outcome_token_rewards(scores.tolist(), mask)
    index = ["p"] * 6 + ["r"] * 6
    trees = ["p0", "p0", "p0", "p1", "p1", "p1", "r0", "r0", "r1", "r1", "r1", "r1"]
    adv, inter, intra = compute_tree_grpo_outcome_advantage(rewards, mask, index, trees)
    want_inter, _ = algo.compute_grpo_outcome_advantage(rewards, mask, index)
    want_intra, _ = algo.compute_grpo_outcome_advantage(rewards, mask, trees)
    assert torch.allclose(inter, want_inter) and torch.allclose(intra, want_intra)
    assert torch.allclose(adv, want_inter + want_intra)
    assert float(adv[3, 2:].abs().sum()) == 0.0


def test_a_tree_of_one_leaf_gets_its_score_or_zero():
    rewards, mask = _rewards([1.0, 0.0, 1.0])
    _, _, intra = compute_tree_grpo_outcome_advantage(rewards, mask, ["q"] * 3, ["a", "b", "b"])
    assert intra[0, 0].item() == 1.0  # verl: a group of one has mean 0, std 1
    _, _, intra = compute_tree_grpo_outcome_advantage(rewards, mask, ["q"] * 3, ["a", "b", "b"],
                                                      single_group_zero=True)
    assert intra[0, 0].item() == 0.0 and intra[1, 0].item() == pytest.approx(-0.7071, abs=1e-4)


def test_no_std_normalisation():
    rewards, mask = _rewards([1.0, 0.0, 0.0, 0.0])
    adv, inter, intra = compute_tree_grpo_outcome_advantage(rewards, mask, ["q"] * 4, ["a", "a", "b", "b"],
                                                            norm_adv_by_std_in_grpo=False)
    assert inter[:, 0].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])
    assert intra[:, 0].tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0])


# A hand-built tree of three leaves: leaf 0 is the first chain (10 response tokens); leaf 1 forked from leaf 0's
# node at 4 tokens and has 9; leaf 2 forked from leaf 1's node at 6 tokens and has 10. A second tree (leaf 7)
# holds one chain of 5 tokens.
SEGMENTS = [[(0, 99)], [(0, 4), (1, 99)], [(0, 4), (1, 6), (2, 99)], [(7, 99)]]
LENGTHS = [10, 9, 10, 5]
TREES = ["t", "t", "t", "u"]


def test_owners_and_counts_of_a_hand_built_tree():
    owners = segment_owners(SEGMENTS, LENGTHS)
    assert owners[0].tolist() == [0] * 10
    assert owners[1].tolist() == [0] * 4 + [1] * 5 + [-1]
    assert owners[2].tolist() == [0] * 4 + [1] * 2 + [2] * 4
    assert owners[3].tolist() == [7] * 5 + [-1] * 5
    counts = shared_token_counts(owners, TREES)
    assert counts[0].tolist() == [3] * 4 + [1] * 6
    assert counts[1].tolist() == [3] * 4 + [2] * 2 + [1] * 3 + [0]
    assert counts[2].tolist() == [3] * 4 + [2] * 2 + [1] * 4
    assert counts[3].tolist() == [1] * 5 + [0] * 5


def test_owner_ids_of_another_tree_never_count():
    # the same leaf number in two trees names two different leaves
    owners = segment_owners([[(0, 9)], [(0, 9)]], [3, 3])
    assert shared_token_counts(owners, ["t", "u"]).tolist() == [[1, 1, 1], [1, 1, 1]]


def test_segments_must_cover_the_response():
    with pytest.raises(ValueError, match="before its 5 response tokens"):
        segment_owners([[(0, 3)]], [5])


def test_a_shared_token_counts_once_with_the_mean_of_its_leaves_advantages():
    owners = segment_owners(SEGMENTS, LENGTHS)
    mask = (owners >= 0).float()
    mask[1, 4] = 0  # an observation token of leaf 1 (also in leaf 2 at the same position)
    mask[2, 4] = 0
    w = shared_token_weights(owners, TREES, mask)
    assert w[0, :4].tolist() == pytest.approx([1 / 3] * 4) and w[0, 4:].tolist() == [1.0] * 6
    assert w[1, 4].item() == 0.0 and w[1, 5].item() == 0.5 and w[2, 5].item() == 0.5
    assert w[1, 9].item() == 0.0  # padding
    # over the copies of any one token the weights add up to 1
    for pos in range(4):
        assert float(w[:3, pos].sum()) == pytest.approx(1.0)
    assert float(w[1, 5] + w[2, 5]) == pytest.approx(1.0)
    # with each leaf's own advantage, the weighted copies of a shared token sum to the mean advantage
    adv = torch.tensor([1.0, -2.0, 4.0, 0.5])[:, None] * mask
    wa = weighted_advantages(adv, w)
    assert float(wa[:3, 0].sum()) == pytest.approx((1.0 - 2.0 + 4.0) / 3)
    assert float(wa[1, 5] + wa[2, 5]) == pytest.approx((-2.0 + 4.0) / 2)
    assert wa[0, 7].item() == 1.0 and wa[3, 0].item() == 0.5  # tokens generated once keep their advantage


def test_the_ppo_loss_of_a_weighted_copy_is_the_weighted_loss():
    # why scaling the advantage applies the weight: each per-token policy loss is positively homogeneous in A
    torch.manual_seed(1)
    old, new = torch.randn(2, 6), torch.randn(2, 6)
    adv = torch.randn(2, 6)
    mask = torch.ones(2, 6)
    for name in algo.POLICY_LOSSES:
        fn = algo.policy_loss_fn(name)
        kw = {"clip_ratio_high": 4.0} if name == "cispo" else {}
        full, _ = fn(old, new, adv, mask, loss_agg_mode="seq-mean-token-sum", **kw)
        third, _ = fn(old, new, adv / 3, mask, loss_agg_mode="seq-mean-token-sum", **kw)
        assert float(third) == pytest.approx(float(full) / 3, rel=1e-5), name


def test_the_trainer_wiring_weights_shared_copies_and_drops_failed_leaves():
    # trainer/losses.add_advantages with algo.adv_estimator=tree_grpo, on the hand-built tree above (+ a second
    # tree of two chains), leaves carrying rollout/tree.py's coordinates
    from megatron_searchr1.config import AlgoConfig
    from megatron_searchr1.megatron.batching import TrainSequence
    from megatron_searchr1.rollout.tree import TreeCoords
    from megatron_searchr1.trainer.losses import add_advantages

    segs = SEGMENTS[:3] + [[(0, 99)], [(1, 99)]]
    lengths = LENGTHS[:3] + [5, 5]
    trees = [TreeCoords(t, i, -1, 0, 0, tuple(s)) for i, (t, s) in enumerate(zip(["t"] * 3 + ["u"] * 2, segs))]
    seqs = [TrainSequence(prompt_ids=[1], response_ids=list(range(n)), loss_mask=torch.ones(n)) for n in lengths]
    scores = [1.0, 0.0, 1.0, 0.0, 1.0]
    add_advantages(seqs, scores, ["q"] * 5, AlgoConfig(adv_estimator="tree_grpo"), trees=trees)
    rewards, mask = _rewards(scores, T=1)
    full, _, _ = compute_tree_grpo_outcome_advantage(rewards, mask, ["q"] * 5, ["t"] * 3 + ["u"] * 2)
    a = full[:, 0].tolist()
    assert seqs[0].advantages[0].item() == pytest.approx(a[0] / 3)       # a token of all three leaves of t
    assert seqs[1].advantages[5].item() == pytest.approx(a[1] / 2)       # leaf 1's own, shared with leaf 2
    assert seqs[2].advantages[9].item() == pytest.approx(a[2])           # leaf 2's own
    assert seqs[3].advantages[0].item() == pytest.approx(a[3])           # tree u: two chains, nothing shared
    # a leaf that ended in a failed search is dropped: its copies take no share, the others count whole
    seqs[2].loss_mask = torch.zeros(10)
    add_advantages(seqs, scores, ["q"] * 5, AlgoConfig(adv_estimator="tree_grpo"), trees=trees)
    assert float(seqs[2].advantages.abs().sum()) == 0.0
    assert seqs[1].advantages[5].item() == pytest.approx(seqs[1].advantages[8].item())  # no longer shared
    assert seqs[0].advantages[0].item() == pytest.approx(seqs[0].advantages[9].item() / 2)  # two leaves hold it
    with pytest.raises(ValueError, match="needs tree rollouts"):
        add_advantages(seqs, scores, ["q"] * 5, AlgoConfig(adv_estimator="tree_grpo"))
