"""tools/benchmarks/bench_index.py at its smallest size: every row measured, Flat its own reference, the table out;
the embedding cache resumes where an interrupted encoding stopped."""
import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

from tests.dist_utils import REPO


def _bench_index():
    sys.path.insert(0, str(REPO / "tools" / "benchmarks"))  # it imports its sibling bench_retrieval
    spec = importlib.util.spec_from_file_location("bench_index", REPO / "tools" / "benchmarks" / "bench_index.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _CountingEncoder:
    """Embeds text i as the vector [len(text), is_query]; records every text it was asked to encode."""

    def __init__(self, fail_after: int | None = None):
        self.seen, self.fail_after = [], fail_after

    def encode(self, texts, is_query):
        if self.fail_after is not None and len(self.seen) + len(texts) > self.fail_after:
            raise KeyboardInterrupt  # the run interrupted mid-encoding
        self.seen += texts
        return np.array([[len(t), float(is_query)] for t in texts], np.float32)


def test_embedding_cache_resumes_an_interrupted_encoding_and_a_rerun_encodes_nothing(tmp_path):
    bench = _bench_index()
    corpus = [{"contents": "x" * (i + 1)} for i in range(10)]
    queries = ["q1", "q22"]
    with pytest.raises(KeyboardInterrupt):  # chunks of 4: the first two are saved, the third is cut short
        bench.encode_cached(_CountingEncoder(fail_after=9), corpus, queries, str(tmp_path), chunk=4)
    resumed = _CountingEncoder()
    x, q, _ = bench.encode_cached(resumed, corpus, queries, str(tmp_path), chunk=4)
    assert resumed.seen == ["x" * 9, "x" * 10, "q1", "q22"]  # only the missing chunk, then the queries
    assert x[:, 0].tolist() == list(range(1, 11)) and q.tolist() == [[2, 1], [3, 1]]
    again = _CountingEncoder()
    x2, q2, _ = bench.encode_cached(again, corpus, queries, str(tmp_path), chunk=4)
    assert again.seen == [] and np.array_equal(x2, x) and np.array_equal(q2, q)
    # --first: the first rows of the cached chunks, nothing encoded; on a new cache only the chunks they need
    x3, _, _ = bench.encode_cached(again, corpus, queries, str(tmp_path), chunk=4, first=5)
    assert again.seen == [] and np.array_equal(x3, x[:5])
    fresh = _CountingEncoder()
    (tmp_path / "new").mkdir()
    x4, _, _ = bench.encode_cached(fresh, corpus, queries, str(tmp_path / "new"), chunk=4, first=3)
    assert fresh.seen == ["x" * i for i in range(1, 5)] + queries and x4[:, 0].tolist() == [1, 2, 3]


@pytest.mark.slow
def test_bench_index_smallest_run(tmp_path):
    """The world + pydoc corpus (the large run's, few of pydoc's long passages), cached: per-source recall columns
    and the load average."""
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, str(REPO / "tools" / "benchmarks" / "bench_index.py"), "--docs", "300",
                        "--queries", "40", "--seconds", "0.2", "--types", "flat,sq8,ivf_pq", "--torch-threads", "1",
                        "--sweep", "1,2,1000", "--served-clients", "4", "--out", str(out), "--corpus", "world+pydoc",
                        "--pydoc", "40", "--cache-dir", str(tmp_path / "cache")],
                       capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["docs"] == 300 and data["queries_by_source"] == {"pydoc": 20, "world": 20}
    cached = tmp_path / "cache" / "world+pydoc-300-40-pydoc40"
    assert (cached / "passages.00000.npy").exists() and (cached / "queries.npy").exists()
    ids = [json.loads(line)["id"] for line in (cached / "corpus.jsonl").read_text().splitlines()]
    assert ids == [str(i) for i in range(300)]  # pydoc's 40 (5x longer to encode), then the world's 260
    assert all(row["recall@3_pydoc"] >= 0 and row["recall@3_world"] >= 0 and row["load_avg"] >= 0
               for row in data["rows"])
    assert "R@3 pydoc | R@3 world |" in r.stdout
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
    # the real server, over HTTP, per type: every request answered, from 1 and from 4 clients; its answers to the
    # queries (Search-R1's request shape) are the in-process index's: Flat's are its own reference, sq8's top-3
    # agree with Flat's as much as in process (to a tie or two)
    assert all(row["served_qps_1"] > 0 and row["served_qps_n"] > 0 and row["served_errors"] == 0
               for row in rows.values())
    assert rows["flat"]["served_recall3"] == 1.0
    assert abs(rows["sq8"]["served_recall3"] - rows["sq8"]["recall@3"]) < 0.05
    assert "| served QPS 1 (HTTP) | served QPS 4 (HTTP) | served p99 s at 4 | served R@3 |" in r.stdout
    assert "load average (1, 5, 15 min) at the start of the index stage" in r.stdout
    assert len(data["load_avg_start"]) == len(data["load_avg_end"]) == 3


def test_bench_index_refuses_unknown_types():
    r = subprocess.run([sys.executable, str(REPO / "tools" / "benchmarks" / "bench_index.py"), "--types", "flat,lsh"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2 and "error: --types: unknown ['lsh']" in r.stderr


def test_recall_by_size_samples_or_grows_the_corpus_and_searches_at_the_default_knobs(capsys):
    """--sizes: a sample of the encoded vectors below their count, interpolated neighbours above it (unit norm,
    the originals kept), each type searched with the knobs the server would use with no flags."""
    from megatron_searchr1.search.dense import default_nprobe

    bench = _bench_index()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((400, 16)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    grown = bench.grow(x, 1000)
    assert grown.shape == (1000, 16) and np.array_equal(grown[:400], x)
    np.testing.assert_allclose(np.linalg.norm(grown, axis=1), 1, rtol=1e-5)
    assert bench.grow(x, 100).shape == (100, 16)
    q, sources = x[:30] + 0.01, np.array(["a", "b"] * 15)
    rows = bench.recall_by_size(x, q, sources, ["flat", "ivf_flat"], [200, 3000])
    assert [(r["docs"], r["type"]) for r in rows] == [(n, t) for n in (200, 3000) for t in ("flat", "ivf_flat")]
    assert rows[0]["recall@1"] == rows[2]["recall@10"] == 1.0  # flat: the reference
    assert rows[1]["nprobe"] == rows[1]["nlist"] == 5 and rows[1]["recall@3"] == 1.0  # every list: exact
    assert (rows[3]["nlist"], rows[3]["nprobe"]) == (76, default_nprobe(76)) == (76, 19)  # a quarter of the lists
    assert 0.5 < rows[3]["recall@10"] < 1 and 0 <= rows[3]["recall@3_a"] <= 1  # a quarter: not exact
    assert "| 3,000 | ivf_flat | nprobe 19 of 76 |" in capsys.readouterr().out
