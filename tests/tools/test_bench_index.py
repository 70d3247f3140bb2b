"""tools/benchmarks/bench_index.py at its smallest size: every row measured, Flat its own reference, the table out."""
import json
import subprocess
import sys

import pytest

from tests.dist_utils import REPO


@pytest.mark.slow
def test_bench_index_smallest_run(tmp_path):
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, str(REPO / "tools" / "benchmarks" / "bench_index.py"), "--docs", "300",
                        "--queries", "40", "--seconds", "0.2", "--types", "flat,sq8,ivf_pq", "--torch-threads", "1",
                        "--sweep", "1,2,1000", "--served-clients", "4", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(out.read_text())
    rows = {row["type"]: row for row in data["rows"]}
    assert list(rows) == ["flat", "sq8", "ivf_pq"]
    assert rows["flat"]["recall@1"] == rows["flat"]["recall@10"] == 1.0  # the reference
    assert rows["flat"]["bytes_per_doc"] == 4 * data["dim"]  # 384 float32s per passage
    assert rows["sq8"]["bytes_per_doc"] == data["dim"] and rows["sq8"]["recall@3"] > 0.8
    assert rows["ivf_pq"]["bytes_per_doc"] < rows["sq8"]["bytes_per_doc"] and rows["ivf_pq"]["wiki18_refine_disk_gb"]
    assert all(row["qps_1"] > 0 and row["qps_32"] > 0 for row in rows.values())
    assert [s["batch"] for s in data["split"]] == [8, 256] and all(s["encode_s"] > 0 for s in data["split"])
    assert "| flat | `Flat` | 1536 |" in r.stdout and "| batch | encode s |" in r.stdout
    # the nprobe sweep: ivf_pq only (sq8 and flat have no knob), values past nlist left out, recall rising
    sweep = [(s["type"], s["knob"], s["value"]) for s in data["sweeps"]]
    assert sweep == [("ivf_pq", "nprobe", 1), ("ivf_pq", "nprobe", 2)]
    assert data["sweeps"][0]["recall@3"] <= data["sweeps"][1]["recall@3"] and data["sweeps"][0]["qps_1"] > 0
    # the real server, over HTTP, per type: every request answered
    assert all(row["served_qps_32"] > 0 and row["served_errors"] == 0 for row in rows.values())
    assert "served QPS 4 (HTTP)" in r.stdout


def test_bench_index_refuses_unknown_types():
    r = subprocess.run([sys.executable, str(REPO / "tools" / "benchmarks" / "bench_index.py"), "--types", "flat,lsh"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2 and "error: --types: unknown ['lsh']" in r.stderr
