"""tools/benchmarks/bench_query_split.py: the encode / search / render split on both encoder backends in one run."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "benchmarks", "bench_query_split.py")


def run(*args, timeout=600):
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=env)


@pytest.mark.parametrize("args, message", [(["--batches", "0,4"], "--batches: each size must be >= 1"),
                                           (["--batches", "x"], "--batches must be comma-separated integers"),
                                           (["--backends", "tf"], "--backends: choose from torch,onnxruntime")])
def test_bad_input_is_one_error_line(args, message):
    r = run(*args, timeout=60)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and message in errors[0], r.stderr


@pytest.mark.slow
def test_smallest_run_times_every_step_on_both_backends(tmp_path):
    out = tmp_path / "split.json"
    r = run("--docs", "40", "--batches", "1,8", "--repeats", "1", "--torch-threads", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(out.read_text())
    assert [(row["batch"], row["backend"]) for row in data["rows"]] == [
        (1, "torch"), (1, "onnxruntime"), (8, "torch"), (8, "onnxruntime")]
    assert all(row["encode_s"] > 0 and row["search_s"] > 0 and row["render_s"] > 0 for row in data["rows"])
    assert data["max_embedding_diff"] < 1e-4  # the backends encode the same vectors
    assert "| 8 | onnxruntime |" in r.stdout
