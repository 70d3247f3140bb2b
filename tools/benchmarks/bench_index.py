# python tools/benchmarks/bench_index.py                     (20,000 generated passages, real MiniLM, ~5 min on 2 cores)
# python tools/benchmarks/bench_index.py --docs 2000 --queries 200 --types flat,ivf_pq
"""Every dense index type side by side on one corpus: bytes per passage, build time, QPS at 1 and 32 clients,
recall@1/3/10 against Flat on the same queries, the memory each would need for wiki-18 (21M passages, 768 dims),
and where a query's time goes (encode vs search vs rendering the JSON) at the demo's and Search-R1's batch sizes.

The passages are encoded once with the real MiniLM; each index is then built from those vectors with the same code
the CLI uses (`FaissConfig.resolve_build` + `make_faiss_index`) and searched through `DenseRetriever` (nprobe and
the refine stage as the server applies them), so the figures isolate the index. Clients are threads sending
one-query searches.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time

import numpy as np

from megatron_searchr1.cli import ArgumentParser, UsageError, run_main

WIKI18_DOCS, WIKI18_DIM = 21_000_000, 768
TYPES = ("flat", "fp16", "sq8", "sq6", "hnsw", "ivf_flat", "ivf_sq8", "ivf_pq", "opq_ivf_pq")
# OPQ's rotation trains for minutes even on a few thousand passages on 2 cores: measured only when asked for.
DEFAULT_TYPES = TYPES[:-1]


class _Vectors:
    """An encoder stand-in returning precomputed query vectors (queries are their row numbers as strings)."""

    def __init__(self, q: np.ndarray):
        self.q, self.dim = q, q.shape[1]

    def encode_unique_queries(self, queries):
        return self.q[[int(s) for s in queries]], np.arange(len(queries))


def qps(retriever, n_queries: int, clients: int, seconds: float) -> float:
    """One-query searches from `clients` threads for about `seconds`; queries per second."""
    done, stop = [0] * clients, time.time() + seconds

    def work(c):
        i = c
        while time.time() < stop:
            retriever.search_ids([str(i % n_queries)], 3)
            done[c] += 1
            i += clients

    threads = [threading.Thread(target=work, args=(c,)) for c in range(clients)]
    t0 = time.time()
    [t.start() for t in threads]
    [t.join() for t in threads]
    return sum(done) / (time.time() - t0)


def wiki18_gb(index_type: str, bytes_per_doc: float, dim: int, cfg) -> float:
    """Bytes per passage (fixed parts left out) at 768 dims times 21M: per-dimension storage scales by 768/dim;
    PQ codes follow pq_m = dim/4 (also x 768/dim); IVF ids (8 bytes) and HNSW links (8 M bytes) do not scale.
    The quantizers of a 21M-passage IVF (nlist ~18k centroids) add well under 0.1 GB."""
    fixed = 8 if "ivf" in index_type else 8 * cfg.hnsw_m if index_type == "hnsw" else 0
    return ((bytes_per_doc - fixed) * WIKI18_DIM / dim + fixed) * WIKI18_DOCS / 1e9


def encode_split(encoder, retriever, queries: list[str], batch: int) -> dict:
    """Seconds per batch of `batch` new queries spent encoding, searching (top-3) and rendering the response."""
    from megatron_searchr1.search.protocol import render_result

    qs = queries[:batch]
    t0 = time.time()
    emb = encoder.encode(qs, is_query=True)
    t1 = time.time()
    scores, ids = retriever.index.search(emb, 3)
    t2 = time.time()
    render_result(retriever.corpus, ids, scores, True)
    t3 = time.time()
    return {"batch": batch, "encode_s": t1 - t0, "search_s": t2 - t1, "render_s": t3 - t2}


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=20000, help="generated passages (bench_retrieval.make_corpus)")
    p.add_argument("--queries", type=int, default=500, help="queries for recall and QPS")
    p.add_argument("--types", default=",".join(DEFAULT_TYPES),
                   help=f"comma-separated index types, flat first (the reference); all: {','.join(TYPES)}")
    p.add_argument("--seconds", type=float, default=3.0, help="per QPS measurement")
    p.add_argument("--torch-threads", type=int, default=0, help="0 = every core")
    p.add_argument("--out", help="also write the rows as JSON here")
    args = p.parse_args(argv)
    types = [t for t in args.types.split(",") if t]
    bad = [t for t in types if t not in TYPES]
    if bad:
        raise UsageError(f"--types: unknown {bad}; choose from {','.join(TYPES)}")
    if args.docs < 1 or args.queries < 1:
        raise UsageError("--docs and --queries must be >= 1")
    import faiss

    from megatron_searchr1.search.corpus import open_corpus
    from megatron_searchr1.search.dense import DenseRetriever, FaissConfig, IndexTooSmall, make_faiss_index
    from megatron_searchr1.search.encoder import Encoder, EncoderConfig, set_cpu_threads

    threads = set_cpu_threads(args.torch_threads or None)
    tmp = tempfile.mkdtemp(prefix="bench_index_")
    corpus_path = os.path.join(tmp, "corpus.jsonl")
    from bench_retrieval import make_corpus  # a sibling script: run as a script, its folder is on sys.path

    make_corpus(corpus_path, args.docs)
    corpus = open_corpus(corpus_path)
    encoder = Encoder(EncoderConfig())
    t0 = time.time()
    x = encoder.encode([corpus[i]["contents"] for i in range(len(corpus))], is_query=False)
    encode_s = time.time() - t0
    rng = np.random.default_rng(0)
    rows = rng.choice(len(corpus), min(args.queries, len(corpus)), replace=False)
    questions = [" ".join(corpus[int(i)]["contents"].split()[:8]) for i in rows]  # a passage's opening words
    q = encoder.encode(questions, is_query=True)
    stub = _Vectors(q)
    print(f"{len(corpus)} passages encoded in {encode_s:.1f}s ({threads} threads); {len(q)} queries", flush=True)
    exact = None
    results = []
    for kind in types:
        try:
            cfg = FaissConfig(index_type=kind).resolve_build(len(corpus), x.shape[1])
        except IndexTooSmall as e:
            print(f"{kind}: skipped ({e})", flush=True)
            continue
        t0 = time.time()
        index = make_faiss_index(x.shape[1], cfg)
        if cfg.trained:
            index.train(x[np.sort(rng.choice(len(x), cfg.train_size, replace=False))])
        build_s = time.time() - t0
        path = os.path.join(tmp, f"{kind}.index")
        faiss.write_index(index, path)
        fixed = os.path.getsize(path)  # quantizers, rotation: independent of the passage count
        t0 = time.time()
        index.add(x)
        build_s += time.time() - t0
        faiss.write_index(index, path)
        size = os.path.getsize(path) - fixed
        vectors = x.astype(np.float16) if cfg.effective_refine() else None
        r = DenseRetriever(corpus, index, stub, cfg, vectors=vectors)
        ids = r.search_ids([str(i) for i in range(len(q))], 10)[0]
        if exact is None:
            if kind != "flat":
                raise UsageError("--types must start with flat (the reference for recall)")
            exact = ids
        recall = {f"recall@{k}": float(np.mean([len(set(a[:k]) & set(b[:k])) / k for a, b in zip(ids, exact)]))
                  for k in (1, 3, 10)}
        row = {"type": kind, "factory": cfg.factory, **r.search_knobs(), "bytes_per_doc": size / len(corpus), "fixed_bytes": fixed,
               "refine_bytes_per_doc": 2 * x.shape[1] if vectors is not None else 0, "build_s": build_s,
               "qps_1": qps(r, len(q), 1, args.seconds), "qps_32": qps(r, len(q), 32, args.seconds), **recall}
        row["wiki18_ram_gb"] = wiki18_gb(kind, row["bytes_per_doc"], x.shape[1], cfg)
        row["wiki18_refine_disk_gb"] = 2 * WIKI18_DIM * WIKI18_DOCS / 1e9 if vectors is not None else 0.0
        results.append(row)
        print(json.dumps(row), flush=True)
    flat = DenseRetriever(corpus, faiss.read_index(os.path.join(tmp, "flat.index")), encoder, FaissConfig())
    split = [encode_split(encoder, flat, [f"{s} {b}" for s in questions * 64][: max(256, b)], b) for b in (8, 256)]
    print("| type | factory | bytes/passage | build s | QPS 1 | QPS 32 | R@1 | R@3 | R@10 | wiki-18 RAM GB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        extra = f" (+{r['wiki18_refine_disk_gb']:.0f} GB fp16 on disk, mapped)" if r["wiki18_refine_disk_gb"] else ""
        print(f"| {r['type']} | `{r['factory']}` | {r['bytes_per_doc']:.0f} | {r['build_s']:.1f} | {r['qps_1']:.0f} | "
              f"{r['qps_32']:.0f} | {r['recall@1']:.3f} | {r['recall@3']:.3f} | {r['recall@10']:.3f} | "
              f"{r['wiki18_ram_gb']:.1f}{extra} |")
    print("\n| batch | encode s | search s (flat) | render s |\n|---|---|---|---|")
    for s in split:
        print(f"| {s['batch']} | {s['encode_s']:.3f} | {s['search_s']:.4f} | {s['render_s']:.4f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"docs": len(corpus), "dim": int(x.shape[1]), "encode_s": encode_s, "rows": results,
                       "split": split}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
