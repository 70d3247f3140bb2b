"""trainer/losses.py: trajectories -> sequences -> advantages, and the loss callbacks' share of the mini-batch loss."""
import dataclasses
import doctest
import math

import pytest
import torch

from megatron_searchr1 import algo
from megatron_searchr1.config import AlgoConfig
from megatron_searchr1.megatron.batching import make_micro_batches
from megatron_searchr1.rollout.loop import Trajectory
from megatron_searchr1.trainer import losses
from tests.fake_dp import run_ranks


def _traj(uid, gen, obs, finish="answer"):
    t = Trajectory(prompt_ids=[1, 2, 3], uid=uid)
    t.extend(gen, 1, [-0.5] * len(gen))
    t.extend(obs, 0)
    t.extend(gen, 1, [-0.25] * len(gen))
    t.finish(finish)
    return t


def test_sequences_mask_failed_searches_and_keep_engine_logprobs():
    ok, bad = _traj("a", [5, 6], [7, 8, 9]), _traj("a", [5], [7], finish="search_error")
    seqs = losses.to_sequences([ok, bad])
    assert seqs[0].loss_mask.tolist() == [1, 1, 0, 0, 0, 1, 1]
    assert seqs[0].engine_log_probs.tolist() == [-0.5, -0.5, 0, 0, 0, -0.25, -0.25]
    assert seqs[1].loss_mask.sum() == 0  # a failed search teaches nothing
    assert losses.to_sequences([bad], drop_search_errors=False)[0].loss_mask.sum() == 2


def test_grpo_advantages_per_group_and_masked_rows_out_of_the_baseline():
    trajs = [_traj("g1", [5, 6], [7]), _traj("g1", [5, 6], [7]), _traj("g2", [5], [7]), _traj("g2", [5], [7]),
             _traj("g1", [5], [7], finish="search_error")]
    seqs = losses.to_sequences(trajs)
    metrics = losses.add_advantages(seqs, [1.0, 0.0, 1.0, 1.0, 0.0], [t.uid for t in trajs], AlgoConfig())
    a0, a1 = seqs[0].advantages, seqs[1].advantages
    # group g1 = {1, 0}: mean 0.5, unbiased std 0.7071 -> +-0.7071 on generated tokens, 0 on the observation
    assert torch.allclose(a0, torch.tensor([0.7071, 0.7071, 0, 0.7071, 0.7071]), atol=1e-3)
    assert torch.allclose(a1, -a0)
    assert seqs[2].advantages.abs().max() == 0  # g2 agrees: no signal
    assert seqs[4].advantages.abs().max() == 0  # the masked row did not join g1 (else g1's mean would move)
    assert metrics["actor/advantages_abs_mean"] > 0


def _micro_batches(seqs, budget=10_000):
    mbs = make_micro_batches(seqs, budget)
    total = sum(float(s.loss_mask.sum()) for s in seqs)
    for mb in mbs:
        mb.num_loss_tokens = float(mb["loss_mask"].sum())
        mb.global_num_loss_tokens = total
        mb.global_num_seqs = len(seqs)
    return mbs


def test_actor_loss_shares_add_up_to_the_mini_batch_token_mean():
    torch.manual_seed(0)
    trajs = [_traj("g", [5, 6, 7][: k + 1], [8] * (k + 1)) for k in range(3)]
    seqs = losses.to_sequences(trajs)
    for s in seqs:
        R = len(s.response_ids)
        s.old_log_probs, s.ref_log_probs, s.advantages = -torch.rand(R), -torch.rand(R), torch.randn(R)
    new = [-torch.rand(len(s.response_ids)) for s in seqs]
    cfg = AlgoConfig(kl_loss_coef=0.1)
    loss_fn = losses.actor_loss_fn(cfg)

    def total(budget):
        out = 0.0
        for mb in _micro_batches(seqs, budget):
            lp = torch.zeros_like(mb["old_log_probs"])
            for row, i in enumerate(mb.indices):
                lp[row, : len(new[i])] = new[i]
            out += float(loss_fn({"log_probs": lp}, mb)[0])
        return out

    # the whole batch's token-mean, computed directly
    mask = losses.pad_rows([s.loss_mask for s in seqs])
    old, ref = losses.pad_rows([s.old_log_probs for s in seqs]), losses.pad_rows([s.ref_log_probs for s in seqs])
    adv, lp = losses.pad_rows([s.advantages for s in seqs]), losses.pad_rows(new)
    expected = float(algo.compute_policy_loss(old, lp, adv, mask, 0.2)[0]
                     + 0.1 * algo.agg_loss(algo.kl_penalty(lp, ref, "low_var_kl"), mask, "token-mean"))
    assert total(10_000) == pytest.approx(expected, abs=1e-6)  # one micro-batch
    assert total(13) == pytest.approx(expected, abs=1e-6)      # one sequence per micro-batch (lengths 6, 9, 12)


def test_logprob_gap_counts_generated_tokens_only():
    seqs = losses.to_sequences([_traj("a", [5, 6], [7, 8])])
    seqs[0].old_log_probs = seqs[0].engine_log_probs + torch.tensor([0.1, 0.1, 9, 9, 0.1, 0.1])
    assert losses.logprob_gap(seqs) == pytest.approx(0.1)


def test_on_policy_loss_takes_its_own_log_probs_as_old_with_the_same_gradient():
    """Without `old_log_probs` (Trainer.on_policy) the loss and its gradient equal those of a separate old-log-prob
    pass on the same weights, and the pass reports the engine gap from its own forward."""
    torch.manual_seed(0)
    seqs = losses.to_sequences([_traj("g", [5, 6, 7][: k + 1], [8] * (k + 1)) for k in range(3)])
    for s in seqs:
        s.advantages = torch.randn(len(s.response_ids))
    new = [-torch.rand(len(s.response_ids)) for s in seqs]

    def run(with_old: bool):
        for s, lp in zip(seqs, new):
            s.old_log_probs = lp.clone() if with_old else None
        (mb,) = _micro_batches(seqs)
        lp = torch.zeros(mb["loss_mask"].shape)
        for row, i in enumerate(mb.indices):
            lp[row, : len(new[i])] = new[i]
        lp.requires_grad_(True)
        loss, metrics = losses.actor_loss_fn(AlgoConfig(use_kl_loss=False), engine_gap=True)({"log_probs": lp}, mb)
        loss.backward()
        return float(loss.detach()), lp.grad, metrics

    loss_old, grad_old, m_old = run(with_old=True)
    loss_on, grad_on, m_on = run(with_old=False)
    assert loss_on == pytest.approx(loss_old, abs=1e-7)
    assert torch.allclose(grad_on, grad_old, atol=1e-7) and grad_on.abs().sum() > 0
    assert "logprob_gap_engine" not in m_old
    for s, lp in zip(seqs, new):
        s.old_log_probs = lp
    assert float(m_on["logprob_gap_engine"]) == pytest.approx(losses.logprob_gap(seqs), abs=1e-6)


# ------------------------------------------------------------------------------------------------ DP and failures
def _batch(seed=0, n=8):
    """n trajectories in groups of 2, random scores, values and old/ref log-probs."""
    g = torch.Generator().manual_seed(seed)
    trajs = [_traj(f"g{i // 2}", [5, 6, 7][: 1 + i % 3], [8] * (1 + i % 2)) for i in range(n)]
    seqs = losses.to_sequences(trajs)
    for s in seqs:
        R = len(s.response_ids)
        s.values, s.old_log_probs = torch.randn(R, generator=g), -torch.rand(R, generator=g)
        s.ref_log_probs = -torch.rand(R, generator=g)
    scores = torch.rand(n, generator=g).tolist()
    return trajs, seqs, scores


def _clone(seqs):
    return [dataclasses.replace(s, **{f.name: getattr(s, f.name).clone() for f in dataclasses.fields(s)
                                      if isinstance(getattr(s, f.name), torch.Tensor)}) for s in seqs]


@pytest.mark.parametrize("estimator", ["gae", "reinforce_plus_plus"])
def test_dp2_whitened_advantages_equal_dp1_on_the_same_batch(estimator):
    """GAE / REINFORCE++ whiten over the whole batch: two DP ranks holding halves (statistics summed over DP)
    give the advantages one rank gets for the whole batch."""
    trajs, seqs, scores = _batch()
    cfg = AlgoConfig(adv_estimator=estimator, use_kl_loss=False, use_kl_in_reward=True, gamma=0.9, lam=0.8)
    kl = algo.FixedKLController(0.1)
    whole = _clone(seqs)
    m1 = losses.add_advantages(whole, scores, [t.uid for t in trajs], cfg, kl)
    halves = [_clone(seqs[:4]), _clone(seqs[4:])]
    ms = run_ranks([lambda reduce, k=k: losses.add_advantages(halves[k], scores[4 * k: 4 * k + 4],
                                                          [t.uid for t in trajs[4 * k: 4 * k + 4]], cfg, kl,
                                                          reduce=reduce) for k in range(2)])
    for a, b in zip(whole, halves[0] + halves[1]):
        torch.testing.assert_close(b.advantages, a.advantages, atol=1e-5, rtol=1e-5)
    assert ms[0] == ms[1]  # every rank logs the same keys and values: the whole batch's
    for key in ("actor/advantages_mean", "actor/advantages_abs_mean", "critic/returns_mean", "actor/reward_kl_penalty"):
        assert ms[0][key] == pytest.approx(m1[key], abs=1e-6), key
    # per-rank whitening (what main did) differs
    alone = _clone(seqs[:4])
    losses.add_advantages(alone, scores[:4], [t.uid for t in trajs[:4]], cfg, kl)
    assert not all(torch.allclose(x.advantages, y.advantages, atol=1e-3) for x, y in zip(alone, whole[:4]))


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "gae", "reinforce_plus_plus"])
def test_a_rank_whose_searches_all_failed_logs_the_same_keys_and_takes_part(estimator):
    """Every trajectory of DP rank 1 ended search_error (dropped): no raise, the same metric keys on both ranks,
    every reduction made by both (a skipped one would time out here), and the drop is counted."""
    trajs, seqs, scores = _batch()
    for t in trajs[4:]:
        t.finish_reason = "search_error"
    seqs = losses.to_sequences(trajs)
    for s, src in zip(seqs, _batch()[1]):
        s.values, s.old_log_probs, s.ref_log_probs = src.values, src.old_log_probs, src.ref_log_probs
    cfg = AlgoConfig(adv_estimator=estimator)
    halves = [seqs[:4], seqs[4:]]
    ms = run_ranks([lambda reduce, k=k: losses.add_advantages(halves[k], scores[4 * k: 4 * k + 4],
                                                          [t.uid for t in trajs[4 * k: 4 * k + 4]], cfg,
                                                          reduce=reduce) for k in range(2)], timeout=10)
    assert sorted(ms[0]) == sorted(ms[1]) and ms[0] == ms[1]
    assert ms[0]["train/dropped_trajectories"] == 4
    assert all(torch.isfinite(torch.tensor(v)) for v in ms[0].values())
    assert all(s.advantages.abs().sum() == 0 for s in seqs[4:])


def test_a_sample_left_alone_in_its_group_gets_no_advantage():
    """GRPO / RLOO: the survivor of a group whose sibling's search failed has no baseline. verl would give it its
    raw score (mean 0, std 1); here it gets 0 and is counted."""
    trajs = [_traj("a", [5, 6], [7]), _traj("a", [5, 6], [7], finish="search_error"),
             _traj("b", [5], [7]), _traj("b", [5], [7])]
    for est in ("grpo", "rloo"):
        seqs = losses.to_sequences(trajs)
        m = losses.add_advantages(seqs, [1.0, 0.0, 1.0, 0.0], [t.uid for t in trajs], AlgoConfig(adv_estimator=est))
        assert seqs[0].advantages.abs().sum() == 0 and seqs[0].returns.abs().sum() == 0
        assert seqs[2].advantages.abs().sum() > 0  # a full group still learns
        assert m["train/lone_samples"] == 1 and m["train/dropped_trajectories"] == 1
    # the pure estimator keeps verl's rule for a group of one (mean 0, std 1): the raw score
    adv, _ = algo.compute_grpo_outcome_advantage(torch.tensor([[0.0, 1.0]]), torch.ones(1, 2), ["solo"])
    assert adv[0, 1].item() == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_seq_mean_losses_do_not_depend_on_packing_with_fully_masked_rows(mode):
    """A dropped trajectory (all-zero mask) must not change the weight of the rows packed with it:
    one micro-batch and one row per micro-batch give the same mini-batch loss, sum(per row) / rows."""
    torch.manual_seed(0)
    trajs = [_traj("g", [5, 6, 7][: k % 3 + 1], [8] * (k + 1)) for k in range(4)]
    trajs[1].finish_reason = "search_error"
    seqs = losses.to_sequences(trajs)
    for s in seqs:
        R = len(s.response_ids)
        s.old_log_probs, s.ref_log_probs, s.advantages = -torch.rand(R), -torch.rand(R), torch.randn(R)
        s.values, s.returns = torch.randn(R), torch.randn(R)
    new = [-torch.rand(len(s.response_ids)) for s in seqs]
    cfg = AlgoConfig(loss_agg_mode=mode, kl_loss_coef=0.1)

    def total(loss_fn, key, budget):
        out = 0.0
        for mb in _micro_batches(seqs, budget):
            x = torch.zeros_like(mb["loss_mask"])
            for row, i in enumerate(mb.indices):
                x[row, : len(new[i])] = new[i]
            out += float(loss_fn({key: x}, mb)[0])
        return out

    for loss_fn, key in ((losses.actor_loss_fn(cfg), "log_probs"), (losses.critic_loss_fn(cfg), "values")):
        packed, one_each = total(loss_fn, key, 10_000), total(loss_fn, key, 16)
        assert one_each == pytest.approx(packed, abs=1e-6), key
    # and it is sum(per-row loss) / all 4 rows (verl's seq-mean over the mini-batch size): agg_loss over the 3 rows
    # with tokens, times 3/4
    mask = losses.pad_rows([s.loss_mask for s in seqs])
    old, ref, adv = (losses.pad_rows([getattr(s, k) for s in seqs])
                     for k in ("old_log_probs", "ref_log_probs", "advantages"))
    lp = losses.pad_rows(new)
    expected = float(algo.compute_policy_loss(old, lp, adv, mask, 0.2, loss_agg_mode=mode)[0]
                     + 0.1 * algo.agg_loss(algo.kl_penalty(lp, ref, "low_var_kl"), mask, mode)) * 3 / 4
    assert total(losses.actor_loss_fn(cfg), "log_probs", 10_000) == pytest.approx(expected, abs=1e-6)


class _CharTok:
    """Token id = character code: enough to decode a trajectory's text."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def test_the_reward_reads_only_what_the_model_generated():
    """Invalid-action feedback (mask 0) spells out `<answer> and </answer>`: a trajectory that never answered must
    not earn format_score for the 'answer' "and"; a real answer still scores."""
    from megatron_searchr1.data.prompts import INVALID_ACTION_FEEDBACK
    from megatron_searchr1.rollout.loop import generated_text

    tok = _CharTok()
    never = Trajectory(prompt_ids=[1], meta={"data_source": "nq", "ground_truth": {"target": ["Paris"]}})
    never.extend(tok.encode("<think> hmm </think>"), 1, [-0.1] * 20)
    never.extend(tok.encode(INVALID_ACTION_FEEDBACK), 0)
    never.extend(tok.encode("<think> still thinking"), 1, [-0.1] * 22)
    never.finish("invalid")
    answered = Trajectory(prompt_ids=[1], meta=dict(never.meta))
    answered.extend(tok.encode("<think> x </think>"), 1, [-0.1] * 18)
    answered.extend(tok.encode(INVALID_ACTION_FEEDBACK), 0)
    answered.extend(tok.encode("<answer> Lyon </answer>"), 1, [-0.1] * 23)
    answered.finish("answer")
    assert "<answer>" not in generated_text(tok, never)
    assert generated_text(tok, answered) == "<think> x </think><answer> Lyon </answer>"
    scores = losses.score_trajectories([never, answered], tok, AlgoConfig(format_score=0.2))
    assert scores[0]["score"] == 0.0  # no answer: not even the format score
    assert scores[1]["score"] == pytest.approx(0.2)  # answered, wrongly: the format score


@pytest.mark.parametrize("coeff", [0.0, 0.01])
def test_entropy_at_coefficient_zero_is_a_metric_and_the_loss_and_gradient_are_unchanged(coeff):
    """Trainer.update asks for a detached entropy at entropy_coeff 0 (entropy_grad=False): the loss, its gradient
    and the entropy metric equal those of the gradient-carrying entropy (the old path), which stays in use for a
    coefficient > 0, where the bonus moves the loss."""
    from megatron_searchr1.megatron.vocab_parallel import vocab_parallel_log_probs

    torch.manual_seed(0)
    seqs = losses.to_sequences([_traj("g", [5, 6, 7][: k + 1], [8] * (k + 1)) for k in range(3)])
    for s in seqs:
        s.advantages = torch.randn(len(s.response_ids))
    (mb,) = _micro_batches(seqs)
    logits = torch.randn(*mb["loss_mask"].shape, 40)
    targets = torch.randint(0, 40, mb["loss_mask"].shape)
    cfg = AlgoConfig(use_kl_loss=False, entropy_coeff=coeff)

    def run(entropy_grad):
        x = logits.clone().requires_grad_(True)
        lp, ent = vocab_parallel_log_probs(x, targets, real_vocab_size=40, with_entropy=True,
                                           entropy_grad=entropy_grad)
        loss, metrics = losses.actor_loss_fn(cfg)({"log_probs": lp, "entropy": ent}, mb)
        loss.backward()
        return loss.detach(), x.grad, metrics

    loss_full, grad_full, m_full = run(entropy_grad=True)
    if coeff == 0:
        loss_metric, grad_metric, m_metric = run(entropy_grad=False)
        assert torch.equal(loss_metric, loss_full) and torch.equal(grad_metric, grad_full)
        torch.testing.assert_close(m_metric["entropy"], m_full["entropy"], atol=1e-6, rtol=0)
    else:
        expected = float(m_full["pg_loss"] - coeff * m_full["entropy"]) * mb.loss_token_weight
        assert float(loss_full) == pytest.approx(expected, abs=1e-7)


def test_doctests():
    assert doctest.testmod(losses).failed == 0


# ------------------------------------------------------------------------------------------------ the toolkit
def _one_mb(seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = losses.to_sequences([_traj(f"g{k // 2}", [5, 6, 7][: k % 3 + 1], [8] * (k % 2 + 1)) for k in range(4)])
    for s in seqs:
        R = len(s.response_ids)
        s.old_log_probs = -torch.rand(R, generator=g) * s.loss_mask
        s.engine_log_probs = s.old_log_probs + 0.3 * torch.randn(R, generator=g) * s.loss_mask
        s.advantages = torch.randn(R, generator=g)
    (mb,) = _micro_batches(seqs)
    lp = (mb["old_log_probs"] + 0.2 * torch.randn(mb["loss_mask"].shape, generator=g)).requires_grad_(True)
    return mb, lp


@pytest.mark.parametrize("kind", ["ppo", "gspo", "cispo"])
def test_the_actor_loss_is_the_configured_policy_loss_with_the_rollout_correction_weights(kind):
    mb, lp = _one_mb()
    agg = "seq-mean-token-mean" if kind == "gspo" else "token-mean"
    cfg = AlgoConfig(use_kl_loss=False, policy_loss=kind, rollout_correction="token_tis", rollout_correction_cap=1.1,
                     loss_agg_mode=agg)
    loss, metrics = losses.actor_loss_fn(cfg)({"log_probs": lp}, mb)
    mask = mb["loss_mask"]
    w, _, _ = algo.compute_rollout_correction(mb["old_log_probs"], mb["engine_log_probs"], mask, "token_tis",
                                              cap=1.1)
    assert float(w[mask.bool()].min()) < 1.0 and float(w.max()) == pytest.approx(1.1)  # the weights do something
    expected, _ = algo.policy_loss_fn(kind)(mb["old_log_probs"], lp, mb["advantages"], mask, rollout_is_weights=w,
                                            loss_agg_mode=cfg.loss_agg_mode, **losses._policy_loss_kwargs(cfg))
    plain, _ = losses.actor_loss_fn(dataclasses.replace(cfg, rollout_correction="none"))({"log_probs": lp}, mb)
    assert float(loss.detach()) == pytest.approx(float(expected) * losses._weight(mb, cfg.loss_agg_mode), abs=1e-6)
    assert float(loss) != pytest.approx(float(plain), abs=1e-6)
    assert float(metrics["rc_mismatch_kl"]) > 0 and float(metrics["rc_clipped_frac"]) > 0
    assert float(metrics[f"pg_loss_{kind}"]) == float(metrics["pg_loss"])


def test_llds_adds_its_penalty_only_when_likelihood_fell():
    mb, lp = _one_mb(1)
    cfg = AlgoConfig(use_kl_loss=False)
    on = dataclasses.replace(cfg, llds=dataclasses.replace(cfg.llds, coef=0.5))
    plain, _ = losses.actor_loss_fn(cfg)({"log_probs": lp}, mb)
    with_llds, m = losses.actor_loss_fn(on)({"log_probs": lp}, mb)
    assert float(m["llds_penalty"]) > 0
    assert float(with_llds) == pytest.approx(float(plain) + float(m["llds_penalty"]) * mb.loss_token_weight, abs=1e-6)
    rose = (mb["old_log_probs"] + 0.1).detach().requires_grad_(True)  # every likelihood rose: the gate is closed
    assert float(losses.actor_loss_fn(on)({"log_probs": rose}, mb)[0]) == float(
        losses.actor_loss_fn(cfg)({"log_probs": rose}, mb)[0])


def test_overlong_shaping_and_filter():
    trajs = [_traj("g", [5, 6, 7], [8] * 2), _traj("g", [5], [8], finish="length")]
    seqs = losses.to_sequences(trajs)
    scores = [{"score": 1.0}, {"score": 0.0}]
    cfg = AlgoConfig(overlong_buffer=4, overlong_penalty=1.0, overlong_filter=True)
    m = losses.shape_overlong(trajs, scores, seqs, cfg, max_response_length=8)
    # lengths 8 and 3 against a budget of 8 with a buffer of 4: penalties -1 and 0
    assert [s["score"] for s in scores] == [0.0, 0.0] and m["train/overlong_filtered"] == 1.0
    assert float(seqs[1].loss_mask.sum()) == 2  # the filter waits for the advantages (apply_overlong_filter)
    losses.apply_overlong_filter(trajs, seqs, cfg)
    assert float(seqs[1].loss_mask.sum()) == 0 and float(seqs[0].loss_mask.sum()) == 6


def test_overlong_filter_keeps_the_truncated_reward_in_its_group():
    """Four right answers and one the budget cut (reward 0): DAPO masks only the cut one's loss, so the four keep the
    advantage GRPO gives them beside a 0 (mean 0.8, unbiased std sqrt(0.2)): +0.2 / 0.4472 = +0.4472. On main the
    filter zeroed the mask before the advantages, the cut sample left its group and the four got 0."""
    trajs = [_traj("g", [5, 6], [8]) for _ in range(4)] + [_traj("g", [5, 6], [8], finish="length")]
    seqs = losses.to_sequences(trajs)
    scores = [{"score": 1.0}] * 4 + [{"score": 0.0}]
    cfg = AlgoConfig(overlong_filter=True)
    losses.shape_overlong(trajs, scores, seqs, cfg, max_response_length=64)
    losses.add_advantages(seqs, [sc["score"] for sc in scores], [t.uid for t in trajs], cfg)
    losses.apply_overlong_filter(trajs, seqs, cfg)
    want = 0.2 / math.sqrt(0.2)
    for s in seqs[:4]:
        assert s.advantages[s.loss_mask.bool()].tolist() == pytest.approx([want] * 4, abs=1e-4)
    assert float(seqs[4].loss_mask.sum()) == 0  # the truncated sample trains nothing


def _ragged_gspo_batch():
    g = torch.Generator().manual_seed(3)
    seqs = losses.to_sequences([_traj("g", [5] * n, [8]) for n in (1, 6)])  # 2 and 12 generated tokens
    for s in seqs:
        R = len(s.response_ids)
        s.old_log_probs = -torch.rand(R, generator=g)
        s.advantages = torch.full((R,), 1.0 if len(s.response_ids) < 5 else -1.0)
    new = [s.old_log_probs + 0.05 * torch.randn(len(s.old_log_probs), generator=g) for s in seqs]
    return seqs, new


@pytest.mark.parametrize("budget", [10_000, 16])
def test_gspo_by_name_aggregates_seq_mean_token_mean_whatever_the_global_mode(budget):
    """algo.policy_loss=gspo under the default loss_agg_mode (token-mean): the policy loss over micro-batches adds up
    to GSPO's seq-mean-token-mean over the batch (the paper's, verl's), on rows of 2 and 12 generated tokens. On main
    it was token-mean, which weighs the long row 6x the short one."""
    seqs, new = _ragged_gspo_batch()
    cfg = AlgoConfig(policy_loss="gspo", use_kl_loss=False)
    assert cfg.loss_agg_mode == "token-mean"
    loss_fn = losses.actor_loss_fn(cfg)
    total = 0.0
    for mb in _micro_batches(seqs, budget):
        lp = torch.zeros_like(mb["old_log_probs"])
        for row, i in enumerate(mb.indices):
            lp[row, : len(new[i])] = new[i]
        total += float(loss_fn({"log_probs": lp}, mb)[0])
    mask = losses.pad_rows([s.loss_mask for s in seqs])
    old, adv = losses.pad_rows([s.old_log_probs for s in seqs]), losses.pad_rows([s.advantages for s in seqs])
    kw = losses._policy_loss_kwargs(cfg)
    seq_mean, _ = algo.compute_policy_loss_gspo(old, losses.pad_rows(new), adv, mask,
                                                loss_agg_mode="seq-mean-token-mean", **kw)
    token_mean, _ = algo.compute_policy_loss_gspo(old, losses.pad_rows(new), adv, mask, loss_agg_mode="token-mean",
                                                  **kw)
    assert float(seq_mean) != pytest.approx(float(token_mean), abs=1e-3)  # the two modes differ on this batch
    assert total == pytest.approx(float(seq_mean), abs=1e-6)


def test_gspo_with_a_sum_aggregation_is_refused():
    from megatron_searchr1.config import ConfigError

    AlgoConfig(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean")  # the paper's: fine
    with pytest.raises(ConfigError, match="algo.policy_loss=gspo aggregates its loss seq-mean-token-mean"):
        AlgoConfig(policy_loss="gspo", loss_agg_mode="seq-mean-token-sum")


def test_mis_rejection_mask_applies_to_kl_entropy_and_llds():
    """token_mis rejects tokens whose engine ratio leaves the band: they train nothing, in any term. The gradient at
    a rejected token is 0 with the KL loss, an entropy bonus and LLDS on; on main only the policy term dropped it."""
    mb, lp = _one_mb(2)
    mb.fields["ref_log_probs"] = mb["old_log_probs"] - 0.3
    base = AlgoConfig(use_kl_loss=True, kl_loss_coef=0.5, entropy_coeff=0.1, rollout_correction="token_mis",
                      rollout_correction_cap=1.2)
    cfg = dataclasses.replace(base, llds=dataclasses.replace(base.llds, coef=1.0))
    lp = (mb["old_log_probs"] - 0.05).detach().requires_grad_(True)  # every likelihood fell: LLDS gates are open
    entropy = torch.rand(lp.shape, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    loss, m = losses.actor_loss_fn(cfg)({"log_probs": lp, "entropy": entropy}, mb)
    loss.backward()
    _, keep, _ = algo.compute_rollout_correction(mb["old_log_probs"], mb["engine_log_probs"], mb["loss_mask"],
                                                 "token_mis", cap=1.2)
    rejected = mb["loss_mask"].bool() & ~keep
    assert rejected.any() and (keep & mb["loss_mask"].bool()).any()
    assert lp.grad[rejected].abs().max() == 0 and entropy.grad[rejected].abs().max() == 0
    assert lp.grad[keep].abs().min() > 0 and entropy.grad[keep].abs().min() > 0


# ------------------------------------------------------------------------------------------------ defaults
DISAGG = ["parallel.rollout_placement=disaggregated", "parallel.rollout_ranks=1"]


def test_a_disaggregated_run_corrects_behaviour_vs_proximal_by_default():
    """algo.rollout_correction defaults to auto: token TIS (cap 2) in the disaggregated placement, where a batch is
    up to rollout.max_staleness versions old, none when colocated; an explicit mode stays. On main a disaggregated
    run got no correction unless asked: its stale batch trained as if on-policy."""
    from megatron_searchr1.config import load_config

    assert load_config(None, []).algo.rollout_correction == "none"
    assert load_config(None, DISAGG).algo.rollout_correction == "token_tis"
    assert load_config(None, [*DISAGG, "algo.rollout_correction=icepop"]).algo.rollout_correction == "icepop"
    assert load_config(None, [*DISAGG, "algo.rollout_correction=none"]).algo.rollout_correction == "none"
    # the loss of such a run weighs a stale token by min(pi_proximal / pi_behaviour, 2): here 1.5 and 2 (of 3)
    cfg = load_config(None, [*DISAGG, "algo.use_kl_loss=false"]).algo
    seqs = losses.to_sequences([_traj("g", [5, 6], [8])])
    s = seqs[0]
    s.advantages = torch.ones(len(s.response_ids))
    s.engine_log_probs = torch.log(torch.tensor([1 / 1.5, 1 / 3, 1, 1 / 1.5, 1 / 3])) * s.loss_mask  # stale
    (mb,) = _micro_batches(seqs)
    lp = torch.zeros(mb["loss_mask"].shape, requires_grad=True)  # the trainer's log-probs now (on-policy update)
    loss, m = losses.actor_loss_fn(cfg)({"log_probs": lp}, mb)
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([-1.5 / 4, -2 / 4, 0, -1.5 / 4, -2 / 4])
    assert float(m["rc_clipped_frac"]) == pytest.approx(0.5)


def test_cispo_cap_default_is_skyrls():
    """CISPO's weight cap defaults to 1 + 5 (SkyRL's cispo_eps_clip_high): the weight is detached and only bounds
    the variance of a token's contribution; on main it was 1.28, PPO's clip-higher range, which damps exactly the
    large-ratio tokens CISPO exists to keep."""
    assert AlgoConfig().cispo_clip_ratio_high == 5.0
    kw = losses._policy_loss_kwargs(AlgoConfig(policy_loss="cispo"))
    old, new = torch.zeros(1, 1), torch.log(torch.tensor([[3.0]]))
    _, m = algo.compute_policy_loss_cispo(old, new, torch.ones(1, 1), torch.ones(1, 1), **kw)
    assert float(m["pg_clipfrac"]) == 0.0  # a ratio of 3 keeps its full weight


# ------------------------------------------------------------------------------------------------ turn credit
class _Tok:
    words = {70: "Talven", 71: "Orrick", 80: "nothing", 81: "1856"}

    def decode(self, ids):
        return " ".join(self.words.get(i, "x") for i in ids)


def test_turn_credit_adds_step_advantages_to_the_outcome_advantage():
    """Three samples of one prompt: two searched and saw the same observation (70 71 = "Talven Orrick", the bridge
    entity, a hop answer), one saw 80; the first was right. GRPO's outcome advantage (1, 0, 0: +1.1547, -0.5774,
    -0.5774) plus weight 0.5 x the step advantages: first turns share the group of all three; the second turns of
    the first two share (X,), the third is alone. With retrieved_answer (coef 0.1) the first two earn 0.1 on their
    first turn."""
    from megatron_searchr1.config.rl import TurnCreditConfig

    trajs = [_traj("g", [5, 5], [70, 71]), _traj("g", [5, 5], [70, 71]), _traj("g", [5, 5], [80])]
    seqs = losses.to_sequences(trajs)
    cfg = AlgoConfig(turn_credit=TurnCreditConfig(weight=0.5, gamma=1.0, turn_reward="retrieved_answer"))
    turns = losses.turn_inputs(trajs, _Tok(), cfg, gold_answers=[["Talven Orrick"]] * 3)
    assert turns["rewards"] == [[0.1, 0.0], [0.1, 0.0], [0.0, 0.0]]
    assert turns["keys"][0] == [(), ((70, 71),)] and turns["keys"][2] == [(), ((80,),)]
    m = losses.add_advantages(seqs, [1.0, 0.0, 0.0], ["g"] * 3, cfg, turns=turns)
    # returns (gamma 1): t0 (1.1, 1), t1 (0.1, 0), t2 (0, 0)
    first = algo.step_group_advantages([[1.1], [0.1], [0.0]], [[()], [()], [()]], ["g"] * 3)
    outcome = [1.154699, -0.577349, -0.577349]
    second = [0.707106, -0.707106, 0.0]
    for i, s in enumerate(seqs):
        want = [outcome[i] + 0.5 * first[i][0]] * 2 + [0.0] * len(trajs[i].response_ids[2:-2]) + \
               [outcome[i] + 0.5 * second[i]] * 2
        assert s.advantages.tolist() == pytest.approx(want, abs=1e-4)
    assert m["turn/turns"] == 6 and m["turn/reward_per_turn"] == pytest.approx(0.2 / 6)
    # off: the outcome advantage alone
    plain = losses.to_sequences(trajs)
    losses.add_advantages(plain, [1.0, 0.0, 0.0], ["g"] * 3, AlgoConfig(), turns=None)
    assert plain[2].advantages[0] == pytest.approx(outcome[2], abs=1e-4)
    assert losses.turn_inputs(trajs, _Tok(), AlgoConfig()) is None


def test_a_users_turn_reward_function(monkeypatch):
    import sys
    import types

    from megatron_searchr1.config.rl import TurnCreditConfig

    mod = types.ModuleType("my_turn_rewards")
    mod.reward = lambda observations, meta: [float("1856" in o) for o in observations]
    monkeypatch.setitem(sys.modules, "my_turn_rewards", mod)
    trajs = [_traj("g", [5], [81]), _traj("g", [5], [80])]
    cfg = AlgoConfig(turn_credit=TurnCreditConfig(weight=1.0, turn_reward="my_turn_rewards:reward",
                                                  turn_reward_coef=2.0))
    assert losses.turn_inputs(trajs, _Tok(), cfg)["rewards"] == [[2.0, 0.0], [0.0, 0.0]]
