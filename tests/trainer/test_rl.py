"""Trainer.update's schedule of critic and actor updates (trainer/rl.py), with the Megatron step replaced by a
recorder."""
import pytest
import torch

from megatron_searchr1.config import load_config
from megatron_searchr1.megatron.batching import TrainSequence
from megatron_searchr1.trainer.rl import Trainer
from megatron_searchr1.trainer.roles import Critic, Policy


class _Sched:
    def __init__(self):
        self.steps = 0

    def step(self, n):
        self.steps += n


@pytest.mark.parametrize("warmup, actor_steps", [(0, [1, 2, 3]), (1, [1, 2, 3]), (2, [2, 3]), (3, [3])])
def test_critic_warmup_matches_verl(monkeypatch, warmup, actor_steps):
    """verl (ray_trainer.fit, global_steps from 1) updates the actor when critic_warmup <= global_steps: warmup k
    gives k - 1 critic-only steps; the critic trains every step."""
    import megatron_searchr1.megatron.schedule as schedule

    calls = []
    monkeypatch.setattr(schedule, "train_step", lambda model, *a, **kw: calls.append(model) or {"loss": 0.0})
    trainer = Trainer.__new__(Trainer)
    trainer.cfg = load_config(None, ["algo.adv_estimator=gae", f"optim.critic_warmup={warmup}",
                                     "data.train_batch_size=2", "algo.ppo_mini_batch_size=2"])
    trainer.policy, trainer.critic = Policy("actor", None, _Sched()), Critic("critic", None, _Sched())
    seqs = [TrainSequence([1, 2], [3, 4], torch.ones(2)) for _ in range(2)]
    updated = []
    for step in (1, 2, 3):
        trainer.step_no = step
        calls.clear()
        trainer.update(seqs)
        assert "critic" in calls
        if "actor" in calls:
            updated.append(step)
    assert updated == actor_steps
    assert trainer.policy.scheduler.steps == len(actor_steps) and trainer.critic.scheduler.steps == 3


@pytest.mark.parametrize("coeff", [0.0, 0.001])
def test_the_actor_update_computes_a_differentiable_entropy_only_for_an_entropy_bonus(monkeypatch, coeff):
    """At entropy_coeff 0 the actor's update asks for the entropy as a detached metric (no second vocabulary-sized
    tensor kept for backward); with a bonus, for the entropy with its gradient."""
    import megatron_searchr1.megatron.schedule as schedule

    seen = {}
    monkeypatch.setattr(schedule, "train_step", lambda model, *a, **kw: seen.update({model: kw}) or {"loss": 0.0})
    trainer = Trainer.__new__(Trainer)
    trainer.cfg = load_config(None, [f"algo.entropy_coeff={coeff}", "data.train_batch_size=2",
                                     "algo.ppo_mini_batch_size=2"])
    trainer.policy, trainer.critic = Policy("actor", None, _Sched()), None
    trainer.step_no = 1
    trainer.update([TrainSequence([1, 2], [3, 4], torch.ones(2)) for _ in range(2)])
    assert seen["actor"]["with_entropy"] is True
    assert seen["actor"]["entropy_grad"] is (coeff != 0)


# ------------------------------------------------------------------------------------------------ DAPO, collapse
class _Traj:
    def __init__(self, uid, score, finish="answer", length=4):
        self.uid, self.score, self.finish_reason, self.response_ids = uid, score, finish, [0] * length


class _Worker:
    """make_trajectories / generate in the worker's contract; group g of call c scores [1, 0] when
    informative(c, g), else [0, 0]; `make(c, g, k)` may return the whole _Traj instead."""

    def __init__(self, informative, make=None):
        self.informative, self.calls, self.make, self.prompts = informative, 0, make, []

    def make_trajectories(self, rows, n):
        return [(r, k) for r in rows for k in range(n)]

    def generate(self, trajs, seed):
        c = self.calls
        self.calls += 1
        self.prompts.append(sorted({r for r, _ in trajs}))
        if self.make is not None:
            return [self.make(c, r, k) for r, k in trajs], {"rollout/x": float(c)}
        return [_Traj(r, float(k == 0 and self.informative(c, r))) for r, k in trajs], {"rollout/x": float(c)}


def _dapo_trainer(monkeypatch, informative, overrides, make=None):
    from types import SimpleNamespace

    import megatron_searchr1.trainer.rl as rl

    monkeypatch.setattr(rl, "mpu", SimpleNamespace(get_data_parallel_group=lambda: None))
    monkeypatch.setattr(rl.losses, "score_trajectories", lambda trajs, tok, a, **kw: [{"score": t.score} for t in trajs])
    trainer = Trainer.__new__(Trainer)
    trainer.cfg = load_config(None, ["data.train_batch_size=3", "algo.ppo_mini_batch_size=3", "rollout.n=2",
                                     *overrides])
    batches = iter([[3 * b, 3 * b + 1, 3 * b + 2] for b in range(100)])  # prompts 0-2, then 3-5, ...
    trainer.data = SimpleNamespace(train=list(range(300)), sampler=SimpleNamespace(next_batch=lambda: next(batches)))
    trainer.roles = SimpleNamespace(dp_rank=0, dp_size=1, tokenizer=None)
    trainer.worker, trainer.step_no, trainer.rank = _Worker(informative, make), 1, 0
    return trainer


def test_dynamic_sampling_generates_until_the_batch_holds_informative_groups(monkeypatch):
    # one prompt batch per round: call 0: only prompt 1 informative; call 1: prompts 3 and 5 -> 3 groups in 2 calls
    trainer = _dapo_trainer(monkeypatch, lambda c, r: r in (1, 3, 5), ["algo.filter_groups=true",
                                                                       "algo.gen_batches_per_round=1",
                                                                       "algo.max_gen_batches=5"])
    trajs, scores, gids, m = trainer.generate_batch()
    assert trainer.worker.calls == 2 and m["dapo/generate_calls"] == 2
    assert (m["dapo/groups_generated"], m["dapo/groups_kept"]) == (6, 3)
    assert [t.uid for t in trajs] == [1, 1, 3, 3, 5, 5] and [s["score"] for s in scores] == [1, 0] * 3
    assert gids == ["0:1", "0:1", "1:3", "1:3", "1:5", "1:5"]  # a group's id names its call


def test_dynamic_sampling_oversamples_each_round_as_verl_recipe():
    """The defaults are verl-recipe's DAPO: 3 prompt batches per round (gen_batch_size = 3 x train_batch_size), up
    to 10 rounds. On main a round drew one batch and a step gave up after 3."""
    a = load_config(None, ["algo.filter_groups=true"]).algo
    assert (a.gen_batches_per_round, a.max_gen_batches) == (3, 10)


def test_dynamic_sampling_draws_several_batches_per_round(monkeypatch):
    # prompts 1, 5 and 7 are informative: one round of 3 batches (prompts 0-8) finds all three
    trainer = _dapo_trainer(monkeypatch, lambda c, r: r in (1, 5, 7), ["algo.filter_groups=true"])
    trajs, _, gids, m = trainer.generate_batch()
    assert trainer.worker.calls == 1 and trainer.worker.prompts == [list(range(9))]
    assert [t.uid for t in trajs] == [1, 1, 5, 5, 7, 7] and m["dapo/groups_generated"] == 9


def test_dynamic_sampling_trains_on_fewer_groups_rather_than_pad(monkeypatch, capsys):
    """Rounds run out with 1 informative group of 3: the step trains on that group alone (no uninformative filler,
    which a KL loss or an entropy bonus would still train on). On main the batch was filled with set-aside groups."""
    trainer = _dapo_trainer(monkeypatch, lambda c, r: r == 0, ["algo.filter_groups=true", "algo.max_gen_batches=2",
                                                               "algo.gen_batches_per_round=1"])
    trajs, _, gids, m = trainer.generate_batch()
    assert trainer.worker.calls == 2 and m["dapo/groups_kept"] == 1
    assert [t.uid for t in trajs] == [0, 0] and gids == ["0:0", "0:0"]
    assert "found 1 of 3 informative groups" in capsys.readouterr().out


def test_dynamic_sampling_raises_when_too_few_groups_for_the_mini_batches(monkeypatch):
    from megatron_searchr1.cli import UsageError

    # 2 mini-batches of 3 groups x 2 samples; no informative group at all: nothing to train on
    trainer = _dapo_trainer(monkeypatch, lambda c, r: False, ["algo.filter_groups=true", "algo.max_gen_batches=2",
                                                              "data.train_batch_size=6", "algo.ppo_mini_batch_size=3"])
    trainer.data.sampler.next_batch = iter([list(range(6 * b, 6 * b + 6)) for b in range(20)]).__next__
    with pytest.raises(UsageError, match="algo.filter_groups found 0 of 6 informative groups in 2 rounds"):
        trainer.generate_batch()
    assert trainer.worker.calls == 2


def test_dynamic_sampling_counts_groups_from_the_trained_quantity(monkeypatch):
    """Informative = a row that trains gets a nonzero advantage, from the score the advantage uses:
    - prompt 0: four right answers, one in the overlong buffer: shaping makes the group informative (the advantage
      is computed from the shaped score); on main the unshaped scores were all 1 and the group was dropped;
    - prompt 1: [1, 0] where the 0 is a failed search: that row leaves the group (rollout.drop_search_errors), so the
      1 is alone with advantage 0; on main the group was kept and its slot wasted;
    - prompt 2: [1, 0] where the 0 is overlong-filtered: it stays in the statistics, the 1 moves: kept."""
    def make(c, r, k):
        if r == 0:
            return _Traj(r, 1.0, length=62 if k == 0 else 10)
        if r == 1:
            return _Traj(r, 1.0) if k == 0 else _Traj(r, 0.0, finish="search_error")
        if r == 2:
            return _Traj(r, 1.0) if k == 0 else _Traj(r, 0.0, finish="length", length=64)
        return _Traj(r, 0.0)

    trainer = _dapo_trainer(monkeypatch, None, ["algo.filter_groups=true", "algo.max_gen_batches=1",
                                                "algo.gen_batches_per_round=1", "algo.overlong_buffer=8",
                                                "algo.overlong_filter=true", "rollout.max_response_length=64",
                                                "rollout.max_tokens_per_turn=32",
                                                "data.train_batch_size=3", "algo.ppo_mini_batch_size=1"],
                            make=make)
    trajs, _, _, m = trainer.generate_batch()
    assert sorted({t.uid for t in trajs}) == [0, 2] and m["dapo/groups_kept"] == 2


def test_without_filter_groups_one_generate_call_keeps_every_group(monkeypatch):
    trainer = _dapo_trainer(monkeypatch, lambda c, r: False, [])
    trajs, _, _, m = trainer.generate_batch()
    assert trainer.worker.calls == 1 and len(trajs) == 6 and "dapo/generate_calls" not in m


def test_stop_on_collapse_fires_on_a_fall_of_the_positive_advantage_likelihood(capsys):
    trainer = Trainer.__new__(Trainer)
    trainer.cfg = load_config(None, ["trainer.stop_on_collapse=true", "trainer.collapse_window=2",
                                     "trainer.collapse_nats=0.3"])
    trainer.logp_pos_history, trainer.rank = [], 0
    fired = []
    for step, v in enumerate([-0.5, -0.55, -0.6, -0.9], start=1):
        trainer.step_no = step
        fired.append(trainer.collapsed({"actor/logp_pos_mean": v}))
    assert fired == [False, False, False, True]  # -0.55 -> -0.9 over 2 steps: 0.35 > 0.3
    assert "actor/logp_pos_mean" in capsys.readouterr().out
    off = Trainer.__new__(Trainer)
    off.cfg, off.logp_pos_history, off.rank = load_config(None, []), [-0.5, -0.55, -0.6], 0
    assert off.collapsed({"actor/logp_pos_mean": -5.0}) is False  # off by default


# ------------------------------------------------------------------------------------------------ the collapse watch
def _healthy_step(monkeypatch, n_right: int, n_rows: int = 8):
    """Trainer.update over one step of a healthy run: `n_right` of `n_rows` responses right (advantage +1, the
    others -1), every positive-advantage token at old log-prob -2.0 and every negative one at -1.0, whatever
    the accuracy. The schedule is replaced by its metric contract (forward_backward: the sum over micro-batches of
    loss_token_weight * metric), each sequence its own micro-batch, over the real actor loss."""
    import megatron_searchr1.megatron.schedule as schedule
    from megatron_searchr1.megatron.batching import make_micro_batches

    def train_step(model, optimizer, scheduler, micro_batches, loss_fn, **kw):
        if model != "actor":
            return {"loss": 0.0}
        total = sum(float(mb["loss_mask"].sum()) for mb in micro_batches)
        sums: dict = {}
        for mb in micro_batches:
            mb.num_loss_tokens, mb.global_num_loss_tokens = float(mb["loss_mask"].sum()), total
            mb.global_num_seqs = n_rows
            lp = torch.where(mb["advantages"] > 0, -2.0, -1.0) * mb["loss_mask"]
            _, m = loss_fn({"log_probs": lp}, mb)
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + mb.loss_token_weight * float(v)
        return sums

    monkeypatch.setattr(schedule, "train_step", train_step)
    trainer = Trainer.__new__(Trainer)
    trainer.cfg = load_config(None, [f"data.train_batch_size={n_rows}", f"algo.ppo_mini_batch_size={n_rows}",
                                     "algo.use_kl_loss=false", "optim.max_tokens_per_micro_batch=64"])
    trainer.policy, trainer.critic, trainer.step_no = Policy("actor", None, _Sched()), None, 1
    seqs = []
    for i in range(n_rows):
        R = 10 + (i % 3)  # prompt 30 + response 10-12 tokens: one sequence per micro-batch of 64
        s = TrainSequence([1] * 30, [3] * R, torch.ones(R))
        s.advantages = torch.full((R,), 1.0 if i < n_right else -1.0)
        seqs.append(s)
    assert len(make_micro_batches(seqs, 64)) == n_rows
    return trainer.update(seqs)


def test_the_collapse_watch_does_not_fire_when_only_the_accuracy_changes(monkeypatch, capsys):
    """A healthy run whose accuracy rises from 1/8 to 7/8 (and one step with no right answer): the likelihood of
    positive-advantage tokens never moves (-2.0), so actor/logp_pos_mean stays -2.0, the step with no positive
    token has no value, and trainer.stop_on_collapse does not fire. On main the metric was a token-weighted mean of
    micro-batch means with 0 for micro-batches without a positive token: it went from about -0.25 to -1.7 and the
    watch (0.5 nats over 3 steps) stopped the run."""
    history = [_healthy_step(monkeypatch, k) for k in (1, 0, 3, 5, 7)]
    assert [round(m.get("actor/logp_pos_mean", float("nan")), 6) for m in history[:1] + history[2:]] == [-2.0] * 4
    assert "actor/logp_pos_mean" not in history[1]  # no positive-advantage token: no value, not 0
    assert all(m["actor/logp_neg_mean"] == pytest.approx(-1.0) for m in history)
    # the LLDS reference's curve (old log-probs of A >= 0 tokens over all tokens) moves with the accuracy
    paper = [m["actor/logp_pos_avg_llds"] for m in history]
    assert paper[-1] < paper[0] - 0.5
    trainer = Trainer.__new__(Trainer)
    trainer.cfg = load_config(None, ["trainer.stop_on_collapse=true", "trainer.collapse_window=3",
                                     "trainer.collapse_nats=0.5"])
    trainer.logp_pos_history, trainer.rank = [], 0
    fired = []
    for step, m in enumerate(history, start=1):
        trainer.step_no = step
        fired.append(trainer.collapsed(m))
    assert fired == [False] * 5 and "stopping" not in capsys.readouterr().out
