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
    gives k - 1 critic-only steps; the critic trains every step (issue 20, bug 8)."""
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
    tensor kept for backward, issue 19); with a bonus, for the entropy with its gradient."""
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
