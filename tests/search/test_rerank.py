"""The rerank stage served end to end on loopback: a small random cross-encoder made here, and the real MiniLM
re-scoring BM25's candidates. Each returned order is checked against scores the model computes on its own
(sentence-transformers), not against our code."""
import os
import subprocess
import sys

import httpx
import numpy as np
import pytest

from megatron_searchr1.search.encoder import packaged_minilm_dir

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def cross_encoder_dir(tmp_path_factory):
    """A 2-layer BERT sequence classifier (one label) with random weights and MiniLM's tokenizer, saved as a
    transformers directory: what a user's cross-encoder directory looks like, small enough for the CPU.
    initializer_range 0.5 spreads its scores far apart, so float rounding cannot swap two candidates."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    out = tmp_path_factory.mktemp("cross_encoder")
    tokenizer = AutoTokenizer.from_pretrained(packaged_minilm_dir())
    torch.manual_seed(0)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=512, num_labels=1, initializer_range=0.5)
    BertForSequenceClassification(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def _serve(flags):
    from megatron_searchr1.search.server import (BackgroundServer, ServerConfig, build_arg_parser, check_args,
                                                 load_from_args)

    args = build_arg_parser().parse_args(flags)
    check_args(args)
    return BackgroundServer(load_from_args(args), ServerConfig(port=0))


def _post(url, queries, topk=3, return_scores=True):
    r = httpx.post(f"{url}/retrieve", json={"queries": queries, "topk": topk, "return_scores": return_scores},
                   timeout=300)
    r.raise_for_status()
    return r.json()["result"]


def _expected(candidates, scores, topk):
    """Rows of the best `topk` candidates by score, ties to the lower row (the server's rule)."""
    order = sorted(range(len(candidates)), key=lambda j: (-scores[j], candidates[j]))
    return [candidates[j] for j in order[:topk]]


@pytest.mark.parametrize("base", ["bm25", "dense", "hybrid"])
def test_cross_rerank_returns_the_models_own_order(base, request, world, cross_encoder_dir):
    """BM25, MiniLM/Flat or hybrid top-10 -> cross-encoder top-3 (Search-R1's e5 top-10 -> cross-encoder top-3):
    the served top-3 is the top-3 of the candidates by sentence-transformers' own scores of the same pairs."""
    from sentence_transformers import CrossEncoder

    index_dir, retriever = request.getfixturevalue(f"{base}_index")
    queries = world["queries"][:30] + world["queries"][:5]  # repeats, as a GRPO batch sends them
    with _serve(["--index-dir", index_dir, "--rerank", "cross", "--rerank-model", cross_encoder_dir,
                 "--rerank-candidates", "10"]) as srv:
        got = _post(srv.url, queries)
        plain = _post(srv.url, queries[:2], return_scores=False)
        empty = httpx.post(f"{srv.url}/retrieve", json={"queries": []}, timeout=30).json()
        health = httpx.get(f"{srv.url}/health", timeout=30).json()
    cand, _ = retriever.search_ids(queries, 10)
    ce = CrossEncoder(cross_encoder_dir, device="cpu", activation_fn=lambda x: x)  # raw logits
    # the passage as Search-R1's reranker writes it: (Title: "<title>") <text>
    docs = world["docs"]
    valid = [[int(i) for i in row if i >= 0] for row in cand]  # BM25 may find fewer than 10
    pairs = [(q, f'(Title: "{docs[i]["title"]}") {docs[i]["text"]}') for q, rows in zip(queries, valid) for i in rows]
    flat = iter(np.asarray(ce.predict(pairs, batch_size=7)).tolist())
    ref = [[next(flat) for _ in rows] for rows in valid]
    row_of = {d["id"]: i for i, d in enumerate(world["docs"])}
    changed = 0
    for q, row, ref_row, hits in zip(queries, valid, ref, got):
        want = _expected(row, ref_row, 3)
        assert [row_of[h["document"]["id"]] for h in hits] == want, q
        by_row = dict(zip(row, ref_row))
        np.testing.assert_allclose([h["score"] for h in hits], [by_row[r] for r in want], rtol=1e-4, atol=1e-4)
        changed += want != list(row[:3])
    assert changed >= 10  # the stage is live: it reorders the base's top-3 for many queries
    assert plain == [[{"id": h["document"]["id"], "contents": h["document"]["contents"]} for h in got[i]]
                     for i in range(2)]
    assert empty == {"result": []}
    stats = health["rerank"]
    assert (stats["mode"], stats["candidates"], stats["batch_size"]) == ("cross", 10, 32)
    n_pairs = len(pairs[: sum(len(v) for v in valid[:30])]) + sum(len(v) for v in valid[:2])
    assert stats["unique_queries"] == 30 + 2 and stats["pairs_scored"] == n_pairs
    # pairs of a call are batched 32 at a time: one call of 30 distinct queries, one of 2
    first = sum(len(v) for v in valid[:30])
    assert stats["forward_batches"] == -(-first // 32) + -(-(n_pairs - first) // 32)
    assert stats["rerank_seconds"] > 0 and stats["retrieve_seconds"] > 0
    assert health["kind"] == base


def test_batch_size_and_batch_company_do_not_change_the_order(bm25_index, world, cross_encoder_dir):
    from megatron_searchr1.search.server import build_arg_parser, load_from_args

    index_dir, _ = bm25_index
    queries = world["queries"][:40]
    results = {}
    for bs in (1, 32):
        r = load_from_args(build_arg_parser().parse_args(
            ["--index-dir", index_dir, "--rerank", "cross", "--rerank-model", cross_encoder_dir,
             "--rerank-candidates", "20", "--rerank-batch-size", str(bs)]))
        results[bs] = r.search_ids(queries, 5)
        stats = r.describe()["rerank"]
        assert stats["pairs_scored"] > 400 and stats["forward_batches"] == -(-stats["pairs_scored"] // bs)
        alone = [r.search_ids([q], 5)[0][0] for q in queries[:5]]
        assert all((a == b).all() for a, b in zip(alone, results[bs][0][:5]))
    assert (results[1][0] == results[32][0]).all()
    np.testing.assert_allclose(results[1][1], results[32][1], atol=1e-4)


def test_minilm_dense_rerank_of_bm25_candidates(bm25_index, world):
    """The real MiniLM re-scores BM25's top 50: the served order is sentence-transformers' cosine order, and
    the paraphrased topic questions rank their passage first at least as often as with BM25 alone."""
    from sentence_transformers import SentenceTransformer

    index_dir, bm25 = bm25_index
    queries = world["queries"]
    topics = world["topic_rows"]
    with _serve(["--index-dir", index_dir, "--rerank", "dense", "--rerank-candidates", "50"]) as srv:
        got = _post(srv.url, queries[:60])
        health = httpx.get(f"{srv.url}/health", timeout=30).json()
    cand, _ = bm25.search_ids(queries[:60], 50)
    st = SentenceTransformer(packaged_minilm_dir(), device="cpu")
    q = st.encode(queries[:60], normalize_embeddings=True)
    rows = sorted({int(i) for row in cand for i in row if i >= 0})
    p = dict(zip(rows, st.encode([bm25.corpus[i]["contents"] for i in rows], normalize_embeddings=True)))
    row_of = {d["id"]: i for i, d in enumerate(world["docs"])}
    agree = 0
    for qv, row, hits in zip(q, cand, got):
        valid = [int(i) for i in row if i >= 0]
        ref = [float(p[i] @ qv) for i in valid]
        served = [row_of[h["document"]["id"]] for h in hits]
        want = _expected(valid, ref, 3)
        agree += served == want
        np.testing.assert_allclose([h["score"] for h in hits], [p[i] @ qv for i in served], atol=2e-3)
    assert agree >= 58  # sentence-transformers pads differently: a near-tie may swap, nothing more
    bm25_top1 = sum(int(bm25.search_ids([queries[t]], 1)[0][0, 0]) == t for t in topics)
    dense_top1 = sum(bool(got[t]) and row_of[got[t][0]["document"]["id"]] == t for t in topics)
    assert dense_top1 >= bm25_top1 >= 8, (dense_top1, bm25_top1)
    reordered = sum([row_of[h["document"]["id"]] for h in hits] != [int(i) for i in row[:len(hits)]]
                    for row, hits in zip(cand, got))
    assert reordered >= 10  # the MiniLM order, not BM25's passed through
    stats = health["rerank"]
    assert stats["mode"] == "dense" and stats["pairs_scored"] == int((cand >= 0).sum())
    assert stats["passages_encoded"] == len(rows)


BAD = [
    (["--rerank-model", "X"], "--rerank-model needs --rerank cross or --rerank dense"),
    (["--rerank", "cross"], "--rerank cross needs --rerank-model DIR"),
    (["--rerank", "cross", "--rerank-model", "MINILM"], "is not a sequence-classification model"),
    (["--rerank", "dense", "--rerank-model", "CE"], "is a sequence-classification model"),
    (["--rerank", "cross", "--rerank-model", "CE", "--rerank-candidates", "2"],
     "--rerank-candidates 2 is below --default-topk 3"),
    (["--rerank", "cross", "--rerank-model", "CE", "--rerank-batch-size", "0"], "--rerank-batch-size must be >= 1"),
    (["--rerank", "dense", "--rerank-max-length", "64"], "--rerank-max-length applies to --rerank cross"),
    (["--rerank", "cross", "--rerank-model", "/nonexistent"], "is not a directory"),
    (["DENSE", "--rerank", "dense"], "gives the index's own scores again"),
]


def test_bad_rerank_flags_are_one_error_line_before_torch(tmp_path, bm25_index, dense_index, cross_encoder_dir):
    """Each mistake exits 2 with one `error:` line, and before torch is imported: a `torch` that raises on import
    stands first on the path."""
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('torch was imported before the flags were checked')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'fake'}{os.pathsep}{REPO}"}
    for flags, message in BAD:
        index = dense_index[0] if flags[0] == "DENSE" else bm25_index[0]
        flags = [{"CE": cross_encoder_dir, "MINILM": packaged_minilm_dir()}.get(f, f) for f in flags if f != "DENSE"]
        r = subprocess.run([sys.executable, "-m", "megatron_searchr1.search.server", "--index-dir", index, *flags],
                           capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert r.returncode == 2 and len(errors) == 1 and message in errors[0], (flags, r.stderr[-1500:])
        assert "Traceback" not in r.stderr, r.stderr
