"""The reference model of a run started from another run's root (`model.megatron_ckpt=<run>`): pinned once to a
concrete step directory (trainer/sources.py pin_model_source), recorded in every checkpoint (Trainer.save), and reloaded from
the recorded one on resume even after that root's `latest` has moved on (Trainer._resume). One process, no models:
the trainer's roles are stand-ins and the weight loading is recorded instead of done."""
import os
from types import SimpleNamespace

import pytest

import megatron_searchr1.trainer.sources as runtime
from megatron_searchr1.checkpoint import CheckpointError, save_checkpoint, step_dir
from megatron_searchr1.config import Config
from megatron_searchr1.metrics import RunLogger
from megatron_searchr1.trainer.build import Data
from megatron_searchr1.trainer.rl import Trainer
from megatron_searchr1.trainer.roles import Policy


class _Sampler:
    def state_dict(self):
        return {"cursor": 3}

    def load_state_dict(self, state):
        self.state = state


class _KL:
    def state_dict(self):
        return {"value": 0.001}

    def load_state_dict(self, state):
        self.state = state


def _trainer(tmp_path, model_source):
    """A Trainer without a build: only what save() and _resume() read."""
    cfg = Config()
    cfg.trainer.output_dir = str(tmp_path / "run")
    tr = object.__new__(Trainer)
    tr.cfg, tr.step_no, tr.ckpt_root = cfg, 0, os.path.join(cfg.trainer.output_dir, "checkpoints")
    tr.policy = Policy(object(), object(), object(), hf_dir=str(tmp_path), source=model_source)
    tr.reference = Policy(object(), source=model_source)
    tr.critic, tr.rank, tr.data = None, 0, Data([], [], _Sampler())
    tr.roles = SimpleNamespace(kl_ctrl=_KL(), logger=RunLogger(cfg.trainer.output_dir, enabled=False))
    return tr


def test_pin_resolves_a_run_root_to_its_step_now(tmp_path):
    sft = str(tmp_path / "sft" / "checkpoints")
    save_checkpoint(sft, 10, {}, {}, {})
    pinned = runtime.pin_model_source(str(tmp_path / "sft"))
    assert pinned == os.path.join(step_dir(sft, 10), "actor")
    save_checkpoint(sft, 20, {}, {}, {})  # that run trains on: its root now means step 20, the pin does not move
    assert runtime.resolve_model_source(str(tmp_path / "sft")) == os.path.join(step_dir(sft, 20), "actor")
    hf = str(tmp_path / "hf")
    os.makedirs(hf)
    assert runtime.pin_model_source(hf) == hf  # a plain HF directory is its own pin


def test_resume_reloads_the_recorded_reference_not_the_roots_latest(tmp_path, monkeypatch):
    sft = str(tmp_path / "sft" / "checkpoints")
    save_checkpoint(sft, 10, {}, {}, {})
    first = runtime.pin_model_source(sft)
    os.makedirs(first)  # the step's actor directory (its weights are not read here)

    # the run saves a checkpoint: it records the pinned reference
    saved = {}

    def fake_save(root, step, states, extra, **kw):
        assert sorted(states) == ["actor"]  # the policy's state; the reference is recorded by its source only
        saved.update(extra)
        save_checkpoint(root, step, {}, {}, {}, extra)

    monkeypatch.setattr("megatron_searchr1.trainer.rl.save_roles", fake_save)
    tr = _trainer(tmp_path, first)
    tr.step_no = 2
    tr.save()
    assert saved["ref_source"] == first

    # the SFT run moved on; the restarted trainer's build pinned the new latest, then resumes
    save_checkpoint(sft, 20, {}, {}, {})
    now = runtime.pin_model_source(sft)
    assert now != first
    loaded = []
    monkeypatch.setattr(runtime, "weights_loader", lambda hf_config, source: lambda m: loaded.append(source))
    monkeypatch.setattr("megatron_searchr1.trainer.rl.load_roles", lambda root, step, states: {**saved, "step": step})
    tr = _trainer(tmp_path, now)
    tr._resume()
    assert tr.step_no == 2
    assert loaded == [first] and tr.reference.source == first

    # the recorded reference is gone (pruned by that run's keep_last): a clear error, not a silent other model
    os.rmdir(first)
    tr = _trainer(tmp_path, now)
    with pytest.raises(CheckpointError, match="reference model this run was started with.* is gone"):
        tr._resume()
