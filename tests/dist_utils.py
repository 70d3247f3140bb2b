"""Launch real multi-process runs from tests: `torchrun --standalone` with gloo on the CPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
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
