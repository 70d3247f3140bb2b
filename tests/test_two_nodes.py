"""Two nodes on one machine: examples/run_node.sh started twice (NNODES=2, NODE_RANK 0 and 1, MASTER_ADDR
127.0.0.1, one process per node), as a real multi-node job runs it.

Quick: a node other than 0 without MASTER_ADDR fails at once with one `error:` line.
Slow (--runslow): the tiny GRPO recipe with vLLM (tests/test_train.py's `rl_args`, TP=2 over the two "nodes"),
starting from a run root (`model.megatron_ckpt=<root>`, KL loss on, so a reference model is built from it):
  - an uninterrupted 3-step run;
  - 2 steps, save, stop; the start root then gets a newer `latest` (a trained actor: other weights), and the run
    gets what a save killed half-way leaves (a `step_000003.tmp` directory); resume for a third step: its
    metrics equal the uninterrupted run's step 3, so the resumed reference is the pinned step, not the root's new
    latest (its KL loss would differ), every rank resumed the same step, and the stale temp directory neither
    stopped the resume nor outlived the next save.
This is the suite's one resume-exactly launch of the RL trainer (single-node runs resume through the same code).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time

import pytest

from tests.dist_utils import REPO
from tests.rl_fixtures import child_env, rl_root, server, tiny_model, world  # noqa: F401 (fixtures)
from tests.test_train import STEP_FIELDS_THAT_VARY, _free_port, rl_args, step_metrics

RUN_NODE = str(REPO / "examples" / "run_node.sh")


def test_run_node_without_master_addr_fails_at_once():
    env = child_env(NNODES="2", NODE_RANK="1")
    env.pop("MASTER_ADDR", None)
    start = time.time()
    proc = subprocess.run(["bash", RUN_NODE, "examples/grpo_tiny_cpu.yaml"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "MASTER_ADDR" in lines[0], proc.stderr
    assert time.time() - start < 5  # no torch import, no rendezvous wait


def test_run_node_refuses_a_config_mistake_before_torchrun():
    """Under torchrun a rank's exit 2 comes back as torchrun's 1 inside its failure report: the launcher checks the
    config first, and the mistake is one line with exit code 2."""
    env = child_env(NNODES="1", NODE_RANK="0", NPROC_PER_NODE="2")
    proc = subprocess.run(["bash", RUN_NODE, "examples/grpo_tiny_cpu.yaml", "rollout.n=0"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert lines == ["error: rollout.n must be >= 1, got 0"], lines


# -- the ranks' exit codes through torchrun ------------------------------------------------------------------------
DEMO_BASE = str(REPO / "examples" / "demo_base")  # a shipped model that searches at once: its rollouts hit the server


class _PingOnlyServer:
    """A retrieval server on loopback that answers the trainers' start-up ping and fails every search with HTTP 500
    (a server that went down after the run started)."""

    def __init__(self):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.searches = 0

        class Handler(BaseHTTPRequestHandler):
            def do_POST(handler):  # noqa: N802, N805 - http.server's names; `self` is the test's server
                body = json.loads(handler.rfile.read(int(handler.headers.get("content-length", 0))) or b"{}")
                if body.get("queries") != ["ping"]:
                    self.searches += 1
                    handler.send_response(500)
                    handler.end_headers()
                    return
                data = json.dumps({"result": [[]]}).encode()
                handler.send_response(200)
                handler.send_header("content-type", "application/json")
                handler.send_header("content-length", str(len(data)))
                handler.end_headers()
                handler.wfile.write(data)

            def log_message(handler, *args):  # noqa: N805
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/retrieve"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


@pytest.fixture(scope="module")
def small_world(tmp_path_factory) -> str:
    """A synthetic world of a few questions, no index (these runs never reach a real server)."""
    out = str(tmp_path_factory.mktemp("exit_codes") / "world")
    proc = subprocess.run(["python", "-m", "megatron_searchr1.data.make_world", "--out-dir", out, "--template", "short",
                           "--seed", "0", "--n-train", "8", "--n-validation", "4", "--n-test", "4"], cwd=REPO,
                          env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def run_node_once(world: str, url: str, out: str, *extra: str) -> subprocess.CompletedProcess:
    """run_node.sh on one node of 2 ranks (the demo's base model, the hf engine, one step of 2 prompts x 2)."""
    args = ["examples/grpo_tiny_cpu.yaml", f"model.path={DEMO_BASE}", "model.megatron_ckpt=null",
            f"data.train_files=[{world}/train.parquet]", "data.val_files=[]", f"retrieval.url={url}",
            "rollout.engine=hf", "data.train_batch_size=2", "rollout.n=2", "algo.ppo_mini_batch_size=2",
            "retrieval.timeout=1", "trainer.total_steps=1", f"trainer.output_dir={out}", *extra]
    env = child_env(NNODES="1", NODE_RANK="0", NPROC_PER_NODE="2", MASTER_PORT=str(_free_port()))
    return subprocess.run(["bash", RUN_NODE, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_run_node_exits_with_the_ranks_code_2_and_3_not_torchruns_1(small_world, tmp_path):
    """torchrun reports a failing rank as its own exit 1: run_node.sh must say 2 (a mistake found in the ranks, here
    a retrieval server that does not answer the start-up check, which the launcher's own check does not make) and
    3 (the server failed the run's searches) so that a script can tell them apart."""
    dead = f"http://127.0.0.1:{_free_port()}/retrieve"
    proc = run_node_once(small_world, dead, str(tmp_path / "dead"))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 2, log[-4000:]
    assert "exitcode  : 2" in log  # what torchrun saw, reported as its own 1
    # each rank checks the server; the first to exit 2 makes torchrun stop the other, which may not get as far
    assert re.search(r"^run_node\.sh: node 0 exits 2 \(torchrun exited 1; rank\(s\) [01 ]+ exited 2\)$", proc.stderr,
                     re.M), log[-4000:]
    assert any(ln.startswith(f"error: the retrieval server at {dead} does not answer") for ln in log.splitlines())

    server = _PingOnlyServer()
    try:
        proc = run_node_once(small_world, server.url, str(tmp_path / "down"))
    finally:
        server.close()
    log = proc.stdout + proc.stderr
    assert proc.returncode == 3, log[-4000:]
    assert server.searches > 0  # the run got as far as its rollouts
    assert re.search(r"^run_node\.sh: node 0 exits 3 \(torchrun exited 1; rank\(s\) [01 ]+ exited 3\)$", proc.stderr,
                     re.M), log[-4000:]
    errors = [ln for ln in log.splitlines() if ln.startswith("error: ")]
    assert errors and all("failed 4 of 4 searches during a training step" in e for e in errors), errors


def run_two_nodes(args: list[str], timeout: float = 400) -> str:
    """Both nodes' run_node.sh; returns their combined output, raises with it when either fails."""
    port = str(_free_port())
    procs = [subprocess.Popen(["bash", RUN_NODE, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=child_env(NNODES="2", NODE_RANK=str(node), MASTER_ADDR="127.0.0.1",
                                                       MASTER_PORT=port, NPROC_PER_NODE="1"))
             for node in (0, 1)]
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    log = "\n".join(f"--- node {n} ---\n{out}" for n, out in enumerate(outs))
    assert all(p.returncode == 0 for p in procs), f"rc={[p.returncode for p in procs]}\n{log[-8000:]}"
    return log


def start_root(tiny_model: str, root: str) -> str:
    """A run root whose latest step holds the tiny model as a Megatron checkpoint (what an SFT run leaves)."""
    from megatron_searchr1.checkpoint import LATEST_FILE, MARKER_FILE, step_dir

    ckpts = os.path.join(root, "checkpoints")
    proc = subprocess.run(["python", str(REPO / "checkpoints_convert" / "hf_to_megatron.py"), "--hf-dir", tiny_model,
                           "--out-dir", os.path.join(step_dir(ckpts, 1), "actor")],
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(os.path.join(step_dir(ckpts, 1), MARKER_FILE), "w") as f:
        json.dump({"step": 1}, f)
    with open(os.path.join(ckpts, LATEST_FILE), "w") as f:
        f.write("1\n")
    return root


@pytest.mark.slow
def test_two_nodes_train_save_stop_and_resume_exactly(world, tiny_model, server, rl_root):
    from megatron_searchr1.checkpoint import LATEST_FILE, latest_step, step_dir

    start = start_root(tiny_model, os.path.join(rl_root, "two_nodes_start"))

    def args(out, steps):  # no validation, no export: only the steps are compared
        return rl_args(world, tiny_model, server, out, f"trainer.total_steps={steps}", f"model.megatron_ckpt={start}",
                       "data.val_files=[]", "trainer.export_hf=false", "trainer.save_freq=0")

    reference = os.path.join(rl_root, "two_nodes_reference")
    run_two_nodes(args(reference, 3))
    out = os.path.join(rl_root, "two_nodes")
    run_two_nodes(args(out, 2))
    assert latest_step(os.path.join(out, "checkpoints")) == 2
    # the start root moves on to other weights (this run's trained actor): the resumed reference must not follow
    moved = os.path.join(start, "checkpoints")
    shutil.copytree(step_dir(os.path.join(out, "checkpoints"), 2), step_dir(moved, 2))
    with open(os.path.join(moved, LATEST_FILE), "w") as f:
        f.write("2\n")
    # What a process killed while saving step 3 leaves behind: a half-written temp directory, `latest` untouched.
    ckpts = os.path.join(out, "checkpoints")
    crashed = os.path.join(step_dir(ckpts, 3) + ".tmp", "actor")
    os.makedirs(crashed)
    with open(os.path.join(crashed, "__0_0.distcp"), "wb") as f:
        f.write(b"\0" * 100)
    assert latest_step(ckpts) == 2
    log = run_two_nodes(args(out, 3))
    assert f"at step 2, reference {os.path.join(step_dir(moved, 1), 'actor')}" in log, log[-3000:]
    assert latest_step(ckpts) == 3 and not os.path.exists(step_dir(ckpts, 3) + ".tmp")

    want, got = step_metrics(reference), step_metrics(out)
    assert sorted(got) == [1, 2, 3]
    for step in (1, 2, 3):
        keys = [k for k in want[step] if not k.startswith(STEP_FIELDS_THAT_VARY)]
        diff = {k: (want[step][k], got[step].get(k)) for k in keys if want[step][k] != got[step].get(k)}
        assert not diff, f"step {step} differs: {diff}"
    # not vacuous: the policy moved, and the KL loss is measured against the reference
    assert want[3]["actor/entropy"] != want[1]["actor/entropy"] and want[3]["actor/kl_loss"] > 0
