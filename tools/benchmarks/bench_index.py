# python tools/benchmarks/bench_index.py                     (20,000 generated passages, real MiniLM, ~5 min on 2 cores)
# python tools/benchmarks/bench_index.py --docs 2000 --queries 200 --types flat,ivf_pq
# python tools/benchmarks/bench_index.py --corpus pydoc --docs 4000   (real English: the stdlib's docs, no internet)
# python tools/benchmarks/bench_index.py --corpus world+pydoc --docs 25000 --pydoc 1000 --types all \
#     --served-clients 32 --cache-dir ~/.cache/bench_index   (the full table: every type, served over HTTP too;
#                                                            embeddings kept: a re-run encodes nothing)
"""Every dense index type side by side on one corpus: bytes per passage, build time, QPS at 1 and 32 clients,
recall@1/3/10 against Flat on the same queries, the memory each would need for wiki-18 (21M passages, 768 dims),
and where a query's time goes (encode vs search vs rendering the JSON) at the demo's and Search-R1's batch sizes.

The passages are encoded once with the real MiniLM; each index is then built from those vectors with the same code
the CLI uses (`FaissConfig.resolve_build` + `make_faiss_index`) and searched through `DenseRetriever` (nprobe and
the refine stage as the server applies them), so the figures isolate the index. "index QPS 1 / 32" there is 1 or 32
threads sending one-query searches to the index. With --served-clients N, each index file is also served by the
real server (a separate process on loopback, query cache off, the same knobs): "served QPS 1 / N" is 1 or N HTTP
clients sending fresh one-query requests (encoding included, the figure a trainer sees), and "served R@3" the
recall@3 of its answers to the benchmark's queries, asked in Search-R1's request shape, against the served Flat's.
--sweep adds recall@3 and one-thread QPS per nprobe (IVF types) and per efSearch (HNSW).

--corpus synthetic: invented-people passages (bench_retrieval.make_corpus); --corpus pydoc: real English text
found on any Python install, the docstrings of the standard library's source files and the reference manual's
topics (pydoc_data.topics), cut into passages of at most 120 words; --corpus world: the synthetic world's passages
(people, companies, products, places; data/synthetic.py) at the size asked for, queried with the world's own
questions; --corpus world+pydoc: every pydoc passage (up to half of --docs) and world passages for the rest, half
the queries from each. Queries elsewhere are a passage's first 8 words.

--cache-dir keeps the corpus, the queries and their embeddings (written chunk by chunk, so an interrupted encoding
resumes): encoding is most of a large run's time on a CPU, and the index measurements do not need it repeated.
Wall times (build, QPS) depend on what else the machine runs: the load average is recorded beside them.
"""
from __future__ import annotations

import ast
import json
import os
import random
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


def make_text_corpus(path: str, n: int, seed: int = 0) -> int:
    """Up to n passages of real English from this Python install: the docstrings of the stdlib's source files
    (parsed, not imported) and pydoc_data.topics, each cut into pieces of at most 120 words, pieces under 20 words
    and repeats dropped, a seeded sample of n written as {id, contents}; returns the count written."""
    import sysconfig

    from pydoc_data.topics import topics

    texts = [(f"topic {name}", text) for name, text in sorted(topics.items())]
    root = sysconfig.get_paths()["stdlib"]
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("test", "tests", "idle_test", "site-packages"))
        for name in sorted(f for f in files if f.endswith(".py")):
            try:
                with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            module = os.path.relpath(os.path.join(dirpath, name), root)[:-3].replace(os.sep, ".")
            for node in [tree, *ast.walk(tree)]:
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc:
                        texts.append((f"{module}.{getattr(node, 'name', '')}".rstrip("."), doc))
    passages, seen = [], set()
    for title, text in texts:
        words = text.split()
        for s in range(0, len(words), 120):
            piece = " ".join(words[s:s + 120])
            if len(words[s:s + 120]) >= 20 and piece not in seen:
                seen.add(piece)
                passages.append((title, piece))
    random.Random(seed).shuffle(passages)
    with open(path, "w") as f:
        for i, (title, piece) in enumerate(passages[:n]):
            f.write(json.dumps({"id": str(i), "contents": f'"{title}"\n{piece}'}) + "\n")
    return min(n, len(passages))


def make_world_corpus(path: str, n: int, first_id: int = 0, seed: int = 0, mode: str = "w") -> list[str]:
    """n passages of a synthetic world scaled to about n entities (a seeded sample when it makes more), appended to
    `path` with ids from first_id; returns the world's questions (every split), shuffled."""
    from megatron_searchr1.data.synthetic import WorldConfig, corpus_records, generate

    base = {"n_people": 10000, "n_companies": 2500, "n_products": 2500, "n_distractors": 2500,
            "n_universities": 500, "n_cities": 400, "n_countries": 40}  # ~18,460 passages
    scale = max(1.0, n / 18000)  # a smaller n is a sample of this world
    cfg = WorldConfig(seed=seed, **{k: max(10, int(v * scale)) for k, v in base.items()},
                      n_train=2000, n_validation=500, n_test=500)
    world, rows = generate(cfg)
    records = corpus_records(world)
    keep = sorted(random.Random(seed).sample(range(len(records)), min(n, len(records))))
    with open(path, mode) as f:
        for j, i in enumerate(keep):
            f.write(json.dumps({"id": str(first_id + j), "contents": records[i]["contents"]}) + "\n")
    questions = [r["extra_info"]["question"] for rs in rows.values() for r in rs]
    random.Random(seed).shuffle(questions)
    return questions


def make_bench_corpus(kind: str, path: str, docs: int, n_queries: int, pydoc: int = 0) -> list[tuple[str, str]]:
    """Write the corpus `kind` to `path`; the (query, source) pairs to measure recall on. pydoc: how many of a
    world+pydoc corpus's passages are pydoc's (0 = all it has, up to half of docs)."""
    from bench_retrieval import make_corpus  # a sibling script: run as a script, its folder is on sys.path

    def openings(rows, source):
        return [(" ".join(json.loads(line)["contents"].split()[:8]), source) for line in rows]

    rng = np.random.default_rng(0)
    if kind == "synthetic":
        make_corpus(path, docs)
    elif kind == "pydoc":
        make_text_corpus(path, docs)
    if kind in ("synthetic", "pydoc"):
        with open(path) as f:
            lines = f.readlines()
        picked = rng.choice(len(lines), min(n_queries, len(lines)), replace=False)
        return openings([lines[int(i)] for i in picked], kind)
    n_pydoc = make_text_corpus(path, min(pydoc or docs // 2, docs - 1)) if kind == "world+pydoc" else 0
    with open(path) as f:
        lines = f.readlines()
    questions = make_world_corpus(path, docs - n_pydoc, first_id=n_pydoc, mode="a" if n_pydoc else "w")
    n_world = n_queries - n_queries // 2 if n_pydoc else n_queries
    queries = [(q, "world") for q in questions[:n_world]]
    if n_pydoc:
        picked = rng.choice(n_pydoc, min(n_queries // 2, n_pydoc), replace=False)
        queries += openings([lines[int(i)] for i in picked], "pydoc")
    return queries


def encode_cached(encoder, corpus, queries: list[str], cache: str | None, chunk: int = 2048,
                  first: int | None = None):
    """Passage and query embeddings, from `cache` when they are there; passages are encoded and saved a chunk at a
    time, so an interrupted run resumes where it stopped. first: only the chunks holding the first `first`
    passages are read or encoded, and their rows returned. Returns (passages, queries, seconds spent encoding)."""
    t0, parts = time.time(), []
    n = len(corpus) if first is None else min(first, len(corpus))
    for s in range(0, n, chunk):
        part = os.path.join(cache, f"passages.{s // chunk:05d}.npy") if cache else None
        if part and os.path.exists(part):
            parts.append(np.load(part))
            continue
        x = encoder.encode([corpus[i]["contents"] for i in range(s, min(s + chunk, len(corpus)))], is_query=False)
        if part:
            np.save(part + ".tmp.npy", x)
            os.replace(part + ".tmp.npy", part)
            print(f"encoded passages {s}-{s + len(x)} of {len(corpus)} ({time.time() - t0:.0f}s)", flush=True)
        parts.append(x)
    qpath = os.path.join(cache, "queries.npy") if cache else None
    if qpath and os.path.exists(qpath):
        q = np.load(qpath)
    else:
        q = encoder.encode(queries, is_query=True)
        if qpath:
            np.save(qpath, q)
    return np.concatenate(parts)[:n], q, time.time() - t0


def recall_at(ids, exact, k: int) -> float:
    """Mean share of each query's top-k from Flat (`exact`) that `ids` also returns in its top k."""
    return float(np.mean([len(set(a[:k]) & set(b[:k])) / k for a, b in zip(ids, exact)]))


def recalls(ids, exact, sources: np.ndarray) -> dict:
    """recall@1/3/10 against Flat, and recall@3 per query source when the queries come from several."""
    out = {f"recall@{k}": recall_at(ids, exact, k) for k in (1, 3, 10)}
    if len(set(sources)) > 1:
        for src in sorted(set(sources)):
            mine = [i for i, s_ in enumerate(sources) if s_ == src]
            out[f"recall@3_{src}"] = recall_at([ids[i] for i in mine], [exact[i] for i in mine], 3)
    return out


def knob_sweep(r, index_type: str, n_queries: int, exact: np.ndarray, values: list[int], seconds: float) -> list:
    """recall@3 against Flat and one-thread QPS of `r` at each nprobe (IVF) or efSearch (HNSW) in `values`."""
    rows = []
    for v in values:
        if r.ivf is not None:
            if v > r.ivf.nlist:
                continue
            r.ivf.nprobe, knob = v, "nprobe"
        else:
            r.faiss_config.hnsw_ef_search, knob = v, "ef_search"
        ids = r.search_ids([str(i) for i in range(n_queries)], 3)[0]
        rows.append({"type": index_type, "knob": knob, "value": v, "recall@3": recall_at(ids, exact, 3),
                     "qps_1": qps(r, n_queries, 1, seconds)})
    return rows


def grow(x: np.ndarray, n: int, seed: int = 0) -> np.ndarray:
    """n vectors: a seeded sample of x's rows when n <= len(x); else x and n - len(x) more, each a random point on
    the segment from a row of x to one of its 10 nearest rows, normalized. The added ones fill the regions the
    encoded passages occupy (denser neighbourhoods, as a larger corpus of the same kind has), which random vectors
    would not; they are not text, so a figure from them says how recall moves with N, not what a corpus gives."""
    import faiss

    rng = np.random.default_rng(seed)
    if n <= len(x):
        return x[np.sort(rng.choice(len(x), n, replace=False))]
    flat = faiss.IndexFlatIP(x.shape[1])
    flat.add(x)
    nn = flat.search(x, 11)[1]  # (len(x), 11): itself first
    k = n - len(x)
    i = rng.integers(0, len(x), k)
    j = nn[i, rng.integers(1, 11, k)]
    a = rng.random(k, dtype=np.float32)[:, None]
    y = a * x[i] + (1 - a) * x[j]
    return np.concatenate([x, y / np.linalg.norm(y, axis=1, keepdims=True)])


class _Rows:
    """A corpus stand-in of n rows for searches that only need its length."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n


def recall_by_size(x: np.ndarray, q: np.ndarray, sources: np.ndarray, types: list[str], sizes: list[int]) -> list:
    """recall@1/3/10 against Flat of each type at its DEFAULT knobs (what the server uses with no knob flags) on
    corpora of each size in `sizes` (`grow`), the same queries each time: whether the defaults hold their recall
    as the corpus grows. One row per (size, type), with the knobs in force and the build seconds."""
    from megatron_searchr1.search.dense import DenseRetriever, FaissConfig, IndexTooSmall, make_faiss_index

    rows = []
    for n in sizes:
        xs, stub = grow(x, n), _Vectors(q)
        exact = None
        for kind in types:
            try:
                cfg = FaissConfig(index_type=kind).resolve_build(n, xs.shape[1])
            except IndexTooSmall:
                continue
            t0 = time.time()
            index = make_faiss_index(xs.shape[1], cfg)
            if cfg.trained:  # the CLI's sample (DenseRetriever.build)
                index.train(xs[np.sort(np.random.default_rng(0).choice(n, cfg.train_size, replace=False))])
            index.add(xs)
            build_s = time.time() - t0
            r = DenseRetriever(_Rows(n), index, stub, cfg, vectors=xs if cfg.effective_refine() else None)
            ids = r.search_ids([str(i) for i in range(len(q))], 10)[0]
            if exact is None:
                if kind != "flat":
                    raise UsageError("--types must start with flat (the reference for recall)")
                exact = ids
            row = {"docs": n, "type": kind, **r.search_knobs(), "build_s": build_s, "load_avg": os.getloadavg()[0],
                   **recalls(ids, exact, sources)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            del index, r
    srcs = sorted({k[len("recall@3_"):] for r in rows for k in r if k.startswith("recall@3_")})
    print("\n| passages | type | knobs in force | R@1 | R@3 | R@10 |" + "".join(f" R@3 {s} |" for s in srcs)
          + " build s | load avg |\n|---|---|---|---|---|---|" + "---|" * len(srcs) + "---|---|")
    for r in rows:
        knobs = ", ".join(([f"nprobe {r['nprobe']} of {r['nlist']}"] if r.get("nlist") else [])
                          + ([f"efSearch {r['ef_search']}"] if r.get("ef_search") else [])
                          + ([f"refine x{r['refine_k_factor']}"] if r.get("refine_k_factor") else []))
        print(f"| {r['docs']:,} | {r['type']} | {knobs or 'none'} | {r['recall@1']:.3f} | {r['recall@3']:.3f} | "
              f"{r['recall@10']:.3f} |" + "".join(f" {r['recall@3_' + s]:.3f} |" for s in srcs)
              + f" {r['build_s']:.1f} | {r['load_avg']:.1f} |")
    return rows


def served(index_dir: str, flags: list[str], clients: int, seconds: float, threads: int,
           questions: list[str]) -> dict:
    """The real server over `index_dir` (a separate process on loopback, query cache off, `threads` CPU threads):
    QPS and p99 latency of 1 and of `clients` HTTP clients each sending fresh one-query requests back to back
    (bench_retrieval's load generator), then the top-10 ids it returns for `questions`, asked in Search-R1's
    shape (`queries` of 16, `topk`, `return_scores`), for recall against the served Flat."""
    import asyncio

    from bench_retrieval import Queries, batches, closed_loop, top_ids

    from megatron_searchr1.search.launch import ServerProcess

    with ServerProcess(["--index-dir", index_dir, "--log-level", "warning", "--query-cache-size", "0",
                        "--torch-threads", str(threads), *flags]) as srv:
        batches(srv.url, Queries(seed=99).fresh, 8, 3, 1.0)  # warm: pages, thread pools
        one = asyncio.run(closed_loop(srv.url, Queries(seed=0), 1, seconds, 3))
        many = asyncio.run(closed_loop(srv.url, Queries(seed=1), clients, seconds, 3))
        ids = top_ids(srv.url, questions, 10)
    return {"served_qps_1": one["qps"], "served_p99_1_s": one["p99"], "served_qps_n": many["qps"],
            "served_p99_n_s": many["p99"], "served_errors": one["errors"] + many["errors"], "served_ids": ids}


def wiki18_gb(index_type: str, bytes_per_doc: float, dim: int, cfg) -> float:
    """Bytes per passage (fixed parts left out) at 768 dims times 21M: per-dimension storage scales by 768/dim;
    PQ codes follow pq_m = dim/4 (also x 768/dim); IVF ids (8 bytes) and HNSW links (8 M bytes) do not scale.
    The quantizers of a 21M-passage IVF (nlist ~18k centroids) add well under 0.1 GB."""
    fixed = 8 if "ivf" in index_type else 8 * cfg.hnsw_m if index_type == "hnsw" else 0
    return ((bytes_per_doc - fixed) * WIKI18_DIM / dim + fixed) * WIKI18_DOCS / 1e9


def fmt_load(load) -> str:
    """The 1, 5 and 15 minute load averages as `uptime` shows them."""
    return " / ".join(f"{v:.1f}" for v in load)


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
                   help=f"comma-separated index types, flat first (the reference), or all: {','.join(TYPES)}")
    p.add_argument("--seconds", type=float, default=3.0, help="per QPS measurement")
    p.add_argument("--torch-threads", type=int, default=0, help="0 = every core")
    p.add_argument("--out", help="also write the rows as JSON here")
    p.add_argument("--corpus", choices=("synthetic", "pydoc", "world", "world+pydoc"), default="synthetic",
                   help="generated passages, real English from this Python's own documentation, the synthetic "
                        "world's passages and questions, or the world and pydoc together")
    p.add_argument("--pydoc", type=int, default=0,
                   help="world+pydoc: pydoc passages among --docs (default 0 = all of them, up to half); the rest "
                        "are the world's. Pydoc passages are ~5x longer, so they set most of the encoding time")
    p.add_argument("--cache-dir", help="keep the corpus, queries and embeddings here (one subfolder per corpus, "
                                       "size and query count); a re-run with the same ones encodes nothing")
    p.add_argument("--first", type=int, default=0,
                   help="measure on the first N passages of the corpus only (0 = all): with --cache-dir, the "
                        "chunks encoded so far of a larger corpus whose encoding has not finished. The queries "
                        "stay the same; recall is against Flat over the same N")
    p.add_argument("--sweep", default="", help="comma-separated knob values: recall@3 and QPS per nprobe (IVF "
                                               "types) and per efSearch (HNSW), e.g. 1,2,4,8,16,32,64,128")
    p.add_argument("--sizes", default="",
                   help="instead of the full table: recall of each type at its default knobs on corpora of these "
                        "sizes (comma-separated; a sample of the encoded passages, or more than were encoded: the "
                        "rest interpolated between encoded neighbours, see grow()), e.g. 2500,5000,10000,20048")
    p.add_argument("--served-clients", type=int, default=0,
                   help="also serve each type with the real server on loopback: QPS of 1 and of this many HTTP "
                        "clients, and recall@3 of its answers against the served Flat's (0 = off)")
    p.add_argument("--served-queries", type=int, default=200,
                   help="--served-clients: how many of the queries (evenly spaced, so every source is in) to ask "
                        "the server for the served recall")
    args = p.parse_args(argv)
    types = list(TYPES) if args.types == "all" else [t for t in args.types.split(",") if t]
    bad = [t for t in types if t not in TYPES]
    if bad:
        raise UsageError(f"--types: unknown {bad}; choose from {','.join(TYPES)}")
    if args.docs < 1 or args.queries < 1 or args.pydoc < 0 or args.first < 0:
        raise UsageError("--docs and --queries must be >= 1, --pydoc and --first >= 0")
    try:
        sweep = [int(v) for v in args.sweep.split(",") if v]
    except ValueError:
        raise UsageError(f"--sweep takes comma-separated integers, got {args.sweep!r}") from None
    try:
        sizes = [int(v) for v in args.sizes.split(",") if v]
    except ValueError:
        raise UsageError(f"--sizes takes comma-separated integers, got {args.sizes!r}") from None
    if any(v < 1 for v in sweep + sizes) or args.served_clients < 0 or args.served_queries < 1:
        raise UsageError("--sweep and --sizes values and --served-queries must be >= 1, --served-clients >= 0")
    import faiss

    from megatron_searchr1.search.corpus import open_corpus
    from megatron_searchr1.search.dense import DenseRetriever, FaissConfig, IndexTooSmall, make_faiss_index
    from megatron_searchr1.search.encoder import Encoder, EncoderConfig, set_cpu_threads

    threads = set_cpu_threads(args.torch_threads or None)
    tmp = tempfile.mkdtemp(prefix="bench_index_")
    cache = None
    if args.cache_dir:
        pydoc = f"-pydoc{args.pydoc}" if args.pydoc and args.corpus == "world+pydoc" else ""
        cache = os.path.join(args.cache_dir, f"{args.corpus}-{args.docs}-{args.queries}{pydoc}")
        os.makedirs(cache, exist_ok=True)
    corpus_path = os.path.join(cache or tmp, "corpus.jsonl")
    queries_path = os.path.join(cache or tmp, "queries.json")
    if not os.path.exists(queries_path):
        pairs = make_bench_corpus(args.corpus, corpus_path + ".tmp", args.docs, args.queries, args.pydoc)
        os.replace(corpus_path + ".tmp", corpus_path)
        with open(queries_path, "w") as f:
            json.dump(pairs, f)
    with open(queries_path) as f:
        pairs = json.load(f)
    questions, sources = [q for q, _ in pairs], np.array([s for _, s in pairs])
    corpus = open_corpus(corpus_path)
    encoder = Encoder(EncoderConfig())
    x, q, encode_s = encode_cached(encoder, corpus, questions, cache, first=args.first or None)
    if len(x) < len(corpus):  # --first: the indexes and the server see only those passages
        with open(corpus_path) as f, open(os.path.join(tmp, "corpus.jsonl"), "w") as out:
            out.writelines(line for _, line in zip(range(len(x)), f))
        corpus_path = os.path.join(tmp, "corpus.jsonl")
        corpus = open_corpus(corpus_path)
    stub = _Vectors(q)
    rng = np.random.default_rng(0)
    load_start = os.getloadavg()
    load = load_start[0]
    counts = ", ".join(f"{k} {int(v)}" for k, v in zip(*np.unique(sources, return_counts=True)))
    print(f"{len(corpus)} {args.corpus} passages, {len(q)} queries ({counts}); "
          f"encoding {encode_s:.1f}s ({threads} threads, load average {load:.1f})", flush=True)
    if sizes:
        rows = recall_by_size(x, q, sources, types, sizes)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"encoded": len(corpus), "corpus": args.corpus, "rows": rows}, f, indent=1)
        return 0
    exact = None
    results, sweeps = [], []
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
        row = {"type": kind, "factory": cfg.factory, **r.search_knobs(), "bytes_per_doc": size / len(corpus), "fixed_bytes": fixed,
               "refine_bytes_per_doc": 2 * x.shape[1] if vectors is not None else 0, "build_s": build_s,
               "qps_1": qps(r, len(q), 1, args.seconds), "qps_32": qps(r, len(q), 32, args.seconds),
               **recalls(ids, exact, sources), "load_avg": os.getloadavg()[0]}
        row["wiki18_ram_gb"] = wiki18_gb(kind, row["bytes_per_doc"], x.shape[1], cfg)
        row["wiki18_refine_disk_gb"] = 2 * WIKI18_DIM * WIKI18_DOCS / 1e9 if vectors is not None else 0.0
        if sweep and (r.ivf is not None or kind == "hnsw"):
            sweeps += knob_sweep(r, kind, len(q), exact[:, :3], sweep, args.seconds)
            r = DenseRetriever(corpus, index, stub, cfg, vectors=vectors)  # the defaults again
        if args.served_clients:
            # The real server over this index file; refine (PQ types) re-scores from the Flat file, as a user
            # with e5_Flat.index would serve it.
            from megatron_searchr1.search.retrievers import register_faiss_index

            register_faiss_index(path, corpus_path, os.path.join(tmp, f"{kind}_dir"))
            flags = ["--refine-flat", os.path.join(tmp, "flat.index"), "--refine-k-factor", str(r.refine)]
            if r.ivf is not None:
                flags += ["--nprobe", str(r.ivf.nprobe)]
            if kind == "hnsw":
                flags += ["--ef-search", str(r.faiss_config.hnsw_ef_search)]
            got = served(os.path.join(tmp, f"{kind}_dir"), flags, args.served_clients, args.seconds, threads,
                         questions[::max(1, len(questions) // args.served_queries)][:args.served_queries])
            served_ids = got.pop("served_ids")
            if kind == "flat":
                served_exact = served_ids
            row.update(got, served_recall3=recall_at(served_ids, served_exact, 3), load_avg=os.getloadavg()[0])
        results.append(row)
        print(json.dumps(row), flush=True)
    flat = DenseRetriever(corpus, faiss.read_index(os.path.join(tmp, "flat.index")), encoder, FaissConfig())
    split = [encode_split(encoder, flat, [f"{s} {b}" for s in questions * 64][: max(256, b)], b) for b in (8, 256)]
    load_end = os.getloadavg()
    n = args.served_clients
    served_head = (f" served QPS 1 (HTTP) | served QPS {n} (HTTP) | served p99 s at {n} | served R@3 |" if n else "")
    srcs = sorted({k[len("recall@3_"):] for r in results for k in r if k.startswith("recall@3_")})
    print(f"\nload average (1, 5, 15 min) at the start of the index stage {fmt_load(load_start)}, at the end "
          f"{fmt_load(load_end)}\n")
    print(f"| type | factory | bytes/passage | build s | index QPS 1 (1 thread) | index QPS 32 (32 threads) |"
          f"{served_head} R@1 | R@3 | R@10 |" + "".join(f" R@3 {s} |" for s in srcs) + " wiki-18 RAM GB | load avg |")
    print("|---|---|---|---|---|---|" + ("---|" * 4 if n else "") + "---|---|---|---|---|" + "---|" * len(srcs))
    for r in results:
        extra = f" (+{r['wiki18_refine_disk_gb']:.0f} GB fp16 on disk, mapped)" if r["wiki18_refine_disk_gb"] else ""
        knobs = ", ".join(([f"nprobe {r['nprobe']} of {r['nlist']}"] if r.get("nlist") else [])
                          + ([f"efSearch {r['ef_search']}"] if r.get("ef_search") else [])
                          + ([f"refine x{r['refine_k_factor']}"] if r.get("refine_k_factor") else []))
        cells = (f" {r['served_qps_1']:.1f} | {r['served_qps_n']:.1f} | {r['served_p99_n_s']:.2f} | "
                 f"{r['served_recall3']:.3f} |" if n else "")
        print(f"| {r['type']}{f' ({knobs})' if knobs else ''} | `{r['factory']}` | {r['bytes_per_doc']:.0f} | "
              f"{r['build_s']:.1f} | {r['qps_1']:.0f} | {r['qps_32']:.0f} |{cells} {r['recall@1']:.3f} | "
              f"{r['recall@3']:.3f} | {r['recall@10']:.3f} |" + "".join(f" {r['recall@3_' + s]:.3f} |" for s in srcs)
              + f" {r['wiki18_ram_gb']:.1f}{extra} | {r['load_avg']:.1f} |")
    if sweeps:
        print("\n| type | knob | value | R@3 | QPS 1 |\n|---|---|---|---|---|")
        for s in sweeps:
            print(f"| {s['type']} | {s['knob']} | {s['value']} | {s['recall@3']:.3f} | {s['qps_1']:.0f} |")
    print("\n| batch | encode s | search s (flat) | render s |\n|---|---|---|---|")
    for s in split:
        print(f"| {s['batch']} | {s['encode_s']:.3f} | {s['search_s']:.4f} | {s['render_s']:.4f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"docs": len(corpus), "corpus": args.corpus, "dim": int(x.shape[1]), "encode_s": encode_s,
                       "load_avg_start": load_start, "load_avg_end": load_end, "threads": threads,
                       "queries_by_source": {
                           str(k): int(v) for k, v in zip(*np.unique(sources, return_counts=True))},
                       "rows": results, "sweeps": sweeps, "split": split}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
