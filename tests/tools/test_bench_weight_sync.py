"""tools/benchmarks/bench_weight_sync.py runs (world of one) and prints the sync next to a plain copy.

A subprocess: the benchmark initializes torch.distributed and Megatron's parallel state for itself."""
import os
import subprocess
import sys

from tests.dist_utils import REPO


def test_prints_the_sync_next_to_a_plain_copy():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "benchmarks" / "bench_weight_sync.py"),
                           "--hidden", "64", "--ffn", "128", "--layers", "2", "--heads", "2", "--kv-heads", "1",
                           "--vocab", "500", "--iters", "2", "--bucket-mb", "0.05"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "weight sync" in out and "plain copy" in out and "ratio sync/copy = " in out
    # several buckets at this size, every tensor of a 2-layer Qwen2 (untied: embed + lm_head + final norm)
    line = next(l for l in out.splitlines() if l.startswith("world=1"))
    assert "tensors=" in line and int(line.split("buckets=")[1].split()[0]) > 1
