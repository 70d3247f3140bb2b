"""examples/slurm_grpo.sh (the sbatch script) and examples/slurm_node.sh (what srun runs on each node), run on this
machine as a two-node job: `srun` and `scontrol` are stand-ins on PATH (srun starts the per-node command once per
"node" with its SLURM_NODEID, as srun --ntasks-per-node=1 does, each node's retrieval server on a port of its own,
since two servers cannot share one on a single host; scontrol names the nodes), everything else is the scripts as a
user submits them.

Quick: a submission without OUTPUT_DIR is one `error:` line, exit 2; a wrong index makes every node's server fail
to start: each node says so with the server's own error, and the job exits 2.
Slow (--runslow): one GRPO step over two nodes (TP=2 across them, the hf engine), each node with its own BM25 server,
the shared output directory written once; then the same job with a prompt budget no prompt fits, found by the ranks
(not by run_node.sh's own check): the job exits 2 through torchrun, srun and sbatch, where torchrun alone says 1.
"""
from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from tests.dist_utils import REPO
from tests.rl_fixtures import child_env, rl_root, tiny_model, world  # noqa: F401 (fixtures)
from tests.test_train import _free_port, rl_args

SBATCH = str(REPO / "examples" / "slurm_grpo.sh")

FAKE_SRUN = r"""#!/usr/bin/env bash
# srun stand-in: the command once per node of the job (SLURM_NNODES), all at once, each with its SLURM_NODEID and
# RETRIEVAL_PORT=PORT_BASE+node, output to $NODE_LOGS/node<N>.out; exits with the highest code, as srun does.
while [[ $1 == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do
    SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 RETRIEVAL_PORT=$((PORT_BASE + i)) \
        "$@" >"$NODE_LOGS/node$i.out" 2>&1 &
    pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p"; c=$?; ((c > rc)) && rc=$c; done
exit $rc
"""

FAKE_SCONTROL = """#!/usr/bin/env bash
# scontrol stand-in: `scontrol show hostnames LIST` names this machine once per node
[[ "$1 $2" == "show hostnames" ]] || { echo "scontrol stand-in: unexpected $*" >&2; exit 1; }
for ((i = 0; i < SLURM_NNODES; i++)); do echo 127.0.0.1; done
"""


def slurm_env(tmp_path, nodes: int = 2, **extra: str) -> dict:
    """The environment sbatch gives the script, the stand-ins first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    logs = tmp_path / "node_logs"
    logs.mkdir(exist_ok=True)
    env = child_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_NNODES=str(nodes),
                    SLURM_JOB_NODELIST=f"node[0-{nodes - 1}]", SLURM_JOB_ID="7", SLURM_SUBMIT_DIR=str(REPO),
                    NODE_LOGS=str(logs), NPROC_PER_NODE="1", MASTER_PORT=str(_free_port()),
                    PORT_BASE=str(_free_port()), **extra)
    env.pop("OUTPUT_DIR", None)
    env.update(extra)
    return env


def test_a_job_without_output_dir_is_one_error_line(tmp_path):
    proc = subprocess.run(["bash", SBATCH, "examples/grpo_tiny_cpu.yaml"], cwd=tmp_path, env=slurm_env(tmp_path),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: set OUTPUT_DIR=<a directory every node shares> (the run's "
                                                "trainer.output_dir)"]


def test_a_node_whose_server_does_not_start_fails_the_job_with_2(tmp_path):
    """The whole path (sbatch script -> srun -> each node's script) in seconds: a wrong index is every node's
    `error:` line with the server's own, and the job's exit code 2."""
    out = tmp_path / "shared"
    env = slurm_env(tmp_path, OUTPUT_DIR=str(out), RETRIEVAL_ARGS=f"--index-dir {tmp_path / 'no_index'}",
                    RETRIEVAL_THREADS="1")
    proc = subprocess.run(["bash", SBATCH, "examples/grpo_tiny_cpu.yaml"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "slurm_grpo.sh: exit 2 (srun 2; nodes: node0:2 node1:2 )" in proc.stdout, proc.stdout
    for node in (0, 1):
        text = (tmp_path / "node_logs" / f"node{node}.out").read_text()
        assert text.startswith(f"error: node {node}: the retrieval server did not start"), text
        assert "no_index" in text.splitlines()[-1], text  # the server's own line, from its log


def test_the_sbatch_header_asks_for_one_task_per_node():
    """srun must start one torchrun per node: a header that asked for a task per GPU would start eight per node."""
    header = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", (REPO / "examples" / "slurm_grpo.sh").read_text(), re.M))
    assert header["ntasks-per-node"] == "1" and int(header["nodes"]) >= 2 and "gpus-per-node" in header


@pytest.mark.slow
def test_a_two_node_job_trains_with_a_server_per_node_and_carries_exit_code_2(world, tiny_model, rl_root, tmp_path):
    out = os.path.join(rl_root, "slurm_run")
    # rl_args' url and output_dir are replaced by the node script's (its own server, the shared OUTPUT_DIR)
    args = rl_args(world, tiny_model, "http://unused", "unused", "rollout.engine=hf", "trainer.total_steps=1",
                   "data.val_files=[]", "trainer.export_hf=false", "trainer.save_freq=0")
    env = slurm_env(tmp_path, OUTPUT_DIR=out, RETRIEVAL_ARGS=f"--index-dir {world}/index_bm25",
                    RETRIEVAL_THREADS="1")
    proc = subprocess.run(["bash", SBATCH, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    logs = "\n".join(f"--- node {n} ---\n{(tmp_path / 'node_logs' / f'node{n}.out').read_text()[-4000:]}"
                     for n in (0, 1))
    assert proc.returncode == 0, proc.stdout + proc.stderr + logs
    assert "slurm_grpo.sh: exit 0 (srun 0; nodes: node0:0 node1:0 )" in proc.stdout, proc.stdout
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [json.loads(line)["step"] for line in f if '"actor/grad_norm"' in line]
    assert steps == [1], steps  # one run over both nodes, written once to the shared directory
    ports = set()
    for node in (0, 1):  # each node started its own server and its ranks asked it
        with open(os.path.join(out, "slurm", f"server_node{node}.log")) as f:
            ports |= set(re.findall(r"listening on http://127\.0\.0\.1:(\d+)", f.read()))
    assert len(ports) == 2, ports
    assert "run_node.sh" not in logs  # run_node.sh says nothing when the run succeeds

    # a mistake only the ranks find (every prompt longer than the budget): 2 from every node, through srun and sbatch
    proc = subprocess.run(["bash", SBATCH, *args, "data.max_prompt_length=8"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    logs = "\n".join((tmp_path / "node_logs" / f"node{n}.out").read_text() for n in (0, 1))
    assert proc.returncode == 2, proc.stdout + proc.stderr + logs[-6000:]
    assert "exitcode  : 2" in logs and "no usable prompt" in logs, logs[-6000:]
    assert re.search(r"slurm_grpo\.sh: exit 2 \(srun \d+; nodes: .*node\d:2", proc.stdout), proc.stdout
