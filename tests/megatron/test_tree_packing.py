"""megatron/tree_packing.py: a tree's leaves packed into one row give the per-leaf forward's log-probs, entropies and
critic values (fp32), on a hand-built tree with ragged branches at depth 1 and 2, a root branch, a leaf that is a
prefix of another, and a second tree; the trie layout and mask by hand; the config's and the model check's
refusals. The TP=2 / sequence-parallel run inside the trainer: tests/megatron/test_tree_packing_tp2.py."""
from __future__ import annotations

import pytest
import torch

from megatron_searchr1.megatron import tree_packing
from megatron_searchr1.megatron.batching import TrainSequence
from tests.models.test_gpt import megatron_tp1, tiny_config  # noqa: F401  (fixture)

P = [11, 12, 13, 14, 15]          # tree a's prompt
A = [21, 22, 23, 24]              # turn 1 (shared by leaves 0-2)
B1, B2 = [31, 32, 33], [41, 42, 43, 44, 45, 46]       # depth-1 branch
C1, C2 = [51, 52], [61, 62, 63, 64, 65]               # depth-2 branch below B1
D = [71, 72, 73]                  # a fork of the root (shares the prompt only)
Q = [81, 82, 83]                  # tree b's prompt


def _tree_leaves():
    """(prompt, response, key) of 7 leaves: tree a (5 leaves, one of them a prefix of another), tree b (2)."""
    return [
        (P, A + B1 + C1, "a"),
        (P, A + B1 + C2, "a"),
        (P, A + B2, "a"),
        (P, D, "a"),
        (Q, [91, 92, 93, 94], "b"),
        (P, A + B1, "a"),            # ends at the node: its tokens all lie on leaf 0's path
        (Q, [91, 95], "b"),
    ]


def _seqs():
    g = torch.Generator().manual_seed(0)
    return [TrainSequence(prompt_ids=list(p), response_ids=list(r), loss_mask=(torch.rand(len(r), generator=g) > 0.3
                                                                                ).float())
            for p, r, _ in _tree_leaves()], [k for _, _, k in _tree_leaves()]


def test_the_trie_holds_each_shared_token_once_and_the_mask_follows_each_path():
    seqs, keys = _seqs()
    (mb,) = tree_packing.packed_micro_batches(seqs, keys, 256, micro_batch_cost_tokens=1000)
    # tree a: P + A + B1 + C1 (leaf 0), then C2, B2, D after their branch points; leaf 5 adds nothing
    assert mb.input_ids[0, :28].tolist() == P + A + B1 + C1 + C2 + B2 + D
    assert mb.position_ids[0, :28].tolist() == (list(range(14)) + list(range(12, 17)) + list(range(9, 15))
                                                + list(range(5, 8)))
    assert mb.input_ids[1, :8].tolist() == Q + [91, 92, 93, 94] + [95] and mb.packed_tokens == 28 + 8
    assert tree_packing.forward_token_counts(seqs, keys, 256) == (36, sum(len(p) + len(r) for p, r, _ in
                                                                           _tree_leaves()))
    m = mb.attention_mask[0, 0]  # True = masked
    c2_first = 14  # packed index of C2's first token: sees P, A, B1 and itself, not C1
    assert not m[c2_first, :12].any() and m[c2_first, 12:14].all() and not m[c2_first, c2_first]
    assert m[c2_first, c2_first + 1:].all()
    d_first = 25  # the root fork sees the prompt only
    assert not m[d_first, :5].any() and m[d_first, 5:d_first].all()
    # leaf 1's response token 7 (C2[0]) is predicted at B1's last token (packed 11), leaf 0's at the same place
    assert int(mb.leaf_positions[1, 7]) == int(mb.leaf_positions[0, 7]) == 11
    assert int(mb.leaf_targets[1, 7]) == C2[0] and int(mb.leaf_targets[0, 7]) == C1[0]


def test_a_tree_longer_than_the_budget_is_cut_into_rows_that_fit():
    seqs, keys = _seqs()
    rows = tree_packing.plan_packs(seqs, keys, max_tokens=20)
    assert all(len(r.tokens) <= 20 for r in rows)
    assert sorted(i for r in rows for i in r.leaves) == list(range(7))
    with pytest.raises(ValueError, match="one key"):
        tree_packing.plan_packs(seqs, keys[:-1], 256)


@pytest.mark.parametrize("budget", [256, 40])
def test_packed_log_probs_entropy_and_values_equal_the_per_leaf_forward(megatron_tp1, budget):
    from megatron_searchr1.models.critic import build_critic_model
    from megatron_searchr1.models.gpt import build_gpt_model
    from megatron_searchr1.trainer.roles import Critic, Policy

    torch.manual_seed(0)
    seqs, keys = _seqs()
    policy = Policy(build_gpt_model(tiny_config("qwen2")).eval())
    ref_lp, ref_ent = policy.log_probs(seqs, 256, 0.7, with_entropy=True)
    lp, ent = policy.log_probs(seqs, budget, 0.7, with_entropy=True, pack_keys=keys)
    assert len(lp) == len(seqs)
    for a, b, ea, eb in zip(ref_lp, lp, ref_ent, ent):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(eb, ea, atol=2e-5, rtol=1e-5)

    critic_model = build_critic_model(tiny_config("qwen2"))
    with torch.no_grad():  # a value head that reads the trunk (it starts at zero)
        critic_model.value_head.weight.normal_(generator=torch.Generator().manual_seed(1))
    critic = Critic(critic_model.eval())
    ref_v = critic.values(seqs, 256)
    v = critic.values(seqs, budget, pack_keys=keys)
    assert all(float(x.abs().max()) > 1e-3 for x in ref_v)
    for a, b in zip(ref_v, v):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-5)


def test_positions_matter_the_packed_forward_without_its_rope_positions_differs(megatron_tp1, monkeypatch):
    """The check above would catch RoPE at packed positions 0..S-1: with the positions switched off it fails."""
    from megatron_searchr1.models.gpt import build_gpt_model
    from megatron_searchr1.trainer.roles import Policy

    torch.manual_seed(0)
    seqs, keys = _seqs()
    policy = Policy(build_gpt_model(tiny_config("qwen2")).eval())
    ref = policy.log_probs(seqs, 256)
    monkeypatch.setattr(tree_packing, "rope_at_positions", lambda model, pos: __import__("contextlib").nullcontext())
    off = policy.log_probs(seqs, 256, pack_keys=keys)
    assert max(float((a - b).abs().max()) for a, b in zip(ref, off)) > 1e-3


def test_a_transformer_engine_model_is_refused(megatron_tp1, monkeypatch):
    from megatron_searchr1.models import spec
    from megatron_searchr1.models.gpt import build_gpt_model

    model = build_gpt_model(tiny_config("qwen2"))
    tree_packing.check_packable(model)
    monkeypatch.setattr(spec, "uses_te_spec", lambda m: True)
    with pytest.raises(RuntimeError, match="rollout.tree.pack_forward=false"):
        tree_packing.check_packable(model)


def test_pack_forward_needs_tree_rollouts():
    from megatron_searchr1.config.rl_rollout import TreeConfig

    assert TreeConfig(trees=2, pack_forward=True).pack_forward
    with pytest.raises(Exception, match="rollout.tree.trees >= 1"):
        TreeConfig(trees=0, pack_forward=True)
