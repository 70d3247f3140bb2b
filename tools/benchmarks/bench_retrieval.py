# python tools/benchmarks/bench_retrieval.py                 (2,000 generated passages, dense MiniLM, ~5 min on 2 cores)
# python tools/benchmarks/bench_retrieval.py --docs 20000 --seconds 10 --torch-threads 2
# python tools/benchmarks/bench_retrieval.py --skip-build --skip-baseline --index-types flat,sq6   (ours only, Flat
#     against a compressed type built from the Flat file's vectors: 1 and 32 clients, top-3 agreement)
"""Our retrieval server against a Search-R1-style baseline on the same faiss index, side by side, with ratios.

The baseline is written here to do what Search-R1's retrieval_server.py does per request (its code cannot serve on
a CPU: it moves inputs to CUDA unconditionally): a synchronous FastAPI endpoint, run on FastAPI's thread pool, that
tokenizes the request's queries padded to the longest, encodes them, searches faiss and builds the documents; and
a baseline index build that does what its index_builder.py does (batches of 512 in corpus order, padded to the
longest, tokenized then encoded). Both servers are separate processes with the same CPU thread budget.

Modes (the last two are the workload of an RL step: GRPO sends n=5 samples of each question, so a turn's batch
repeats its queries; the `distinct` rows have no repeats at all):
  1 client sending 1-query requests; 32 (--concurrency) clients sending 1-query requests (QPS, p99 latency);
  1 client sending 16- and 64-query requests, distinct and GRPO-repeated.
Every query of a run is new to the server (no cross-request cache hits), except where a row says so. The 1-query
modes send over plain kept-alive HTTP/1.1 connections (`Connection`), not httpx, whose own CPU and queueing were
most of the latency it reported.

--index-types adds, beside Flat, each compressed type built from the Flat index's vectors (`--from-flat`, no second
encoding) and served by our server with its defaults (refine from the Flat file for the lossy types), measured on the
1- and 32-client modes with the same queries, plus how many of 400 queries get Flat's exact top-k from it.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import numpy as np

from megatron_searchr1.cli import ArgumentParser, UsageError, above, at_least, run_main

_WORDS = ("baker astronomer carpenter violinist surgeon beekeeper pilot glassblower librarian fisherman architect "
          "chemist Lisbon Nairobi Oslo Kyoto Lima Cairo Toronto Sydney Warsaw Hanoi chess surfing pottery "
          "birdwatching knitting climbing origami sailing gardening fencing").split()
_SYL = ["ka", "lo", "mi", "ra", "ven", "tor", "zel", "dri", "os", "bel", "qua", "fin"]
_FILLER = ["The family moved several times during the early years.", "Neighbours remember long walks by the river.",
           "A small museum now keeps letters and photographs from that period.",
           "Local newspapers wrote about the work more than once.", "Friends describe a patient and curious person.",
           "Later projects took the work abroad for a few seasons."]


def make_corpus(path: str, n: int, seed: int = 0) -> None:
    """n invented-people passages of 1-7 sentences (varied lengths, as real corpora have)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            name = "".join(rng.choice(_SYL) for _ in range(3)).capitalize() + f" {i}"
            a, b, c = rng.sample(_WORDS, 3)
            extra = " ".join(rng.choice(_FILLER) for _ in range(rng.randint(0, 6)))
            f.write(json.dumps({"id": str(i), "contents": f'"{name}"\n{name} is a {a} from {b} who loves {c}. '
                                                          f"{name} was born in {1800 + i % 200}. {extra}"}) + "\n")


class Queries:
    """Fresh queries on demand (none repeats unless asked to), so the server's cache only helps where it should."""

    def __init__(self, seed: int = 1):
        self.rng, self.i = random.Random(seed), 0

    def fresh(self, k: int) -> list[str]:
        out = []
        for _ in range(k):
            a, b, c = self.rng.sample(_WORDS, 3)
            out.append(f"which {a} from {b} loves {c} and was born in {1800 + self.i % 200} (case {self.i})")
            self.i += 1
        return out

    def grpo(self, k: int, n: int = 5) -> list[str]:
        """k queries made of k/n fresh questions, each asked n times (GRPO's samples), shuffled."""
        qs = [q for q in self.fresh(max(1, k // n)) for _ in range(n)][:k]
        qs += self.fresh(k - len(qs))
        self.rng.shuffle(qs)
        return qs


# ---- the Search-R1-style baseline ------------------------------------------------------------------------------

def baseline_server(index_dir: str, port_file: str) -> None:
    """Serve /retrieve the way Search-R1's server does: one request = tokenize, encode, search, on a worker thread."""
    import threading

    import faiss
    import torch
    import uvicorn
    from fastapi import FastAPI
    from transformers import AutoModel, AutoTokenizer

    from megatron_searchr1.search.corpus import open_corpus
    from megatron_searchr1.search.encoder import pool, resolve_model_dir
    from megatron_searchr1.search.retrievers import read_index_meta
    from megatron_searchr1.search.server import bind_socket

    meta = read_index_meta(index_dir)
    enc = meta["dense"]["encoder"]
    corpus = open_corpus(os.path.join(index_dir, meta["corpus"]) if not os.path.isabs(meta["corpus"])
                         else meta["corpus"])
    index = faiss.read_index(os.path.join(index_dir, meta["dense"]["faiss_index"]))
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(enc["model"]))
    model = AutoModel.from_pretrained(resolve_model_dir(enc["model"])).eval()
    tok_lock = threading.Lock()  # its shared tokenizer fails ("Already borrowed") when two threads use it at once
    app = FastAPI()

    @app.post("/retrieve")
    def retrieve(body: dict):  # sync: FastAPI runs it on its thread pool, several requests at once
        queries, topk = body["queries"], body.get("topk") or 3
        with tok_lock:
            inputs = tokenizer([enc["query_prefix"] + q for q in queries], max_length=enc["max_length"],
                               padding=True, truncation=True, return_tensors="pt")
        with torch.no_grad():
            out = model(**inputs, return_dict=True)
            emb = torch.nn.functional.normalize(pool(out.last_hidden_state, inputs["attention_mask"], "mean"), dim=-1)
        scores, idxs = index.search(emb.numpy().astype(np.float32), k=topk)
        result = [[{"document": corpus[int(i)], "score": float(s)} for i, s in zip(row_i, row_s)]
                  for row_i, row_s in zip(idxs, scores)]
        return {"result": result}

    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    with open(port_file, "w") as f:
        f.write(str(sock.getsockname()[1]))
    server.run(sockets=[sock])


class BaselineProcess:
    def __init__(self, index_dir: str, threads: int):
        self.index_dir, self.threads = index_dir, threads

    def __enter__(self):
        fd, self.port_file = tempfile.mkstemp()
        os.close(fd)
        os.unlink(self.port_file)
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads)}
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve-baseline", self.index_dir, self.port_file],
                                     env=env)
        deadline = time.time() + 180
        while not os.path.exists(self.port_file):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("baseline server did not start")
            time.sleep(0.2)
        time.sleep(0.5)
        self.url = f"http://127.0.0.1:{open(self.port_file).read()}"
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(timeout=30)
        os.unlink(self.port_file)


# ---- load generators -------------------------------------------------------------------------------------------

class Connection:
    """One kept-alive HTTP/1.1 connection that POSTs JSON and reads the response by its Content-Length (what both
    servers, uvicorn, send): the load generator of the 1-query modes.

    Why not httpx here: at 32 clients its AsyncClient, not the server, was the bottleneck (its CPU per request and
    the wait inside the client dominated the latency; the instrumented figures are in NOTES-retrieval-server.md).
    This client is a small fraction of that per request; both servers are measured with it.
    """

    def __init__(self, url: str):
        host, port = url.split("://", 1)[1].rstrip("/").rsplit(":", 1)
        self.host, self.port = host.strip("[]"), int(port)
        self.reader = self.writer = None

    async def post(self, path: str, payload: dict) -> tuple[int, bytes]:
        """(status, body) of one POST; the connection stays open for the next."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        body = json.dumps(payload).encode()
        self.writer.write(f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/json\r\n"
                          f"content-length: {len(body)}\r\n\r\n".encode() + body)
        head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
        status = int(head.split(" ", 2)[1])
        length = [line.split(":", 1)[1] for line in head.split("\r\n") if line.startswith("content-length:")]
        if not length:
            raise RuntimeError(f"response without content-length: {head!r}")
        return status, await self.reader.readexactly(int(length[0]))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def closed_loop(url: str, queries: Queries, clients: int, seconds: float, topk: int) -> dict:
    """`clients` concurrent clients, each sending one fresh 1-query request after the other until time is up."""
    latencies, errors = [], 0
    deadline = time.perf_counter() + seconds
    connections = [Connection(url) for _ in range(clients)]

    async def worker(conn: Connection):
        nonlocal errors
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            status, _ = await conn.post("/retrieve", {"queries": queries.fresh(1), "topk": topk, "return_scores": True})
            if status == 200:
                latencies.append(time.perf_counter() - t0)
            else:
                errors += 1

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(worker(c) for c in connections))
    finally:
        for c in connections:
            c.close()
    wall = time.perf_counter() - t0
    lat = np.array(latencies)
    return {"qps": len(latencies) / wall, "p99": float(np.percentile(lat, 99)) if lat.size else float("nan"),
            "errors": errors}


def batches(url: str, make, batch: int, topk: int, seconds: float) -> dict:
    """One client sending `make(batch)` queries per request back to back: queries per second."""
    import httpx

    n, errors = 0, 0
    with httpx.Client(timeout=300) as client:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds or n < 2:
            r = client.post(f"{url}/retrieve", json={"queries": make(batch), "topk": topk, "return_scores": True})
            errors += r.status_code != 200
            n += 1
        wall = time.perf_counter() - t0
    return {"qps": n * batch / wall, "p99": float("nan"), "errors": errors}


def top_ids(url: str, queries: list[str], topk: int) -> list[list[str]]:
    """The ids each server returns for the same queries, sent 16 at a time (to compare the two servers)."""
    import httpx

    out = []
    for s in range(0, len(queries), 16):
        r = httpx.post(f"{url}/retrieve", json={"queries": queries[s:s + 16], "topk": topk, "return_scores": True},
                       timeout=120)
        r.raise_for_status()
        out += [[hit["document"]["id"] for hit in row] for row in r.json()["result"]]
    return out


def health(url: str) -> dict:
    import httpx

    return httpx.get(f"{url}/health", timeout=10).json()


# ---- index build -----------------------------------------------------------------------------------------------

def baseline_build(corpus_path: str, threads: int, batch_size: int = 512) -> tuple[float, np.ndarray]:
    """index_builder.py's encode_all on the CPU: corpus order, batches of 512 padded to the longest."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from megatron_searchr1.search.encoder import PACKAGED_MINILM, pool, resolve_model_dir

    torch.set_num_threads(threads)
    texts = [json.loads(line)["contents"] for line in open(corpus_path)]
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(PACKAGED_MINILM))
    model = AutoModel.from_pretrained(resolve_model_dir(PACKAGED_MINILM)).eval()
    t0 = time.perf_counter()
    out = []
    with torch.no_grad():
        for s in range(0, len(texts), batch_size):
            inputs = tokenizer(texts[s:s + batch_size], padding=True, truncation=True, max_length=256,
                               return_tensors="pt")
            h = model(**inputs, return_dict=True).last_hidden_state
            out.append(torch.nn.functional.normalize(pool(h, inputs["attention_mask"], "mean"), dim=-1).numpy())
    return time.perf_counter() - t0, np.concatenate(out)


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=at_least(10), default=2000, help="generated passages")
    p.add_argument("--seconds", type=above(0), default=6.0, help="per measurement")
    p.add_argument("--topk", type=at_least(1), default=3)
    p.add_argument("--concurrency", type=at_least(1), default=32,
                   help="clients of the concurrent 1-query mode (each waits for its answer before the next request)")
    p.add_argument("--torch-threads", type=at_least(1), default=None, help="CPU threads of both servers (default: all)")
    p.add_argument("--skip-build", action="store_true", help="no index build comparison")
    p.add_argument("--skip-baseline", action="store_true",
                   help="our server only (no Search-R1-style baseline), on the 1- and N-client modes only")
    p.add_argument("--index-types", default="flat",
                   help="flat, then compressed types our server also serves (1 and 32 clients), e.g. flat,sq6")
    args = p.parse_args(argv)
    types = [t for t in args.index_types.split(",") if t]
    from megatron_searchr1.search.dense import FACTORY

    if not types or types[0] != "flat" or set(types) - set(FACTORY):
        raise UsageError(f"--index-types: flat first, then any of {','.join(FACTORY)}; got {args.index_types!r}")
    if args.topk > args.docs:
        raise UsageError(f"--topk {args.topk} is more than --docs {args.docs}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from megatron_searchr1.search.encoder import available_cores, set_cpu_threads
    from megatron_searchr1.search.launch import ServerProcess
    from megatron_searchr1.search.retrievers import index_corpus

    threads = args.torch_threads or available_cores()
    set_cpu_threads(threads)
    print(f"machine: {os.cpu_count()} CPUs ({available_cores()} usable), {threads} threads per server; "
          f"{args.docs} passages, MiniLM, faiss Flat, top-{args.topk}")
    with tempfile.TemporaryDirectory(prefix="bench_retrieval_") as tmp:
        corpus = os.path.join(tmp, "corpus.jsonl")
        make_corpus(corpus, args.docs)
        t0 = time.perf_counter()
        ours = index_corpus(corpus, os.path.join(tmp, "dense"), kind="dense", show_progress=False)
        build_ours = time.perf_counter() - t0
        if not args.skip_build:
            build_base, emb = baseline_build(corpus, threads)
            diff = float(np.abs(ours.cpu_index.reconstruct_n(0, args.docs) - emb).max())
            print(f"\nindex build: baseline {build_base:.1f}s, ours {build_ours:.1f}s "
                  f"({build_base / build_ours:.2f}x; ours includes reading the corpus and writing the index); "
                  f"embeddings differ by at most {diff:.1e}")
        del ours
        server_flags = ["--index-dir", os.path.join(tmp, "dense"), "--log-level", "warning",
                        "--torch-threads", str(threads)]
        rows = [("1 client, 1-query requests", lambda url, q: asyncio.run(closed_loop(url, q, 1, args.seconds, args.topk))),
                (f"{args.concurrency} clients, 1-query requests",
                 lambda url, q: asyncio.run(closed_loop(url, q, args.concurrency, args.seconds, args.topk)))]
        for b in (16, 64):
            rows.append((f"1 client, {b}-query requests, GRPO n=5 repeats",
                         lambda url, q, b=b: batches(url, q.grpo, b, args.topk, args.seconds)))
            rows.append((f"1 client, {b}-query requests, distinct",
                         lambda url, q, b=b: batches(url, q.fresh, b, args.topk, args.seconds)))
        results = {}
        servers = [("baseline", lambda: BaselineProcess(os.path.join(tmp, "dense"), threads), rows),
                   ("ours", lambda: ServerProcess(server_flags), rows[:2] if args.skip_baseline else rows)]
        for t in types[1:]:
            out = os.path.join(tmp, t)
            index_corpus(corpus, out, kind="dense", index_type=t, show_progress=False,
                         from_flat=os.path.join(tmp, "dense", "dense.index"))
            flags = ["--index-dir", out, "--log-level", "warning", "--torch-threads", str(threads)]
            servers.append((f"ours {t}", lambda flags=flags: ServerProcess(flags), rows[:2]))
        for name, server, modes in servers[1 if args.skip_baseline else 0:]:
            with server() as srv:
                warm = Queries(seed=99)
                batches(srv.url, warm.fresh, 8, args.topk, 1.0)  # load pages, JIT paths, thread pools
                for i, (label, fn) in enumerate(modes):  # the same queries for every server
                    results[(name, label)] = fn(srv.url, Queries(seed=i))
                if name != "ours":
                    results[(name, "health")] = health(srv.url).get("search", {})
                results[(name, "ids")] = top_ids(srv.url, Queries(seed=len(rows)).fresh(400), args.topk)
                if name == "ours":
                    results["health"] = health(srv.url)
        fmt = lambda r: f"{r['qps']:.1f} q/s" + (f", p99 {r['p99']:.2f} s" if r["p99"] == r["p99"] else "") + \
            (f", {r['errors']} errors" if r["errors"] else "")
        print(f"\nload average {os.getloadavg()[0]:.1f} (1 min) at the end of the run")
        if not args.skip_baseline:
            print("\n| mode | Search-R1-style baseline | ours | ours / baseline |\n|---|---|---|---|")
            for label, _ in rows:
                b, o = results[("baseline", label)], results[("ours", label)]
                print(f"| {label} | {fmt(b)} | {fmt(o)} | {o['qps'] / b['qps']:.2f}x |")
            same = sum(b == o for b, o in zip(results[("baseline", "ids")], results[("ours", "ids")]))
            print(f"\ntop-{args.topk} ids identical for {same} of {len(results[('ours', 'ids')])} queries")
        print(f"our encoder ran on {results['health'].get('encoder_backend', '?')}; our query-embedding cache hit "
              f"rate over the whole run (in-batch repeats included): {results['health']['query_cache']['hit_rate']:.1%}")
        if len(types) > 1:
            print("\n| mode | ours, flat |" + "".join(f" ours, {t} | {t} / flat |" for t in types[1:]))
            print("|---|---|" + "---|---|" * (len(types) - 1))
            for label, _ in rows[:2]:
                o = results[("ours", label)]
                print(f"| {label} | {fmt(o)} |" + "".join(
                    f" {fmt(results[(f'ours {t}', label)])} | {results[(f'ours {t}', label)]['qps'] / o['qps']:.2f}x |"
                    for t in types[1:]))
            for t in types[1:]:
                ids = results[(f"ours {t}", "ids")]
                same = sum(a == b for a, b in zip(ids, results[("ours", "ids")]))
                overlap = np.mean([len(set(a) & set(b)) / args.topk for a, b in zip(ids, results[("ours", "ids")])])
                print(f"{t} ({results[(f'ours {t}', 'health')].get('factory', '?')}, refine "
                      f"{results[(f'ours {t}', 'health')].get('refine_k_factor', 0)}): Flat's exact top-{args.topk} "
                      f"for {same} of {len(ids)} queries, recall@{args.topk} against Flat {overlap:.3f}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--serve-baseline":
        baseline_server(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(run_main(main))
