"""The trainer's wake / sync / sleep choreography (trainer/roles.py RolloutWorker.sync, sleep; rollout/engine.py),
with an engine double that records every call, torch.cuda.empty_cache recorded, and the weight sync replaced."""
from types import SimpleNamespace

import pytest
import torch

import megatron_searchr1.megatron.offload as offload_mod
import megatron_searchr1.rollout.weight_sync as weight_sync
from megatron_searchr1.config import load_config
from megatron_searchr1.rollout.engine import sleep_engine, wake_and_sync
from megatron_searchr1.megatron.offload import GenerationOffload
from megatron_searchr1.trainer.roles import Policy, RolloutWorker


class RecordingEngine:
    """Sleeps like vLLM on a GPU: level 2 drops the weights."""

    def __init__(self, calls):
        self.calls = calls

    def sleep(self, level=1):
        self.calls.append(("sleep", level))
        return level == 2

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags) if tags is not None else None))


@pytest.fixture
def calls(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty_cache",)))
    monkeypatch.setattr(weight_sync, "sync_weights",
                        lambda actor, engine, *a, **kw: calls.append(("sync",)) or SimpleNamespace(as_dict=dict))
    return calls


class _Trainer:
    """The trainer's side of the choreography: its rollout worker, fed from its policy (RolloutWorker.sync)."""

    def __init__(self, calls, overrides, actor_opt=None, ref=None):
        cfg = load_config(None, list(overrides))
        self.policy = Policy("actor", actor_opt)
        self.worker = RolloutWorker(cfg, RecordingEngine(calls), None, None, (), rank=0, world=1,
                                    offload=GenerationOffload(cfg.model, actor="actor", actor_opt=actor_opt, ref=ref))

    def sync_engine(self):
        return self.worker.sync(self.policy)

    def wake_engine(self):  # the rollout's call before generating: the engine is awake and synced already
        return self.worker.sync(self.policy)

    def sleep_engine(self):
        self.worker.sleep()

    @property
    def synced(self):
        return self.worker.synced

    @synced.setter
    def synced(self, value):
        self.worker.synced = value


def _trainer(calls, *overrides, **roles):
    return _Trainer(calls, overrides, **roles)


WAKE = [("empty_cache",), ("wake_up", ("weights",)), ("sync",), ("empty_cache",), ("wake_up", ("kv_cache",))]


def test_trainer_wakes_weights_syncs_then_kv_cache(calls):
    """verl's order (megatron_workers.rollout_mode): empty the cache, wake the weights only, sync, empty the cache,
    wake the KV cache; sleep at rollout.sleep_level (2 by default). On main: one wake_up() of everything before the
    sync, no empty_cache, sleep() at level 1."""
    trainer = _trainer(calls)
    trainer.sync_engine()   # step 1: the engine starts awake; the wake-ups are no-ops for it
    trainer.wake_engine()   # the rollout's call: nothing more to do
    trainer.sleep_engine()
    assert calls == WAKE + [("sleep", 2)]
    calls.clear()
    trainer.synced = False  # the update changed the actor
    trainer.sync_engine()
    assert calls == WAKE


def test_level_2_sleep_forces_a_sync_even_without_an_update(calls):
    """Validation before step 1 syncs, then sleeps at level 2: step 1 has the same actor but the engine dropped
    its weights, so the next wake-up syncs again. At level 1 the engine keeps them and no sync runs."""
    trainer = _trainer(calls)
    trainer.sync_engine()
    trainer.sleep_engine()
    calls.clear()
    trainer.sync_engine()
    assert calls == WAKE

    trainer = _trainer(calls, "rollout.sleep_level=1")
    trainer.sync_engine()
    trainer.sleep_engine()
    assert calls[-1] == ("sleep", 1)
    calls.clear()
    trainer.sync_engine()
    assert calls == [c for c in WAKE if c != ("sync",)]


def test_no_sleep_between_steps_never_sleeps(calls):
    trainer = _trainer(calls, "rollout.sleep_between_steps=false")
    trainer.sync_engine()
    trainer.sleep_engine()
    assert ("sleep", 2) not in calls and calls.count(("sync",)) == 1


def test_offload_runs_around_the_wake_when_asked(calls, monkeypatch):
    """model.*_offload: the optimizer/gradients/reference go before the engine wakes, the actor's weights after the
    sync (which reads them), and everything comes back after the engine sleeps."""
    for name in ("offload_grads", "offload_optimizer", "offload_params"):
        monkeypatch.setattr(offload_mod, name, lambda model, stash, *a, _n=name: calls.append((_n, model)))
    monkeypatch.setattr(offload_mod.Stash, "reload", lambda self: calls.append(("reload",)))
    monkeypatch.setattr(offload_mod.Stash, "empty", property(lambda self: False))
    trainer = _trainer(calls, "model.param_offload=true", "model.grad_offload=true", "model.optimizer_offload=true",
                       "model.ref_offload=true", actor_opt="actor_opt", ref="ref")
    trainer.sync_engine()
    trainer.sleep_engine()
    released = [("empty_cache",)]  # offload's own release after each move
    assert calls == ([("offload_grads", "actor"), ("offload_optimizer", "actor_opt"), ("offload_params", "ref")]
                     + released + WAKE[:3] + [("offload_params", "actor")] + released + WAKE[3:]
                     + [("sleep", 2), ("reload",)])


def test_no_offload_by_default(calls, monkeypatch):
    monkeypatch.setattr(offload_mod, "_copy_out", lambda *a: calls.append(("copy_out",)))
    trainer = _trainer(calls)
    trainer.sync_engine()
    trainer.sleep_engine()
    assert ("copy_out",) not in calls and calls == WAKE + [("sleep", 2)]


def test_helpers_without_cuda_call_no_empty_cache(monkeypatch):
    """On the CPU the choreography is the same calls minus empty_cache (no CUDA: nothing to hand back)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty_cache",)))
    engine = RecordingEngine(calls)
    assert wake_and_sync(engine, lambda: calls.append(("sync",)) or 7) == 7
    assert sleep_engine(engine, 2) is True and sleep_engine(engine, 1) is False
    assert calls == [("wake_up", ("weights",)), ("sync",), ("wake_up", ("kv_cache",)), ("sleep", 2), ("sleep", 1)]
    with pytest.raises(ValueError, match="sleep level"):
        sleep_engine(engine, 0)
