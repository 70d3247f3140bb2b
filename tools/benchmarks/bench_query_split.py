# python tools/benchmarks/bench_query_split.py          (2,000 generated passages, real MiniLM, ~3 min on 2 cores)
# python tools/benchmarks/bench_query_split.py --batches 1,64,512 --backends torch,onnxruntime --out split.json
"""Where a /retrieve batch's time goes (encoding the queries, the faiss search, rendering the JSON) at the demo's
and Search-R1's batch sizes, on the torch and the onnxruntime encoder, side by side in one run.

Each batch is new, distinct queries (the query cache is off), so every query is encoded: the worst case of a
trainer's turn, whose repeats (GRPO's n samples of a prompt) the server would otherwise encode once. The steps are
the server's own: `Encoder.encode` (tokenize, length-sort, batched forward, pool), `index.search` on a Flat index
(the search's cost does not depend on the encoder), `render_result` (the response body). Each figure is the median
of --repeats batches. The two backends' query embeddings are also compared (max absolute difference).
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

import numpy as np

from megatron_searchr1.cli import ArgumentParser, UsageError, run_main

# The demo's GRPO step: 8 prompts x rollout.n 8 = 64 searches a turn; Search-R1: train_batch_size 512 (x n_agent 5
# repeats, which dedup and the cache remove); FlashRAG's measurement: 256.
DEFAULT_BATCHES = "1,64,256,512"


def split(encoder, index, corpus, queries: list[str], topk: int = 3) -> dict:
    """Seconds spent encoding, searching and rendering one batch of `queries`."""
    from megatron_searchr1.search.protocol import render_result

    t0 = time.perf_counter()
    emb = encoder.encode(queries, is_query=True)
    t1 = time.perf_counter()
    scores, ids = index.search(emb, topk)
    t2 = time.perf_counter()
    render_result(corpus, ids, scores, True)
    t3 = time.perf_counter()
    return {"encode_s": t1 - t0, "search_s": t2 - t1, "render_s": t3 - t2}


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=2000, help="generated passages (bench_retrieval.make_corpus)")
    p.add_argument("--batches", default=DEFAULT_BATCHES, help="comma-separated queries per batch")
    p.add_argument("--backends", default="torch,onnxruntime", help="encoder backends to compare")
    p.add_argument("--repeats", type=int, default=3, help="batches per (size, backend); the median is shown")
    p.add_argument("--torch-threads", type=int, default=0, help="0 = every core")
    p.add_argument("--out", help="also write the rows as JSON here")
    args = p.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",") if b]
    except ValueError:
        raise UsageError(f"--batches must be comma-separated integers, got {args.batches!r}") from None
    backends = [b for b in args.backends.split(",") if b]
    if not batches or min(batches) < 1:
        raise UsageError("--batches: each size must be >= 1")
    if not backends or set(backends) - {"torch", "onnxruntime"}:
        raise UsageError(f"--backends: choose from torch,onnxruntime, got {args.backends!r}")
    if args.docs < 1 or args.repeats < 1:
        raise UsageError("--docs and --repeats must be >= 1")
    if "onnxruntime" in backends:
        from megatron_searchr1.search import onnx_encoder

        if (why := onnx_encoder.available()) is not None:
            raise UsageError(why)
    import faiss

    from megatron_searchr1.search.corpus import open_corpus
    from megatron_searchr1.search.encoder import Encoder, EncoderConfig, set_cpu_threads

    threads = set_cpu_threads(args.torch_threads or None)
    tmp = tempfile.mkdtemp(prefix="bench_split_")
    corpus_path = os.path.join(tmp, "corpus.jsonl")
    from bench_retrieval import make_corpus  # a sibling script: run as a script, its folder is on sys.path

    make_corpus(corpus_path, args.docs)
    corpus = open_corpus(corpus_path)
    encoders = {b: Encoder(EncoderConfig(backend=b, device="cpu"), query_cache_size=0) for b in backends}
    first = encoders[backends[0]]
    t0 = time.perf_counter()
    x = first.encode([corpus[i]["contents"] for i in range(len(corpus))], is_query=False)
    print(f"{len(corpus)} passages encoded in {time.perf_counter() - t0:.1f}s on {backends[0]} ({threads} threads); "
          f"encoder batch size {first.config.batch_size}", flush=True)
    index = faiss.IndexFlatIP(x.shape[1])
    index.add(x)
    rng = np.random.default_rng(0)
    picked = rng.choice(len(corpus), min(256, len(corpus)), replace=False)
    words = [corpus[int(i)]["contents"].split() for i in picked]
    serial = iter(range(10 ** 9))

    def fresh(n: int) -> list[str]:  # distinct, never seen: nothing is cached or deduplicated
        return [" ".join(words[i % len(words)][:8]) + f" {next(serial)}" for i in range(n)]

    probe = fresh(64)
    embeddings = {b: e.encode(probe, is_query=True) for b, e in encoders.items()}  # also a warm-up
    diff = max(float(np.abs(embeddings[b] - embeddings[backends[0]]).max()) for b in backends)
    rows = []
    for batch in batches:
        for backend in backends:
            runs = [split(encoders[backend], index, corpus, fresh(batch)) for _ in range(args.repeats)]
            row = {"batch": batch, "backend": backend, **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
            total = row["encode_s"] + row["search_s"] + row["render_s"]
            row.update(total_s=total, encode_share=row["encode_s"] / total, queries_per_s=batch / total)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{len(corpus)} passages, Flat top-3, {threads} threads; max |embedding difference| between backends "
          f"{diff:.1e}\n")
    print("| batch | backend | encode s | search s | render s | encode share | queries/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['backend']} | {r['encode_s']:.4f} | {r['search_s']:.4f} | {r['render_s']:.4f} | "
              f"{100 * r['encode_share']:.0f} % | {r['queries_per_s']:.0f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"docs": len(corpus), "threads": threads, "max_embedding_diff": diff, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
