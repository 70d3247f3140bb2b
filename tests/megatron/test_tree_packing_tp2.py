"""rollout.tree.pack_forward inside the real Trainer under torchrun (gloo), TP=2 with sequence parallelism and PP=2:
the PPO step's metrics with packed forwards equal the per-leaf run's, and the packed forwards of the actor, the
reference and the critic equal their per-leaf forwards on the step's leaves (tests/megatron/tree_pack_script.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.dist_utils import REPO
from tests.rl_fixtures import child_env, rl_root, server, tiny_model, world  # noqa: F401 (fixtures)
from tests.test_train import rl_args

SAME = ["actor/loss", "actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy", "critic/vf_loss",
        "critic/grad_norm", "reward/mean", "rollout/response_length_mean"]


@pytest.mark.slow
def test_packed_forwards_give_the_per_leaf_step_at_tp2_sp_and_pp2(world, tiny_model, server, rl_root):
    out = os.path.join(rl_root, "tree_pack_tp2")
    os.makedirs(out, exist_ok=True)
    config, *overrides = rl_args(
        world, tiny_model, server, out, "rollout.engine=hf", "parallel.sequence_parallel=true",
        "data.val_files=[]", "logging.tensorboard=false", "logging.trajectories_per_step=0",
        "trainer.save_freq=0", "trainer.export_hf=false", "data.train_batch_size=2",
        "rollout.n=4", "rollout.tree.trees=2", "rollout.tree.rounds=1", "rollout.tree.samples=1",
        # GAE: the critic's forward too; two mini-batches: the old log-probs' own forward (off-policy)
        "algo.adv_estimator=gae", "algo.ppo_mini_batch_size=1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "tests.megatron.tree_pack_script", "--out", out, config, *overrides]
    start = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-8000:]
    print(f"tree packing launch: {time.time() - start:.0f} s")
    with open(os.path.join(out, "result.json")) as f:
        res = json.load(f)
    per_leaf, packed = res["per_leaf"]["metrics"], res["packed"]["metrics"]
    assert res["leaves"] == 8 and res["trees"] == 4
    # the packed path ran (its own metric), and computed fewer tokens than one sequence per leaf
    assert "tree/packed_forward_token_ratio" not in per_leaf
    assert 0 < packed["tree/packed_forward_token_ratio"] < 1
    assert per_leaf["actor/grad_norm"] > 0 and per_leaf["critic/grad_norm"] > 0
    for key in SAME:
        assert packed[key] == pytest.approx(per_leaf[key], rel=1e-4, abs=1e-6), (key, packed[key], per_leaf[key])
    # PP=2: the stages share one packed plan; the same step (layouts agree to 1e-4, tests/test_layout_sweep.py)
    pp2 = res["packed_pp2"]["metrics"]
    assert 0 < pp2["tree/packed_forward_token_ratio"] < 1
    for key in SAME:
        assert pp2[key] == pytest.approx(per_leaf[key], rel=1e-4, abs=1e-6), (key, pp2[key], per_leaf[key])
    for run in ("packed", "packed_pp2"):
        d = res[run]["direct"]
        assert d["critic_scale"] > 0 and d["actor_scale"] > 0
        assert d["actor"] < 1e-4 and d["reference"] < 1e-4 and d["critic"] < 1e-3 * d["critic_scale"], (run, d)
