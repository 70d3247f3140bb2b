# python tools/benchmarks/bench_retrieval.py            (default: 1000 generated docs, BM25 + dense, ~1-2 min)
# python tools/benchmarks/bench_retrieval.py --corpus my.jsonl --docs 0 --seconds 10 --concurrency 1 8 32 64
"""Retrieval server throughput and latency, measured side by side in one run.

For each index kind (BM25, dense with the packaged MiniLM) a real server process is started on loopback and hit
  1. by C concurrent single-query clients (C = 1, 8, 32) for a fixed time each: QPS, p50/p99 latency, and how
     many queries the server's micro-batcher put into one encoder/faiss call;
  2. by one client sending batches of B queries in a single request (as the rollout does every turn):
     queries/s over HTTP next to queries/s of the same retriever called in-process (the HTTP + JSON overhead).
Ratios are against the first row of each table, so they hold on any machine.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time

import numpy as np

from megatron_searchr1.search.launch import ServerProcess


def make_corpus(path: str, n: int, seed: int = 0) -> list[str]:
    """n invented-people passages and one matching question each; returns the questions."""
    rng = random.Random(seed)
    words = ("baker astronomer carpenter violinist surgeon beekeeper pilot glassblower librarian fisherman "
             "architect chemist Lisbon Nairobi Oslo Kyoto Lima Cairo Toronto Sydney Warsaw Hanoi chess surfing "
             "pottery birdwatching knitting climbing origami sailing gardening fencing").split()
    syllables = ["ka", "lo", "mi", "ra", "ven", "tor", "zel", "dri", "os", "bel", "qua", "fin"]
    import json

    questions = []
    with open(path, "w") as f:
        for i in range(n):
            name = "".join(rng.choice(syllables) for _ in range(3)).capitalize() + f" {i}"
            a, b, c = rng.sample(words, 3)
            f.write(json.dumps({"id": str(i), "contents": f'"{name}"\n{name} is a {a} from {b} who loves {c}. '
                                                          f"{name} was born in {1800 + i % 200}."}) + "\n")
            questions.append(f"the {a} from {b} who loves {c}")
    return questions


async def closed_loop(url: str, questions: list[str], concurrency: int, seconds: float, topk: int) -> dict:
    """`concurrency` clients, each sending one-query requests back to back until the time is up."""
    import httpx

    latencies: list[float] = []
    errors = 0
    deadline = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        async def worker(w: int):
            nonlocal errors
            i = w
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                r = await client.post(f"{url}/retrieve", json={"queries": [questions[i % len(questions)]],
                                                               "topk": topk, "return_scores": True})
                if r.status_code == 200:
                    latencies.append(time.perf_counter() - t0)
                else:
                    errors += 1
                i += concurrency

        before = (await client.get(f"{url}/health")).json()["batching"]
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        wall = time.perf_counter() - t0
        after = (await client.get(f"{url}/health")).json()["batching"]
    batches = max(after["batches"] - before["batches"], 1)
    lat = np.array(latencies) * 1000
    return {"requests": len(latencies), "errors": errors, "qps": len(latencies) / wall,
            "p50": float(np.percentile(lat, 50)) if lat.size else float("nan"),
            "p99": float(np.percentile(lat, 99)) if lat.size else float("nan"),
            "per_batch": (after["queries"] - before["queries"]) / batches}


def batch_throughput(url: str, retriever, questions: list[str], batch: int, topk: int, min_seconds: float) -> dict:
    import httpx

    def run(fn):
        n, t0 = 0, time.perf_counter()
        while True:
            qs = [questions[(n * batch + j) % len(questions)] for j in range(batch)]
            fn(qs)
            n += 1
            if time.perf_counter() - t0 >= min_seconds and n >= 2:
                return n * batch / (time.perf_counter() - t0), (time.perf_counter() - t0) / n * 1000

    with httpx.Client(timeout=120) as client:
        http_qps, http_ms = run(lambda qs: client.post(f"{url}/retrieve", json={
            "queries": qs, "topk": topk, "return_scores": True}).raise_for_status())
    local_qps, _ = run(lambda qs: retriever.search_ids(qs, topk))
    return {"http_qps": http_qps, "http_ms": http_ms, "local_qps": local_qps}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--corpus", help="corpus JSONL to index (default: generate --docs passages)")
    p.add_argument("--docs", type=int, default=1000, help="generated passages when --corpus is not given")
    p.add_argument("--kinds", nargs="+", default=["bm25", "dense"], choices=["bm25", "dense", "hybrid"])
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 32, 256])
    p.add_argument("--seconds", type=float, default=4.0, help="per concurrency level")
    p.add_argument("--topk", type=int, default=3)
    p.add_argument("--server-args", default="", help="extra server flags, e.g. '--batch-window-ms 0'")
    p.add_argument("--torch-threads", type=int, default=1, help="encoder threads, here and in the server")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import httpx
    import torch

    torch.set_num_threads(args.torch_threads)  # the in-process column must use what the server uses
    server_args = ["--torch-threads", str(args.torch_threads), *args.server_args.split()]
    from megatron_searchr1.search.corpus import load_corpus
    from megatron_searchr1.search.retrievers import build_index

    with tempfile.TemporaryDirectory(prefix="bench_retrieval_") as tmp:
        if args.corpus:
            corpus_path = args.corpus
            docs = load_corpus(corpus_path)  # once: a big corpus takes a while to parse
            num_docs, questions = len(docs), [d["text"][:80] for d in docs[:1000]]
            del docs
        else:
            corpus_path = os.path.join(tmp, "corpus.jsonl")
            num_docs, questions = args.docs, make_corpus(corpus_path, args.docs)
        print(f"corpus: {corpus_path}, {num_docs} docs; {os.cpu_count()} CPUs; "
              f"server flags: {' '.join(server_args)}")
        for kind in args.kinds:
            t0 = time.time()
            retriever = build_index(corpus_path, os.path.join(tmp, kind), kind=kind, show_progress=False)
            print(f"\n== {kind}: index built in {time.time() - t0:.1f}s")
            server = ServerProcess(["--index-dir", os.path.join(tmp, kind), "--log-level", "warning", *server_args])
            url = server.start().url
            try:
                asyncio.run(closed_loop(url, questions, 4, 0.5, args.topk))  # warm-up
                print(f"{'clients':>8} {'requests':>9} {'QPS':>8} {'x QPS':>6} {'p50 ms':>8} {'p99 ms':>8} "
                      f"{'q/batch':>8} {'errors':>6}")
                base = None
                for c in args.concurrency:
                    r = asyncio.run(closed_loop(url, questions, c, args.seconds, args.topk))
                    base = base or r["qps"]
                    print(f"{c:>8} {r['requests']:>9} {r['qps']:>8.1f} {r['qps'] / base:>6.2f} {r['p50']:>8.1f} "
                          f"{r['p99']:>8.1f} {r['per_batch']:>8.1f} {r['errors']:>6}")
                print(f"{'batch':>8} {'HTTP q/s':>9} {'x q/s':>6} {'ms/req':>8} {'local q/s':>10} {'HTTP/local':>10}")
                base = None
                max_queries = httpx.get(f"{url}/health", timeout=10).json()["limits"]["max_queries"]
                batches = []
                for b in args.batches:
                    if b > max_queries:  # the server would answer 413: one request cannot carry more
                        print(f"batch {b} is above the server's max_queries {max_queries}: measuring {max_queries} "
                              f"instead (raise the limit with --server-args '--max-queries {b}')")
                        b = max_queries
                    if b not in batches:
                        batches.append(b)
                for b in batches:
                    r = batch_throughput(url, retriever, questions, b, args.topk, min_seconds=args.seconds / 4)
                    base = base or r["http_qps"]
                    print(f"{b:>8} {r['http_qps']:>9.1f} {r['http_qps'] / base:>6.1f} {r['http_ms']:>8.1f} "
                          f"{r['local_qps']:>10.1f} {r['http_qps'] / r['local_qps']:>10.2f}")
            finally:
                server.stop()


if __name__ == "__main__":
    main()
