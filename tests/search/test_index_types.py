"""Every --index-type: built by tools/build_index.py, served by the server's flags on loopback, agreeing with Flat."""
import re
import subprocess
import sys

import httpx
import numpy as np
import pytest

from megatron_searchr1.search.dense import FACTORY, FaissConfig, IndexTooSmall

SERVED = ["flat", "fp16", "sq8", "sq6", "hnsw", "ivf_flat", "ivf_sq8", "ivf_pq"]  # opq_ivf_pq needs 1000 passages


def test_help_writes_out_the_factory_string_of_every_type():
    from megatron_searchr1.search.build_index import INDEX_TYPE_HELP, build_arg_parser

    action = next(a for a in build_arg_parser()._actions if "--index-type" in a.option_strings)
    assert list(action.choices) == list(FACTORY)
    for name, factory in FACTORY.items():
        assert f'{name}: "{factory}"' in " ".join(INDEX_TYPE_HELP.split()), name


@pytest.mark.parametrize("n, nlist, nbits", [(10_000, 256, 8), (21_000_000, 18330, 8), (300, 7, 4)])
def test_defaults_follow_the_corpus_size(n, nlist, nbits):
    cfg = FaissConfig(index_type="ivf_pq").resolve_build(n, 768)
    assert (cfg.nlist, cfg.pq_nbits, cfg.pq_m) == (nlist, nbits, 192)
    assert cfg.factory == f"IVF{nlist},PQ192x{nbits}"
    assert 39 * nlist <= cfg.train_size <= n  # every list gets its 39 training points
    assert 1 <= cfg.effective_nprobe() <= nlist and cfg.effective_refine() == 4
    with pytest.raises(IndexTooSmall, match="use --index-type flat"):
        FaissConfig(index_type="ivf_flat").resolve_build(50, 768)


def test_a_corpus_too_small_for_the_type_is_one_error_line(tmp_path, world):
    r = subprocess.run([sys.executable, "tools/build_index.py", "--corpus", world["path"], "--out-dir",
                        str(tmp_path / "opq"), "--kind", "dense", "--index-type", "opq_ivf_pq", "--quiet"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert re.fullmatch(r"error: --index-type opq_ivf_pq needs at least 1000 passages to train, the corpus has "
                        r"300: use --index-type flat / fp16 / sq8 / sq6 / hnsw / ivf_flat / ivf_sq8 / ivf_pq .*",
                        errors[0])


@pytest.mark.slow
def test_every_index_type_builds_loads_and_serves_search_r1_requests(tmp_path, world):
    from megatron_searchr1.search.build_index import main as build
    from megatron_searchr1.search.server import BackgroundServer, ServerConfig, build_arg_parser, load_from_args

    queries = world["queries"][:120]
    ranked = {}
    for kind in SERVED:
        out = tmp_path / kind
        build(["--corpus", world["path"], "--out-dir", str(out), "--kind", "dense", "--index-type", kind, "--quiet"])
        flags = ["--index-dir", str(out), "--faiss-mmap"]
        if kind == "ivf_pq":  # the knobs as server flags, reported by /health
            flags += ["--nprobe", "6", "--refine-k-factor", "8"]
        if kind == "hnsw":
            flags += ["--ef-search", "40"]
        retriever = load_from_args(build_arg_parser().parse_args(flags))
        with BackgroundServer(retriever, ServerConfig(port=0)) as srv:
            knobs = httpx.get(f"{srv.url}/health", timeout=30).json()["search"]
            body = httpx.post(f"{srv.url}/retrieve", json={"queries": queries, "topk": 3, "return_scores": True},
                              timeout=120).json()["result"]
        assert knobs["index_type"] == kind and knobs["factory"] == FaissConfig(index_type=kind).resolve_build(
            len(world["docs"]), 384).factory
        if kind == "ivf_pq":
            assert (knobs["nprobe"], knobs["refine_k_factor"]) == (6, 8)
            assert (out / "dense.vectors.npy").exists()
        if kind == "hnsw":
            assert knobs["ef_search"] == 40
        assert all(len(row) == 3 and row[0]["score"] >= row[2]["score"] for row in body)
        ranked[kind] = [[hit["document"]["id"] for hit in row] for row in body]
    exact = ranked["flat"]
    assert sum(row[0] == world["docs"][i]["id"] for i, row in enumerate(exact)) >= 0.9 * len(queries)
    for kind, rows in ranked.items():
        recall3 = np.mean([len(set(a) & set(b)) / 3 for a, b in zip(rows, exact)])
        assert recall3 >= (0.99 if kind in ("flat", "fp16", "ivf_flat", "hnsw") else 0.9), (kind, recall3)


def test_refine_rescoring_restores_the_exact_order():
    """A deliberately coarse PQ (2 codes a vector) whose candidates (here all rows) are re-scored from the exact
    vectors gives Flat's top-3 order."""
    import faiss

    from megatron_searchr1.search.dense import DenseRetriever

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2000, 32)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)

    class Enc:  # queries are given as row numbers of x
        dim = 32

        class config:
            model = "rows"

        def encode_unique_queries(self, qs):
            return x[[int(q) for q in qs]] + 0.01, np.arange(len(qs))

    cfg = FaissConfig(index_type="ivf_pq", pq_m=2, nlist=8, nprobe=8, refine_k_factor=700).resolve_build(2000, 32)
    index = faiss.index_factory(32, cfg.factory, faiss.METRIC_INNER_PRODUCT)
    index.train(x)
    index.add(x)
    corpus = [{"id": str(i)} for i in range(2000)]
    qs = [str(i) for i in range(0, 2000, 20)]
    want = np.argsort(-(x[[int(q) for q in qs]] + 0.01) @ x.T, axis=1)[:, :3]
    coarse = DenseRetriever(corpus, index, Enc(), cfg).search_ids(qs, 3)[0]
    refined = DenseRetriever(corpus, index, Enc(), cfg, vectors=x.astype(np.float16)).search_ids(qs, 3)[0]
    assert (coarse == want).mean() < 0.8  # the coarse codes alone do get the order wrong
    assert (refined == want).mean() >= 0.98


def test_sq6_writes_three_quarter_bytes_per_dim_and_reads_back_as_sq6(tmp_path):
    """SQ6 (6 bits a dimension) through the CLI's own factory and type detection: a file that reads back as sq6,
    0.75 bytes per dimension, and a top-3 close to exact inner product."""
    import faiss

    from megatron_searchr1.search.dense import index_type_of, make_faiss_index, read_faiss_index

    rng = np.random.default_rng(0)
    x = rng.standard_normal((3000, 64)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    cfg = FaissConfig(index_type="sq6").resolve_build(len(x), 64)
    assert cfg.factory == "SQ6" and cfg.trained
    index = make_faiss_index(64, cfg)
    index.train(x)
    empty = tmp_path / "empty.index"
    faiss.write_index(index, str(empty))
    index.add(x)
    path = tmp_path / "sq6.index"
    faiss.write_index(index, str(path))
    assert (path.stat().st_size - empty.stat().st_size) / len(x) == 64 * 3 / 4
    back = read_faiss_index(path, mmap=True)
    assert index_type_of(back) == "sq6"
    q = x[:200] + 0.05 * rng.standard_normal((200, 64)).astype(np.float32)
    exact = np.argsort(-q @ x.T, axis=1)[:, :3]
    got = back.search(q, 3)[1]
    assert np.mean(got[:, 0] == exact[:, 0]) >= 0.95
    assert np.mean([len(set(a) & set(b)) / 3 for a, b in zip(got, exact)]) >= 0.9
