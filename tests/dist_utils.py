"""Launch real multi-process runs from tests: `torchrun --standalone` with gloo on the CPU."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def rank_results(out: str) -> list[dict]:
    """Every `RESULT {json}` the ranks of a run printed, in order. Ranks share one pipe, so under load two prints
    may land on one line: each object is decoded from where its marker starts, not line by line."""
    decoder = json.JSONDecoder()
    return [decoder.raw_decode(chunk)[0] for chunk in out.split("RESULT ")[1:]]


def run_torchrun(script: str | os.PathLike, nproc: int, *args: str, timeout: float = 600, env: dict | None = None) -> str:
    """Run `script` under torchrun with `nproc` ranks; return combined output, raise with it on failure."""
    full_env = dict(os.environ)
    full_env.update(
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=f"{REPO}{os.pathsep}{full_env.get('PYTHONPATH', '')}",
    )
    full_env.update(env or {})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(script), *map(str, args)]
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(f"torchrun failed (rc={proc.returncode}): {' '.join(cmd)}\n{out[-8000:]}")
    return out


def launch_ranks(cmd: list[str], nproc: int, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """Start `nproc` ranks of `cmd` as torchrun starts them (its environment, the store hosted here as its agent
    hosts it), but with nothing that ends a rank when another dies: what the ranks of a multi-node job see, whose
    agents never learn of a death on another node. Under torchrun a death is ended by its monitor at the next tick,
    which races the survivors' own messages (a death on a tick loses every message). Returns the first non-zero
    exit code (0 when all are 0) and the ranks' output, rank by rank; on the timeout every rank's process group is
    killed and an AssertionError raised with that output."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
    logs, procs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for rank in range(nproc):
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                        "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
                        "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nproc), "ROLE_NAME": "default",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
                        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "launch_ranks",
                        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}
            logs.append(open(os.path.join(tmp, f"rank{rank}.log"), "w+"))
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=rank_env, stdout=logs[-1], stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline, codes = time.monotonic() + timeout, []
        try:
            for proc in procs:
                codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes = None
        finally:
            for proc in procs:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the rank and whatever it started (vLLM's processes)
                except ProcessLookupError:
                    pass
                proc.wait()
        out = ""
        for rank, log in enumerate(logs):
            log.seek(0)
            out += f"----- rank {rank} (exit {procs[rank].returncode})\n" + log.read()
            log.close()
    if codes is None:
        raise AssertionError(f"ranks still running after {timeout} s, killed: {' '.join(cmd)}\n{out[-8000:]}")
    return subprocess.CompletedProcess(cmd, next((c for c in codes if c != 0), 0), stdout=out, stderr="")
