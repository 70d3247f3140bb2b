# python tools/benchmarks/bench_query_split.py          (2,000 generated passages, real MiniLM, ~3 min on 2 cores)
# python tools/benchmarks/bench_query_split.py --batches 1,64,512 --backends torch,onnxruntime --out split.json
# python tools/benchmarks/bench_query_split.py --corpus pydoc --backends onnxruntime --batches 1,64 \
#     --rerank-model minilm --rerank-candidates 10,20      (+ the cross-encoder stage: pairs/s, its share)
"""Where a /retrieve batch's time goes (encoding the queries, the faiss search, rendering the JSON) at the demo's
and Search-R1's batch sizes, on the torch and the onnxruntime encoder, side by side in one run.

Each batch is new, distinct queries (the query cache is off), so every query is encoded: the worst case of a
trainer's turn, whose repeats (GRPO's n samples of a prompt) the server would otherwise encode once. The steps are
the server's own: `Encoder.encode` (tokenize, length-sort, batched forward, pool), `index.search` on a Flat index
(the search's cost does not depend on the encoder), `render_result` (the response body). Each figure is the median
of --repeats batches. The two backends' query embeddings are also compared (max absolute difference).

--rerank-model adds the server's rerank stage (`--rerank cross`): each batch retrieves N (--rerank-candidates)
passages per query from the Flat index, a cross-encoder scores every (query, passage) pair as the server does
(`CrossEncoderScorer`, Search-R1's passage format, length-sorted batches of --rerank-batch-size), and the top-3 is
rendered. `--rerank-model minilm` builds a real-size cross-encoder here with no download: a
BertForSequenceClassification whose body is the packaged MiniLM's weights and whose one-label head is fresh. Its
scores mean nothing, but its compute per pair is a MiniLM-L6 cross-encoder's (ms-marco-MiniLM-L6-v2 has this
shape), which is what the throughput figure needs. --corpus pydoc gives passages of 20-120 words, nearer a
wiki-18 passage (100 words) than the generated ones, and the pair's length sets the cross-encoder's cost.
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


def make_minilm_cross_encoder(out_dir: str) -> str:
    """A one-label BertForSequenceClassification with the packaged MiniLM's body and a fresh (seeded) head, saved
    with MiniLM's tokenizer as a transformers directory the server's --rerank-model takes."""
    import torch
    from transformers import AutoModel, AutoTokenizer, BertForSequenceClassification

    from megatron_searchr1.search.encoder import packaged_minilm_dir

    src = packaged_minilm_dir()
    body = AutoModel.from_pretrained(src)
    config = body.config
    config.num_labels, config.architectures = 1, ["BertForSequenceClassification"]
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    missing, unexpected = model.bert.load_state_dict(body.state_dict(), strict=False)
    if unexpected or [k for k in missing if not k.startswith("pooler.")]:
        raise RuntimeError(f"MiniLM body does not fit BERT: missing {missing}, unexpected {unexpected}")
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(src).save_pretrained(out_dir)
    return out_dir


def rerank_split(encoder, index, corpus, scorer, queries: list[str], candidates: int, topk: int = 3) -> dict:
    """Seconds spent encoding, retrieving `candidates` per query, cross-encoding every pair, rendering the top-k;
    also the process's CPU seconds in the rerank stage, which other jobs on the machine inflate far less than the
    wall time (with one thread, CPU seconds per pair are what a free core would take)."""
    from megatron_searchr1.search.protocol import render_result

    t0 = time.perf_counter()
    emb = encoder.encode(queries, is_query=True)
    t1 = time.perf_counter()
    _, cand = index.search(emb, candidates)
    t2, c2 = time.perf_counter(), time.process_time()
    scores = scorer.score(queries, cand, corpus)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :topk]
    ids, best = np.take_along_axis(cand, order, 1), np.take_along_axis(scores, order, 1)
    t3, c3 = time.perf_counter(), time.process_time()
    render_result(corpus, ids, best, True)
    t4 = time.perf_counter()
    return {"encode_s": t1 - t0, "search_s": t2 - t1, "rerank_s": t3 - t2, "render_s": t4 - t3,
            "rerank_cpu_s": c3 - c2, "pairs": int((cand >= 0).sum())}


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=2000, help="generated passages (bench_retrieval.make_corpus)")
    p.add_argument("--batches", default=DEFAULT_BATCHES, help="comma-separated queries per batch")
    p.add_argument("--backends", default="torch,onnxruntime", help="encoder backends to compare")
    p.add_argument("--repeats", type=int, default=3, help="batches per (size, backend); the median is shown")
    p.add_argument("--torch-threads", type=int, default=0, help="0 = every core")
    p.add_argument("--out", help="also write the rows as JSON here")
    p.add_argument("--corpus", choices=("synthetic", "pydoc"), default="synthetic",
                   help="generated passages, or real English from this Python's documentation (bench_index)")
    p.add_argument("--rerank-model", help="also time the cross-encoder rerank stage with this model directory; "
                                          "'minilm' builds a real-size one from the packaged MiniLM's weights")
    p.add_argument("--rerank-candidates", default="10,20", help="comma-separated N (passages re-scored per query)")
    p.add_argument("--rerank-batches", default="1,64", help="comma-separated queries per batch for the rerank rows")
    p.add_argument("--rerank-batch-size", type=int, default=32, help="pairs per cross-encoder forward pass")
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
    try:
        rerank_n = [int(v) for v in args.rerank_candidates.split(",") if v]
        rerank_batches = [int(v) for v in args.rerank_batches.split(",") if v]
    except ValueError:
        raise UsageError("--rerank-candidates and --rerank-batches take comma-separated integers") from None
    if args.rerank_model and (not rerank_n or not rerank_batches or min(rerank_n + rerank_batches) < 1
                              or args.rerank_batch_size < 1):
        raise UsageError("--rerank-candidates, --rerank-batches and --rerank-batch-size must be >= 1")
    if args.rerank_model not in (None, "minilm") and not os.path.isdir(args.rerank_model):
        raise UsageError(f"--rerank-model {args.rerank_model!r} is not a directory (or 'minilm' to build one)")
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

    if args.corpus == "pydoc":
        from bench_index import make_text_corpus

        make_text_corpus(corpus_path, args.docs)
    else:
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
    rerank_rows = []
    if args.rerank_model:
        from megatron_searchr1.search.rerank import CrossEncoderScorer

        model_dir = args.rerank_model
        if model_dir == "minilm":
            model_dir = make_minilm_cross_encoder(os.path.join(tmp, "minilm_cross"))
        scorer = CrossEncoderScorer(model_dir, batch_size=args.rerank_batch_size, device="cpu")
        encoder = encoders[backends[-1]]
        rerank_split(encoder, index, corpus, scorer, fresh(4), 4)  # warm-up
        for batch in rerank_batches:
            for n in rerank_n:
                runs = [rerank_split(encoder, index, corpus, scorer, fresh(batch), n) for _ in range(args.repeats)]
                row = {"batch": batch, "candidates": n, "backend": backends[-1],
                       **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
                total = sum(row[k] for k in ("encode_s", "search_s", "rerank_s", "render_s"))
                row.update(total_s=total, rerank_share=row["rerank_s"] / total, pairs_per_s=row["pairs"] /
                           row["rerank_s"], ms_per_pair=1000 * row["rerank_s"] / row["pairs"],
                           cpu_ms_per_pair=1000 * row["rerank_cpu_s"] / row["pairs"],
                           rerank_ms_per_query=1000 * row["rerank_s"] / batch, queries_per_s=batch / total,
                           load_avg=os.getloadavg()[0])
                rerank_rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{len(corpus)} {args.corpus} passages, Flat top-3, {threads} threads, load average "
          f"{os.getloadavg()[0]:.1f}; max |embedding difference| between backends "
          f"{diff:.1e}\n")
    print("| batch | backend | encode s | search s | render s | encode share | queries/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['backend']} | {r['encode_s']:.4f} | {r['search_s']:.4f} | {r['render_s']:.4f} | "
              f"{100 * r['encode_share']:.0f} % | {r['queries_per_s']:.0f} |")
    if rerank_rows:
        print("\n| batch | N re-scored | pairs | encode s | search s | rerank s | render s | rerank share | pairs/s | "
              "ms/pair | CPU ms/pair | rerank ms/query | queries/s | load avg |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rerank_rows:
            print(f"| {r['batch']} | {r['candidates']} | {r['pairs']} | {r['encode_s']:.4f} | {r['search_s']:.4f} | "
                  f"{r['rerank_s']:.4f} | {r['render_s']:.4f} | {100 * r['rerank_share']:.0f} % | "
                  f"{r['pairs_per_s']:.1f} | {r['ms_per_pair']:.2f} | {r['cpu_ms_per_pair']:.2f} | "
                  f"{r['rerank_ms_per_query']:.0f} | {r['queries_per_s']:.2f} | {r['load_avg']:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"docs": len(corpus), "corpus": args.corpus, "threads": threads, "max_embedding_diff": diff,
                       "load_avg": os.getloadavg()[0], "rows": rows, "rerank_rows": rerank_rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
