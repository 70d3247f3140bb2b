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
                                           (["--backends", "tf"], "--backends: choose from torch,onnxruntime"),
                                           (["--rerank-model", "minilm", "--rerank-candidates", "0"],
                                            "--rerank-candidates, --rerank-batches and --rerank-batch-size must be"),
                                           (["--rerank-model", "/nonexistent"], "is not a directory")])
def test_bad_input_is_one_error_line(args, message):
    r = run(*args, timeout=60)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and message in errors[0], r.stderr


@pytest.mark.slow
def test_smallest_run_times_every_step_on_both_backends(tmp_path):
    """Also the rerank stage with the real-size cross-encoder built from MiniLM's weights."""
    out = tmp_path / "split.json"
    r = run("--docs", "40", "--batches", "1,8", "--repeats", "1", "--torch-threads", "1", "--out", str(out),
            "--rerank-model", "minilm", "--rerank-candidates", "3,5", "--rerank-batches", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(out.read_text())
    assert [(row["batch"], row["backend"]) for row in data["rows"]] == [
        (1, "torch"), (1, "onnxruntime"), (8, "torch"), (8, "onnxruntime")]
    assert all(row["encode_s"] > 0 and row["search_s"] > 0 and row["render_s"] > 0 for row in data["rows"])
    assert data["max_embedding_diff"] < 1e-4  # the backends encode the same vectors
    assert "| 8 | onnxruntime |" in r.stdout
    rerank = data["rerank_rows"]
    assert [(row["batch"], row["candidates"], row["pairs"]) for row in rerank] == [(2, 3, 6), (2, 5, 10)]
    assert all(row["rerank_s"] > 0 and row["pairs_per_s"] > 0 and 0 < row["rerank_share"] < 1 for row in rerank)
    assert all(abs(row["rerank_ms_per_query"] - 500 * row["rerank_s"]) < 1e-6 for row in rerank)  # 2 queries
    assert "| 2 | 5 | 10 |" in r.stdout
