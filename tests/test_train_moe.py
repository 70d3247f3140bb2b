"""GRPO on a tiny Qwen3-MoE at expert parallelism 2 (tp=1, two ranks), end to end with vLLM rollouts (slow); a
run stopped at EP=2 resumes at EP=1."""
from __future__ import annotations

import os

import pytest

from tests.dist_utils import REPO
from tests.rl_fixtures import TINY_MODEL_ARGS, rl_root, run_module, server, world, world_text_file  # noqa: F401
from tests.test_train import STEP_FIELDS_THAT_VARY, rl_args, step_metrics


@pytest.fixture(scope="module")
def tiny_moe(world, rl_root):
    from megatron_searchr1.models.tiny import TinyModelConfig, make_tiny_model

    out = os.path.join(rl_root, "tiny_moe")
    make_tiny_model(TinyModelConfig(output_dir=out, text_files=[world_text_file(world, rl_root)], arch="qwen3_moe",
                                    num_experts=4, moe_intermediate_size=64, **TINY_MODEL_ARGS))
    return out


@pytest.fixture(scope="module")
def ep2_run(world, tiny_moe, server, rl_root):
    """Three uninterrupted GRPO steps at parallel.ep=2 (two ranks); the output directory."""
    out = os.path.join(rl_root, "grpo_moe")
    run_module("megatron_searchr1.train", rl_args(world, tiny_moe, server, out, "trainer.total_steps=3",
                                                  "parallel.tp=1", "parallel.ep=2", "trainer.save_freq=0",
                                                  "trainer.export_hf=false", "algo.routing_replay=true"), nproc=2)
    return out


@pytest.mark.slow
def test_grpo_two_steps_at_ep2(ep2_run):
    """GRPO steps at parallel.ep=2: the experts split over the two ranks, synced to each rank's vLLM engine
    (rollout/weight_sync.sync_expert_weights) after each update: the engine's log-probs stay the trainer's, and
    the load-balancing metrics are logged. With algo.routing_replay each engine records its experts per token and
    the reference and update forwards replay them under the expert all-to-all (megatron/routing_replay.py)."""
    from megatron_searchr1.metrics import read_scalars

    scalars = read_scalars(os.path.join(ep2_run, "tensorboard"))
    assert [s for s, _ in scalars["reward/mean"]] == [1, 2, 3]
    assert all(v < 1e-3 for _, v in scalars["train/logprob_gap_engine"]), scalars["train/logprob_gap_engine"]
    assert "actor/moe/load_balancing_loss" in scalars and "actor/moe/tokens_per_expert/layer_1/max" in scalars
    # routing replay: the engine recorded the experts of every token that reaches a sampled token's log-prob
    assert [v for _, v in scalars["rollout/routing_unrecorded"]] == [0.0] * 3, scalars["rollout/routing_unrecorded"]



@pytest.mark.slow
def test_resume_at_ep1_continues_an_ep2_run(ep2_run, world, tiny_moe, server, rl_root):
    """2 steps at EP=2, stop; resume at EP=1 on the same two ranks (tp=1: DP=2 both times, so the data sampler,
    the engines and the restored RNG states are the same) and step 3 matches the uninterrupted EP=2 run's.

    EP=1 keeps the expert parameters in the dense optimizer, EP=2 in a separate one
    (checkpoint.optimizer.load_optimizer).
    Rollout and reward metrics are equal exactly (the weights before step 3 are loaded as saved); the training
    metrics within 1e-4: at EP=2 an expert's gradient is one sum over both ranks' tokens, at EP=1 two per-rank sums
    all-reduced, so the float reduction order differs."""
    from megatron_searchr1.checkpoint import latest_step

    out = os.path.join(rl_root, "grpo_moe_resumed")
    common = ("parallel.tp=1", "trainer.export_hf=false", "algo.routing_replay=true")
    run_module("megatron_searchr1.train", rl_args(world, tiny_moe, server, out, "trainer.total_steps=2",
                                                  "parallel.ep=2", *common), nproc=2)
    proc = run_module("megatron_searchr1.train", rl_args(world, tiny_moe, server, out, "trainer.total_steps=3",
                                                         "parallel.ep=1", *common), nproc=2)
    assert "at step 2" in proc.stdout + proc.stderr
    assert latest_step(os.path.join(out, "checkpoints")) == 3

    want, got = step_metrics(ep2_run)[3], step_metrics(out)[3]
    # sync/: the weight-sync volume follows the layout (at EP=2 each rank sends only its own experts)
    keys = [k for k in want if not k.startswith((*STEP_FIELDS_THAT_VARY, "sync/"))]
    trained = [k for k in keys if k.startswith(("actor/", "train/"))]
    assert {k: got.get(k) for k in keys if k not in trained} == {k: want[k] for k in keys if k not in trained}
    far = {k: (want[k], got.get(k)) for k in trained if got.get(k) != pytest.approx(want[k], rel=1e-4, abs=1e-6)}
    assert not far, f"step 3 differs: {far}"
