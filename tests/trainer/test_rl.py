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
    def __init__(self, uid, score):
        self.uid, self.score = uid, score


class _Worker:
    """make_trajectories / generate in the worker's contract; group g of call c scores [1, 0] when
    informative(c, g), else [0, 0]."""

    def __init__(self, informative):
        self.informative, self.calls = informative, 0

    def make_trajectories(self, rows, n):
        return [(r, k) for r in rows for k in range(n)]

    def generate(self, trajs, seed):
        c = self.calls
        self.calls += 1
        return [_Traj(r, float(k == 0 and self.informative(c, r))) for r, k in trajs], {"rollout/x": float(c)}


def _dapo_trainer(monkeypatch, informative, overrides):
    from types import SimpleNamespace

    import megatron_searchr1.trainer.rl as rl

    monkeypatch.setattr(rl, "mpu", SimpleNamespace(get_data_parallel_group=lambda: None))
    monkeypatch.setattr(rl.losses, "score_trajectories", lambda trajs, tok, a: [{"score": t.score} for t in trajs])
    trainer = Trainer.__new__(Trainer)
    trainer.cfg = load_config(None, ["data.train_batch_size=3", "algo.ppo_mini_batch_size=3", "rollout.n=2",
                                     *overrides])
    batches = iter([[3 * b, 3 * b + 1, 3 * b + 2] for b in range(100)])  # prompts 0-2, then 3-5, ...
    trainer.data = SimpleNamespace(train=list(range(300)), sampler=SimpleNamespace(next_batch=lambda: next(batches)))
    trainer.roles = SimpleNamespace(dp_rank=0, dp_size=1, tokenizer=None)
    trainer.worker, trainer.step_no, trainer.rank = _Worker(informative), 1, 0
    return trainer


def test_dynamic_sampling_generates_until_the_batch_holds_informative_groups(monkeypatch):
    # call 0: only prompt 1 informative; call 1: prompts 3 and 5 -> 3 informative groups after 2 calls
    trainer = _dapo_trainer(monkeypatch, lambda c, r: r in (1, 3, 5), ["algo.filter_groups=true",
                                                                       "algo.max_gen_batches=5"])
    trajs, scores, gids, m = trainer.generate_batch()
    assert trainer.worker.calls == 2 and m["dapo/generate_calls"] == 2
    assert (m["dapo/groups_generated"], m["dapo/groups_kept"]) == (6, 3)
    assert [t.uid for t in trajs] == [1, 1, 3, 3, 5, 5] and [s["score"] for s in scores] == [1, 0] * 3
    assert gids == ["0:1", "0:1", "1:3", "1:3", "1:5", "1:5"]  # a group's id names its call


def test_dynamic_sampling_stops_at_max_gen_batches_and_fills_with_set_aside_groups(monkeypatch, capsys):
    trainer = _dapo_trainer(monkeypatch, lambda c, r: r == 0, ["algo.filter_groups=true", "algo.max_gen_batches=2"])
    trajs, _, gids, m = trainer.generate_batch()
    assert trainer.worker.calls == 2 and m["dapo/groups_kept"] == 1
    assert len(trajs) == 6 and gids[:2] == ["0:0", "0:0"]  # the informative group first, then two set aside
    assert "found 1 of 3 informative groups" in capsys.readouterr().out


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
