"""Which trainer states each phase of a step holds: the planner's `resident_states` against the real offload.

A tiny bf16 actor, reference and critic (distributed optimizer, one real optimizer step each, so Adam's state and
the fp32 masters exist) go through the rollout worker's own `sync` and `sleep` (trainer/roles.py) with
megatron/offload.py's GenerationOffload, a stand-in engine and a stand-in weight sync. At the weight sync, when the
KV cache wakes (generation) and after `sleep` (the log-prob passes and the update follow it in `Trainer.step`) the
test reads which storages still hold bytes; the planner must say the same for every offload flag.
"""
import itertools
from types import SimpleNamespace

import pytest
import torch

from megatron_searchr1 import plan
from megatron_searchr1.rollout import weight_sync
from megatron_searchr1.rollout.engine import KV_CACHE
from megatron_searchr1.trainer.roles import RolloutWorker

TINY = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=300, hidden_size=32,
            intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, tie_word_embeddings=False)
FLAGS = ("param_offload", "grad_offload", "optimizer_offload", "ref_offload")


@pytest.fixture(scope="module")
def models():
    from megatron_searchr1.megatron.initialize import destroy_megatron, initialize_megatron
    from megatron_searchr1.megatron.optimizer import build_optimizer
    from megatron_searchr1.trainer.roles import build_actor, build_critic, build_reference

    initialize_megatron(tp=1, pp=1, device="cpu")
    out = {"ref": build_reference(TINY, params_dtype=torch.bfloat16)}
    for name, build in (("actor", build_actor), ("critic", build_critic)):
        model = build(TINY, params_dtype=torch.bfloat16, use_distributed_optimizer=True)
        opt, _ = build_optimizer(model, lr=1e-3)
        model.zero_grad_buffer()
        opt.zero_grad()
        model(torch.randint(0, 300, (2, 8)), None, None).float().mean().backward()
        model.finish_grad_sync()
        assert opt.step()[0]
        out[name], out[name + "_opt"] = model, opt
    yield out
    destroy_megatron()


def _holds(tensors) -> bool:
    tensors = list(tensors)
    assert tensors
    return all(t.untyped_storage().nbytes() > 0 for t in tensors)


def _adam_state(opt) -> list:
    return [t for o in getattr(opt, "chained_optimizers", [opt]) for s in o.optimizer.state.values()
            for t in s.values() if torch.is_tensor(t) and t.dim() > 0]


def resident(m) -> frozenset:
    """The state kinds whose storages hold bytes now (each kind all or nothing)."""
    kinds = {
        "actor weights": m["actor"].module.parameters(),
        "actor gradients (fp32)": [b.grad_data for b in m["actor"].buffers],
        "actor optimizer": _adam_state(m["actor_opt"]),
        "reference weights": m["ref"].parameters(),
        "critic weights": m["critic"].module.parameters(),
        "critic gradients (fp32)": [b.grad_data for b in m["critic"].buffers],
        "critic optimizer": _adam_state(m["critic_opt"]),
    }
    assert set(kinds) == set(plan.STATE_KINDS)
    return frozenset(k for k, tensors in kinds.items() if _holds(tensors))


class Engine:
    """Records what the trainer holds when the KV cache wakes: generation runs from there to `sleep`."""

    def __init__(self, seen, m):
        self.seen, self.m = seen, m

    def wake_up(self, tags=None):
        if KV_CACHE in (tags or []):
            self.seen["rollout"] = resident(self.m)

    def sleep(self, level):
        return level == 2


@pytest.mark.parametrize("flags", [(), FLAGS, *[(f,) for f in FLAGS], ("param_offload", "ref_offload")],
                         ids=lambda f: "+".join(f) or "none")
def test_each_phase_holds_what_the_offload_leaves(models, monkeypatch, flags):
    from megatron_searchr1.megatron.offload import GenerationOffload

    model_cfg = SimpleNamespace(**{f: f in flags for f in FLAGS})
    seen: dict = {}

    def sync_weights(*args, **kw):
        seen["weight sync"] = resident(models)

    monkeypatch.setattr(weight_sync, "sync_weights", sync_weights)
    offload = GenerationOffload(model_cfg, actor=models["actor"], actor_opt=models["actor_opt"],
                                critic=models["critic"], critic_opt=models["critic_opt"], ref=models["ref"])
    cfg = SimpleNamespace(rollout=SimpleNamespace(sync_bucket_mb=64, sleep_between_steps=True, sleep_level=2))
    worker = SimpleNamespace(cfg=cfg, engine=Engine(seen, models), offload=offload, synced=False, asleep=True,
                             sync_dtype=torch.bfloat16)
    RolloutWorker.sync(worker, SimpleNamespace(model=models["actor"], mapping=None))
    RolloutWorker.sleep(worker)
    seen["log-prob passes"] = seen["update peak"] = resident(models)  # Trainer.step: forwards, then the update
    assert set(seen) == set(plan.PHASES) - {"start-up"}
    for phase, held in seen.items():
        assert plan.resident_states(phase, model_cfg) == held, (phase, flags)
    assert seen["update peak"] == frozenset(plan.STATE_KINDS)  # reload() brought everything back


def test_the_planner_counts_the_resident_states_in_every_phase():
    """plan_memory's state rows are zero exactly where resident_states leaves a state out (the 7B PPO recipe has an
    actor, a reference through ref_offload and a critic)."""
    import os

    from tests.dist_utils import REPO

    configs = os.path.join(REPO, "tests", "models", "real_configs")
    for flags in itertools.product([False, True], repeat=4):
        over = [f"model.{f}={str(v).lower()}" for f, v in zip(FLAGS, flags)]
        cfg, hf = plan.load_plan_inputs(os.path.join(REPO, "examples", "ppo_qwen2.5-7b.yaml"),
                                        over, 8,
                                        os.path.join(configs, "Qwen2.5-7B-Instruct.json"))
        result, _, _ = plan.plan_config(cfg, hf, nodes=1)
        for phase in result.phases:
            rows = {k for k in plan.STATE_KINDS if phase.items.get(k)}
            assert rows == plan.resident_states(phase.name, cfg.model), (phase.name, flags)
