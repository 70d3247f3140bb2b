"""GRPO on a tiny Qwen3-MoE at expert parallelism 2 (tp=1, two ranks), end to end with vLLM rollouts (slow)."""
from __future__ import annotations

import os

import pytest

from tests.dist_utils import REPO
from tests.rl_fixtures import TINY_MODEL_ARGS, _world_text, rl_root, run_module, server, world  # noqa: F401
from tests.test_train import rl_args


@pytest.fixture(scope="module")
def tiny_moe(world, rl_root):
    from megatron_searchr1.models.tiny import TinyModelConfig, make_tiny_model

    out = os.path.join(rl_root, "tiny_moe")
    text = os.path.join(rl_root, "world_text_moe.txt")
    _world_text(world, text)
    make_tiny_model(TinyModelConfig(output_dir=out, text_files=[text], arch="qwen3_moe", num_experts=4,
                                    moe_intermediate_size=64, **TINY_MODEL_ARGS))
    return out


@pytest.mark.slow
def test_grpo_two_steps_at_ep2(world, tiny_moe, server, rl_root):
    """Two GRPO steps at parallel.ep=2: the experts split over the two ranks, synced to each rank's vLLM engine
    (rollout/weight_sync.sync_expert_weights) after step 1's update: the engine's log-probs stay the trainer's, and
    the load-balancing metrics are logged."""
    from megatron_searchr1.metrics import read_scalars

    out = os.path.join(rl_root, "grpo_moe")
    run_module("megatron_searchr1.train", rl_args(world, tiny_moe, server, out, "trainer.total_steps=2",
                                                  "parallel.tp=1", "parallel.ep=2", "trainer.save_freq=0",
                                                  "trainer.export_hf=false"), nproc=2)
    scalars = read_scalars(os.path.join(out, "tensorboard"))
    assert [s for s, _ in scalars["reward/mean"]] == [1, 2]
    assert all(v < 1e-3 for _, v in scalars["train/logprob_gap_engine"]), scalars["train/logprob_gap_engine"]
    assert "actor/moe/load_balancing_loss" in scalars and "actor/moe/tokens_per_expert/layer_1/max" in scalars

