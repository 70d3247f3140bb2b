"""A DP rank whose searches all fail: the step completes on both ranks and reports the drop; above
retrieval.max_error_rate the run stops on every rank together, also when the server dies or hangs.

Slow: two torchrun ranks (DP=2, tiny model, scripted `hf` engine so every trajectory searches), GRPO and PPO
(GAE with a critic). Before the fix GRPO raised in mean_over_ranks (rank 1 had no advantage keys) and GAE
raised in masked_var on rank 1 while rank 0 waited in the next collective.
"""
import json
import os
import re
import signal
import time

import pytest

from tests.rl_fixtures import rl_root, run_module, tiny_model, world  # noqa: F401 (fixtures)


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_one_rank_whose_searches_all_fail_completes_the_step(estimator, world, tiny_model, rl_root):
    out = os.path.join(rl_root, f"fail_{estimator}")
    # as a module from the repo root: run as a file, tests/megatron/ would shadow the megatron package
    proc = run_module("tests.train_failures_script", [estimator, tiny_model, os.path.join(world, "train.parquet"),
                                                      out], nproc=2, timeout=600)
    log = proc.stdout + proc.stderr
    line = [ln for ln in log.splitlines() if ln.startswith("METRICS ")]
    assert line, log[-4000:]
    metrics = json.loads(line[-1][len("METRICS "):])
    # rank 1's two trajectories, counted on every rank
    assert metrics["train/dropped_trajectories"] == 2, {k: v for k, v in metrics.items() if "rollout" in k}
    assert metrics["rollout/search_error_rate"] == pytest.approx(0.5)  # the step's share, logged per step
    assert metrics["rollout/finish_search_error"] == pytest.approx(0.5)
    assert metrics["train/lone_samples"] == 0
    for key in ("actor/advantages_mean", "actor/advantages_abs_mean", "actor/pg_loss"):
        assert key in metrics and metrics[key] == metrics[key], key  # present and not NaN
    if estimator == "gae":
        assert "critic/vf_loss" in metrics
    # the two DP ranks sampled with different seeds (each DP rank samples with its own seed)
    seeds = dict(re.findall(r"SEEDS dp_rank=(\d) (\[[^]]*\])", log))  # two ranks may share a line
    assert set(seeds) == {"0", "1"} and seeds["0"] != seeds["1"], seeds
    if estimator == "grpo":
        # DAPO's dynamic sampling at DP=2 (train_failures_script.dapo_step): DP rank 0's first group is informative,
        # DP rank 1's only its third, so both ranks make three generate calls (one making fewer would leave the
        # other waiting in a collective); every group's rollout.n=2 samples are made on one rank, never both
        calls = {rank: json.loads(c) for rank, _, c in re.findall(r"DAPO rank=(\d) dp_rank=(\d) (\[\[.*?\]\]\])", log)}
        assert sorted(calls) == ["0", "1"], log[-4000:]
        assert len(calls["0"]) == len(calls["1"]) == 3, calls
        groups = {rank: [uid for call in c for uid, samples in call if samples == 2] for rank, c in calls.items()}
        assert [len(g) for g in groups.values()] == [3, 3], calls  # one prompt per rank per call, both samples
        assert not set(groups["0"]) & set(groups["1"]), calls
        dapo = json.loads(re.search(r"DAPO_METRICS (\{[^{}]*\})", log).group(1))  # a flat dict
        assert dapo["dapo/generate_calls"] == 3 and dapo["dapo/groups_generated"] == 3, dapo
        assert dapo["dapo/groups_kept"] == 1, dapo  # train_batch_size 2: one group per rank
        assert dapo["actor/advantages_abs_mean"] > 0, dapo  # trained on the informative groups
    # a second step at the default max_error_rate: rank 1's failures (2 of the step's 4 searches) stop both ranks
    stopped = re.findall(r"STOPPED rank=(\d) (.*?)(?=STOPPED rank=|$)", log, re.M)  # two ranks may share a line
    assert sorted(r for r, _ in stopped) == ["0", "1"], log[-4000:]
    assert all("failed 2 of 4 searches during a training step" in msg and "injected" in msg for _, msg in stopped)


@pytest.mark.slow
def test_a_hung_then_a_killed_retrieval_server_stops_the_run_which_resumes_when_it_is_back(world, tiny_model, rl_root):
    """Two launches of the real entry point at tp=2, rollout.engine_tp=2, against a
    real server: SIGSTOP after step 1 -> the run stops with exit 3 on both ranks within a bounded time; SIGCONT,
    resume -> step 2 runs from the step-1 checkpoint, SIGKILL after it -> the run stops again. Only the engine's
    first rank ever asks the server (the other one's client could only fail), once per search."""
    from megatron_searchr1.search.launch import ServerProcess

    out = os.path.join(rl_root, "retriever_down")
    train = os.path.join(world, "train.parquet")

    def launch(url, pid, action, *overrides):
        start = time.time()
        proc = run_module("tests.train_failures_script", ["retriever", tiny_model, train, out, url, str(pid), action,
                                                          "1" if action == "stop" else "2", *overrides],
                          nproc=2, timeout=600, check=False)
        log = proc.stdout + proc.stderr
        signalled = re.findall(r"SIGNALLED \w+ at ([\d.]+)", log)
        assert proc.returncode != 0 and signalled, log[-6000:]
        errors = [ln for ln in log.splitlines() if ln.startswith("error: ")]
        # one line per rank, naming the server, the counts and the cause; no traceback of ours
        assert len(errors) == 2 and len(set(errors)) == 1, log[-6000:]
        assert f"the retrieval server at {url} failed 4 of 4 searches during a training step" in errors[0], errors
        assert "exitcode  : 3" in log and "raise RetrievalDown" not in log, log[-6000:]
        # both ranks finished the same steps; the engine's second rank (whose client could only fail) never sent a
        # request, the first sent each step's 4 searches once (2 prompts x 2 samples, one search each)
        clients = re.findall(r"CLIENT rank=(\d) step=(\d) requests=(\d+) queries=(\d+)", log)
        steps = {r: [int(s) for rr, s, _, _ in clients if rr == r] for r in "01"}
        assert steps["0"] and steps["0"] == steps["1"], clients
        assert all(int(n) == 0 for r, _, n, _ in clients if r == "1"), clients
        assert [int(q) for r, _, _, q in clients if r == "0"] == [4 * k for k in range(1, len(steps["0"]) + 1)]
        return log, errors[0], time.time() - float(signalled[0]), time.time() - start

    with ServerProcess(["--index-dir", os.path.join(world, "index_bm25")]) as server:
        pid = server.proc.pid
        try:
            # no periodic checkpoint: the step-1 checkpoint below is the one the trainer writes on its way out
            log, error, after_signal, _ = launch(server.url, pid, "stop", "trainer.save_freq=0")
        finally:
            os.kill(pid, signal.SIGCONT)
        # 1 s timeouts: one round of 4 attempts and backoff, not minutes
        assert "timeout after 1" in error and after_signal < 60, (error, after_signal)
        assert os.path.isdir(os.path.join(out, "checkpoints", "step_000001"))

        log, error, after_signal, _ = launch(server.url, pid, "kill")
        assert "at step 1" in log and re.search(r"CLIENT rank=0 step=2 requests=\d+", log), log[-6000:]
        assert "is the retrieval server" in error and after_signal < 60, (error, after_signal)


@pytest.mark.slow
def test_ctrl_c_stops_every_rank_in_seconds_with_one_line_each(world, tiny_model, rl_root):
    """Ctrl-C in a terminal: SIGINT to the whole job (torchrun, both ranks, the retrieval server a rank launched).
    Each rank prints one line naming its step and last checkpoint and exits 130; no Python traceback of ours; the
    job and every process below it are gone within seconds (torchrun's own SignalException report remains)."""
    import sys

    from tests.rl_fixtures import ctrl_c_after_step

    out = os.path.join(rl_root, "ctrl_c")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "megatron_searchr1.train", f"model.path={tiny_model}", f"data.train_files=[{world}/train.parquet]",
           f"data.val_files=[{world}/validation.parquet]", f"trainer.output_dir={out}", "rollout.engine=hf",
           "parallel.tp=1", "data.train_batch_size=2", "algo.ppo_mini_batch_size=2", "rollout.n=2",
           "rollout.max_turns=1", "rollout.max_tokens_per_turn=16", "rollout.max_response_length=96",
           "rollout.max_obs_length=32", "data.max_prompt_length=512", "trainer.total_steps=500",
           "trainer.val_before_train=false", "trainer.test_freq=0", "trainer.save_freq=1", "trainer.export_hf=false",
           "logging.tensorboard=false", "algo.use_kl_loss=false", "retrieval.launch=true",
           f"retrieval.server_args=[--index-dir,{world}/index_bm25]"]
    # until step 2 is done: a checkpoint exists, the server has been asked; two ranks and the server below
    before, rest, seconds, left, returncode = ctrl_c_after_step(cmd, step=2, min_processes=3)
    log = before + rest
    said = re.findall(r"^rank (\d): interrupted \(Ctrl-C\) (?:in step \d+ of 500|saving the checkpoint of step \d+); "
                      r"last checkpoint: (\S+)$", rest, re.M)
    assert sorted(r for r, _ in said) == ["0", "1"], rest[-6000:]
    assert all(re.search(r"/checkpoints/step_\d{6}$", ckpt) and os.path.isdir(ckpt) for _, ckpt in said), said
    assert "KeyboardInterrupt" not in log and "megatron_searchr1/" not in rest, rest[-6000:]  # no traceback of ours
    assert returncode != 0 and seconds < 10, (returncode, seconds)
    assert not left, f"left running after Ctrl-C: {left}"


@pytest.mark.slow
def test_a_full_disk_under_the_logs_stops_every_rank_with_one_line_and_the_resume_appends_whole_rows(
        world, tiny_model, rl_root):
    """The disk fills when no checkpoint is due: rank 0 crashed in metrics.py with OSError [Errno 28], rank 1 with a
    gloo "connection closed" traceback, and trajectories.jsonl kept a cut row that the next run appended to. Now
    (the real entry point, two ranks, real ENOSPC from a small tmpfs under trainer.output_dir, the checkpoints on a
    second one) each rank prints one `error:` line and exits 2, the step's checkpoint is saved on the way out, and
    the resume cuts a torn last row (planted here, as a killed run leaves it) before it appends: every JSONL parses."""
    from megatron_searchr1.search.launch import ServerProcess
    from tests.checkpoint.small_fs import small_fs

    out = os.path.join(rl_root, "disk_full")
    train = os.path.join(world, "train.parquet")
    with small_fs(out, 2 << 20) as mounted, small_fs(os.path.join(out, "checkpoints"), 256 << 20) as mounted_ckpt:
        if not (mounted and mounted_ckpt):
            pytest.skip("mounting a tmpfs is not permitted here (tests/checkpoint/test_disk_full.py injects instead)")
        with ServerProcess(["--index-dir", os.path.join(world, "index_bm25")]) as server:
            proc = run_module("tests.train_failures_script", ["disk_full", tiny_model, train, out, server.url, "1",
                                                              "3"], nproc=2, timeout=600, check=False)
            log = proc.stdout + proc.stderr
            assert "FILLED after step 1" in log, log[-6000:]
            errors = [ln for ln in log.splitlines() if ln.startswith("error: ")]
            assert len(errors) == 2 and len(set(errors)) == 1, log[-6000:]  # one line per rank, the same
            assert errors[0].startswith(f"error: writing the run's logs failed: no space left on the device ({out}/"), \
                errors[0]
            assert "exitcode  : 2" in log and "exitcode  : 1" not in log, log[-6000:]
            assert "onnection closed" not in log and "OSError" not in log, log[-6000:]
            assert os.path.isfile(os.path.join(out, "checkpoints", "step_000001", "checkpoint.json"))
            os.remove(os.path.join(out, "filler"))
            with open(os.path.join(out, "trajectories.jsonl"), "a") as f:
                f.write('{"step": 2, "uid": "torn", "respo')  # a row cut by a kill
            proc = run_module("tests.train_failures_script", ["disk_full", tiny_model, train, out, server.url, "0",
                                                              "2"], nproc=2, timeout=600, check=False)
            log = proc.stdout + proc.stderr
            assert proc.returncode == 0 and "resumed from" in log and "at step 1" in log, log[-6000:]
        for name in sorted(os.listdir(out)):
            if name.endswith(".jsonl"):
                rows = [json.loads(line) for line in open(os.path.join(out, name))]  # every row parses
                assert all(r.get("uid") != "torn" for r in rows), name
                if name in ("metrics.jsonl", "trajectories.jsonl"):
                    assert 2 in {r["step"] for r in rows}, (name, rows[-1])
