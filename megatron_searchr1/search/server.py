r"""The retrieval server: Search-R1's `POST /retrieve` over any of our retrievers, plus `GET /health`.

    python -m megatron_searchr1.search.server --index-dir /data/index --host 127.0.0.1 --port 8000
    python -m megatron_searchr1.search.server --faiss-index e5_Flat.index --corpus wiki-18.jsonl \
        --encoder /models/e5-base-v2 --port 8000        # an existing Search-R1 index, unchanged
    python -m megatron_searchr1.search.server --index-dir D --torch-threads 2   # beside a trainer: a thread budget

Request (Search-R1's):  {"queries": ["q1", ...], "topk": 3, "return_scores": true}
Response:  return_scores true  -> {"result": [[{"document": {"id": ..., "contents": ...}, "score": f}, ...], ...]}
           return_scores false -> {"result": [[{"id": ..., "contents": ...}, ...], ...]}
(Search-R1's own server crashes on return_scores=false; ours answers with the plain list of documents.)

A drop-in for Search-R1's trainer, which talks to it unchanged: `{"queries": []}` (a turn in which no sample
searched) answers `{"result": []}`; one request may carry a whole RL batch (train_batch_size 512 x n_agent 5 =
2,560 queries; the default limit is 4,096); `topk` is read as Search-R1's pydantic model reads it ("3" and 3.0 are 3;
0 or null mean the default), `return_scores` likewise (true/false, 1/0, "true"/"false").
Bad input gets a 4xx whose `detail` says what is wrong and what the limit is; the server stays up. A body over
`max_body_bytes` gets 413 before it is read. When more than `max_pending_queries` queries wait already, a request
gets 429 with Retry-After instead of growing the queue without bound. A search that runs past
`search_timeout_s` fails its requests with 503 and turns /health to 503 "stalled" until it finishes.

Requests that arrive together (each within `batch_window_ms` of the one before, for at most `batch_max_wait_ms`)
are searched together in one encoder/faiss call (micro-batching), on a single worker thread so the event loop keeps accepting requests meanwhile; that thread
also builds the response documents and JSON, off the event loop. Repeated queries are encoded once (deduplicated
per batch, and a bounded LRU of query embeddings; /health reports its hit rate). What a query was batched with does
not change its results beyond float rounding: BM25 scores are per query, and a dense embedding moves by ~1e-7 with
the padding of its batch (ties in score break by row number); a cached query's embedding is reused as computed,
so repeats give identical results.
"""
from __future__ import annotations

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
from fastapi.responses import JSONResponse, Response

from megatron_searchr1.cli import ArgumentParser, UsageError, at_least, console, run_main
from megatron_searchr1.search.base import Retriever
from megatron_searchr1.search.encoder import add_encoder_args, encoder_args_problem, encoder_options

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
    max_queries: int = 4096
    """Most queries one request may carry; Search-R1's trainer sends a whole batch (512 x 5 = 2,560) in one POST."""
    max_topk: int = 100
    """Largest topk a request may ask for."""
    max_query_chars: int = 4096
    """Longest query accepted, in characters (the encoder truncates at max_length tokens anyway)."""
    batch_window_ms: float = 5.0
    """A micro-batch (of concurrent requests) closes once no request joined it for this long; 0 = no waiting."""
    batch_max_wait_ms: float = 50.0
    """...or this long after its first request arrived, however many keep joining (at least batch_window_ms)."""
    max_batch_queries: int = 4096
    """A micro-batch stops growing at this many queries."""
    max_pending_queries: int = 16384
    """Most queries waiting or being searched at once; a request that would exceed it gets 429 (retry later)."""
    max_body_bytes: int = 64 * 1024 * 1024
    """Largest request body; a bigger one gets 413 before it is read (Content-Length) or as soon as it passes."""
    search_timeout_s: float = 300.0
    """A micro-batch's search that runs longer fails its requests with 503 and marks /health stalled; 0 = none."""

    def __post_init__(self):
        for name in ("default_topk", "max_queries", "max_topk", "max_query_chars", "max_batch_queries",
                     "max_pending_queries", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_window_ms < 0 or self.batch_max_wait_ms < 0 or self.search_timeout_s < 0:
            raise ValueError(f"ServerConfig.batch_window_ms, batch_max_wait_ms and search_timeout_s must be >= 0, "
                             f"got {self.batch_window_ms}, {self.batch_max_wait_ms}, {self.search_timeout_s}")
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
    if len(queries) > config.max_queries:
        raise RequestError(413, f"too many queries: {len(queries)} in one request, the limit is "
                                f"{config.max_queries} (the server's --max-queries); split the batch")
    for i, q in enumerate(queries):
        if not isinstance(q, str):
            raise RequestError(422, f"queries[{i}] must be a string, got {type(q).__name__}")
        if len(q) > config.max_query_chars:
            raise RequestError(413, f"queries[{i}] is {len(q)} characters long, the limit is "
                                    f"{config.max_query_chars}; shorten it")
    topk = _lax_int(payload.get("topk"))
    if topk is None:
        raise RequestError(422, f"'topk' must be an integer, got {type(payload['topk']).__name__} "
                                f"{payload['topk']!r}")
    if topk == 0:  # absent, null or 0: Search-R1 falls back to its default on any falsy topk
        topk = config.default_topk
    if topk < 1:
        raise RequestError(422, f"'topk' must be >= 1, got {topk}")
    if topk > config.max_topk:
        raise RequestError(422, f"'topk' is {topk}, the limit is {config.max_topk}")
    return_scores = _lax_bool(payload.get("return_scores"))
    if return_scores is None:
        raise RequestError(422, f"'return_scores' must be true or false, got {payload['return_scores']!r}")
    return queries, topk, return_scores


def _lax_int(value) -> int | None:
    """An integer as pydantic's lax mode reads one (Search-R1's `topk: Optional[int]`): 3, 3.0 and "3" are 3;
    null is 0 (= the default). None for anything else (2.5, "three", true, a list).

    >>> [_lax_int(v) for v in (3, 3.0, "3", " 4 ", None, 2.5, "x", True)]
    [3, 3, 3, 4, 0, None, None, None]
    """
    if value is None:
        return 0
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return None
    return None


_TRUE = {"true", "1", "yes", "y", "on", "t"}
_FALSE = {"false", "0", "no", "n", "off", "f"}


def _lax_bool(value) -> bool | None:
    """A boolean as pydantic's lax mode reads one (Search-R1's `return_scores: bool`); null/absent is false.

    >>> [_lax_bool(v) for v in (True, 0, 1, "true", "False", None, "maybe", 2)]
    [True, False, True, True, False, False, None, None]
    """
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    return None


@dataclass
class _Pending:
    queries: list[str]
    topk: int
    return_scores: bool
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
    timed_out_requests: int = 0
    pending_queries: int = 0
    started: float = field(default_factory=time.time)

    def as_dict(self) -> dict:
        return {"requests": self.requests, "queries": self.queries, "batches": self.batches,
                "mean_batch_queries": round(self.queries / self.batches, 2) if self.batches else 0.0,
                "largest_batch": self.largest_batch, "search_seconds": round(self.search_seconds, 3),
                "pending_queries": self.pending_queries, "rejected_overloaded": self.rejected_overloaded,
                "skipped_disconnected": self.skipped_disconnected, "timed_out_requests": self.timed_out_requests,
                "uptime_s": round(time.time() - self.started, 1)}


class SearchTimeout(Exception):
    """A micro-batch's search ran past `search_timeout_s` (its requests get 503)."""


class MicroBatcher:
    """Collects concurrent requests for `window_s` and runs them as one `search_ids` call on one worker thread,
    which also renders each request's response body (`render(ids, scores, return_scores) -> bytes`).

    Rendering there, not on a pool beside it: on a small machine a render thread running while the next batch
    encodes takes a core from the encoder and the GIL from the event loop; done right after the search, every
    response of a batch is ready at once, and the next batch starts only after they were handed to the event loop
    to write, so the clients they answer can join it.

    timeout_s: how long one search call may run before its requests fail with SearchTimeout (0 = no limit). The
    call itself cannot be interrupted (torch and faiss do not check for cancellation): until it returns the batcher
    is `stalled_since` that time, which /health reports, and the batches behind it time out as well.
    """

    def __init__(self, retriever: Retriever, window_s: float, max_batch_queries: int, timeout_s: float = 0.0,
                 render: Callable[[np.ndarray, np.ndarray, bool], bytes] | None = None, max_wait_s: float | None = None):
        self.retriever, self.window_s, self.max_batch_queries = retriever, window_s, max_batch_queries
        self.max_wait_s = window_s if max_wait_s is None else max(max_wait_s, window_s)
        self.render = render or (lambda ids, scores, return_scores:
                                 render_result(retriever.corpus, ids, scores, return_scores))
        self.timeout_s = timeout_s
        self.stalled_since: float | None = None
        self._overdue = 0  # timed-out searches still running on the worker thread
        self._concurrent = True  # requests arrived together lately: worth waiting for the window
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

    async def submit(self, queries: list[str], topk: int, return_scores: bool = True,
                     client_gone: Callable[[], Awaitable[bool]] | None = None) -> bytes:
        """The response body for one request, searched together with its neighbours."""
        future = asyncio.get_running_loop().create_future()
        self.stats.requests += 1
        self.stats.pending_queries += len(queries)  # all on the event loop thread: no lock needed
        try:
            await self._queue.put(_Pending(queries, topk, return_scores, future, time.perf_counter(), client_gone))
            return await future
        finally:
            self.stats.pending_queries -= len(queries)

    async def _loop(self) -> None:
        while True:
            batch = [await self._queue.get()]
            n = len(batch[0].queries)
            # Wait for company only when requests have been arriving together: a lone client sending one request
            # at a time would pay the window on every request and gain nothing. The batch closes once no request
            # has joined it for the window, or max_wait after its first one: many clients answered by the last
            # batch send their next requests one after another (each takes the client some CPU), and a batch
            # started on the first few would take the cores from the clients still sending, leaving the rest
            # for a later batch. (That was measured with httpx's AsyncClient as the load generator, which lets
            # requests out in a trickle: most batches had one query. Clients that resend promptly make 31-query
            # batches at 32 clients either way: 265-296 q/s with this policy, 270-274 with a fixed 5 ms window.)
            deadline = batch[0].arrived + self.max_wait_s
            while True:
                while n < self.max_batch_queries and not self._queue.empty():
                    item = self._queue.get_nowait()
                    batch.append(item)
                    n += len(item.queries)
                wake = min(batch[-1].arrived + self.window_s, deadline)
                now = time.perf_counter()
                if not self._concurrent or n >= self.max_batch_queries or wake <= now:
                    break
                await asyncio.sleep(wake - now)
            # concurrency seen: this batch joined several requests, or more arrived while it was collected
            self._concurrent = len(batch) > 1 or not self._queue.empty()
            try:
                await self._run(batch)
            except Exception as e:  # noqa: BLE001 - a bug here must not kill the loop and hang every later request
                logger.exception("micro-batcher failed on a batch of %d requests", len(batch))
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(e)
            # Let the handlers whose futures were just set write their responses before the next batch is
            # collected: their clients' next requests should find the window open, not a batch already running.
            await asyncio.sleep(0)

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
            call = loop.run_in_executor(self._executor, self._search_and_render, queries, topk,
                                        [(len(p.queries), p.return_scores) for p in items])
            try:
                bodies = await asyncio.wait_for(asyncio.shield(call), self.timeout_s or None)
            except asyncio.TimeoutError:
                self._stall(call)
                logger.error("search of %d queries still running after %.0fs: failing its %d request(s) with 503",
                             len(queries), self.timeout_s, len(items))
                for p in items:
                    self.stats.timed_out_requests += 1
                    if not p.future.done():
                        p.future.set_exception(SearchTimeout(
                            f"search did not finish within {self.timeout_s:g}s (server --search-timeout-s)"))
                continue
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
            for p, body in zip(items, bodies):
                if p.future.done():
                    continue
                if isinstance(body, Exception):
                    p.future.set_exception(body)
                else:
                    p.future.set_result(body)

    def _search_and_render(self, queries: list[str], topk: int,
                           requests: list[tuple[int, bool]]) -> list[bytes | Exception]:
        """On the worker thread: one search for all `queries`, then each request's body ((count, return_scores)
        per request, in order). A request whose rendering fails gets its exception, not its neighbours."""
        ids, scores = self.retriever.search_ids(queries, topk)
        bodies, start = [], 0
        for count, return_scores in requests:
            try:
                bodies.append(self.render(ids[start:start + count], scores[start:start + count], return_scores))
            except Exception as e:  # noqa: BLE001 - reported to that request as a 500
                logger.exception("rendering a response of %d queries failed", count)
                bodies.append(e)
            start += count
        return bodies


    def _stall(self, call: asyncio.Future) -> None:
        """Mark the batcher stalled until `call` (a search that timed out) and any other timed-out one return."""
        self._overdue += 1
        if self.stalled_since is None:
            self.stalled_since = time.time()

        def finished(_):
            self._overdue -= 1
            if self._overdue == 0:
                self.stalled_since = None

        call.add_done_callback(finished)


def _response_doc(doc: dict) -> dict:
    return {"id": doc["id"], "contents": doc["contents"]}


def render_result(corpus, ids: np.ndarray, scores: np.ndarray, return_scores: bool) -> bytes:
    """The /retrieve response body for (B, k) row ids and scores, as JSON bytes (run off the event loop: for a
    2,560-query batch the documents and the JSON take as long as a MiniLM search)."""
    result = []
    for row_ids, row_scores in zip(ids, scores):
        docs = [(_response_doc(corpus[int(i)]), float(s)) for i, s in zip(row_ids, row_scores) if i >= 0]
        result.append([{"document": d, "score": s} for d, s in docs] if return_scores else [d for d, _ in docs])
    # the same bytes as FastAPI's JSONResponse
    return json.dumps({"result": result}, ensure_ascii=False, allow_nan=False, indent=None,
                      separators=(",", ":")).encode("utf-8")


def create_app(retriever: Retriever, config: ServerConfig | None = None, on_ready=None, on_stop=None):
    """The FastAPI app serving `retriever`. Start it with uvicorn (see `main` and `BackgroundServer`).

    on_ready: called once the micro-batcher runs, i.e. when requests can be served; on_stop: after shutdown.
    """
    config = config or ServerConfig()
    # The batcher's worker thread renders the responses, off the event loop (which keeps accepting requests).
    batcher = MicroBatcher(retriever, config.batch_window_ms / 1000.0, config.max_batch_queries,
                           config.search_timeout_s, max_wait_s=config.batch_max_wait_ms / 1000.0)

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
        stalled = batcher.stalled_since
        body = {"status": "ok" if stalled is None else "stalled", **retriever.describe(),
                "limits": {"max_queries": config.max_queries, "max_topk": config.max_topk,
                           "max_pending_queries": config.max_pending_queries,
                           "max_query_chars": config.max_query_chars, "default_topk": config.default_topk,
                           "max_body_bytes": config.max_body_bytes, "search_timeout_s": config.search_timeout_s},
                "batching": {"window_ms": config.batch_window_ms, "max_wait_ms": config.batch_max_wait_ms,
                             **batcher.stats.as_dict()}}
        if stalled is not None:
            body["stalled_seconds"] = round(time.time() - stalled, 1)
            return JSONResponse(body, status_code=503)
        return body

    def too_big(size: str) -> JSONResponse:
        return JSONResponse({"detail": f"request body is {size} bytes, the limit is {config.max_body_bytes} "
                                       f"(server --max-body-bytes); split the batch"}, status_code=413)

    @app.post("/retrieve")
    async def retrieve(request: Request):
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > config.max_body_bytes:
            return too_big(declared)  # refused before reading it
        body = bytearray()
        async for piece in request.stream():
            body += piece
            if len(body) > config.max_body_bytes:  # a chunked body that never said its length
                return too_big(f"over {len(body)}")
        try:
            queries, topk, return_scores = parse_request(bytes(body), config)
        except RequestError as e:
            return JSONResponse({"detail": str(e)}, status_code=e.status)
        if not queries:  # a turn in which no sample searched: Search-R1's trainer still sends it
            return JSONResponse({"result": []})
        pending = batcher.stats.pending_queries
        if pending + len(queries) > config.max_pending_queries:
            batcher.stats.rejected_overloaded += 1
            return JSONResponse({"detail": f"server overloaded: {pending} queries are already waiting (limit "
                                           f"{config.max_pending_queries}); back off and retry"},
                                status_code=429, headers={"Retry-After": "1"})
        try:
            content = await batcher.submit(queries, topk, return_scores, client_gone=request.is_disconnected)
        except SearchTimeout as e:
            return JSONResponse({"detail": str(e)}, status_code=503, headers={"Retry-After": "5"})
        except Exception as e:  # noqa: BLE001 - the server must stay up; the client sees a 500 and retries
            return JSONResponse({"detail": f"retrieval failed: {type(e).__name__}: {e}"}, status_code=500)
        return Response(content, media_type="application/json")

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


def build_arg_parser() -> ArgumentParser:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_argument_group("index (either --index-dir, or --faiss-index with --corpus)")
    src.add_argument("--index-dir", help="directory written by tools/build_index.py")
    src.add_argument("--faiss-index", help="an existing faiss index file, row i = corpus row i (e5_Flat.index); "
                                           "give the encoder that made it with the encoder flags below")
    src.add_argument("--corpus", help="corpus JSONL (required with --faiss-index; overrides the index's corpus)")
    # One definition with the index builder's. With --index-dir the model, pooling, prefixes and max length come
    # from index_meta.json (what the passages were encoded with); device, fp16, batch size and threads apply.
    add_encoder_args(p)
    srv = p.add_argument_group("server")
    d = ServerConfig()
    srv.add_argument("--host", default=d.host)
    srv.add_argument("--port", type=at_least(0), default=d.port, help="0 = any free port (printed at start)")
    srv.add_argument("--default-topk", type=int, default=d.default_topk)
    srv.add_argument("--max-queries", type=int, default=d.max_queries, help="queries one request may carry")
    srv.add_argument("--max-topk", type=int, default=d.max_topk)
    srv.add_argument("--max-query-chars", type=int, default=d.max_query_chars)
    srv.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    srv.add_argument("--search-timeout-s", type=float, default=d.search_timeout_s,
                     help="a search running longer fails its requests with 503 and /health says stalled; 0 = none")
    srv.add_argument("--batch-window-ms", type=float, default=d.batch_window_ms,
                     help="a batch of concurrent requests closes once none joined it for this long")
    srv.add_argument("--batch-max-wait-ms", type=float, default=d.batch_max_wait_ms,
                     help="... or this long after its first request")
    srv.add_argument("--max-batch-queries", type=int, default=d.max_batch_queries)
    srv.add_argument("--max-pending-queries", type=int, default=None,
                     help=f"queries waiting at once before new requests get 429 (overloaded, retry later); "
                          f"default {d.max_pending_queries}, or --max-queries when that is larger")
    srv.add_argument("--query-cache-size", type=int, default=16384,
                     help="query embeddings kept in an LRU (GRPO repeats each question n times); 0 = off")
    srv.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    srv.add_argument("--access-log", action="store_true", help="log every request (noisy under load)")
    rt = p.add_argument_group("search runtime")
    rt.add_argument("--faiss-gpu", action="store_true", help="put a Flat faiss index on all GPUs (faiss-gpu)")
    rt.add_argument("--faiss-threads", type=int, default=0, help="faiss OpenMP threads; 0 = --torch-threads")
    rt.add_argument("--bm25-mmap", action="store_true", help="memory-map the BM25 arrays (large corpora)")
    rt.add_argument("--faiss-mmap", action="store_true",
                    help="memory-map the faiss vectors instead of reading them into RAM (a 65 GB e5_Flat.index)")
    return p


def check_index_dir(index_dir: str, flag: str = "--index-dir") -> None:
    """UsageError unless `index_dir` holds an index; the message names the step that writes one, or the index
    folder(s) inside when the user passed their parent (`data/synthetic` instead of `data/synthetic/index_bm25`)."""
    import os

    if os.path.isfile(os.path.join(index_dir, "index_meta.json")):
        return
    inside = sorted(d for d in (os.listdir(index_dir) if os.path.isdir(index_dir) else [])
                    if os.path.isfile(os.path.join(index_dir, d, "index_meta.json")))
    if inside:
        raise UsageError(f"{flag} {index_dir!r} is not an index but holds {len(inside)}: pass "
                         + " or ".join(f"{flag} {os.path.join(index_dir, d)}" for d in inside))
    what = "does not exist" if not os.path.exists(index_dir) else "has no index_meta.json"
    raise UsageError(f"{flag} {index_dir!r} {what}: build an index first, with "
                     f"`python tools/build_index.py --corpus CORPUS.jsonl --out-dir {index_dir}`, or for the "
                     f"synthetic world `python tools/make_synthetic_world.py --out-dir data/synthetic --oracle bm25` "
                     f"(writes data/synthetic/index_bm25)")


def check_args(args) -> None:
    """Mistakes in the flags, found before anything heavy loads (UsageError: one `error:` line, exit 2)."""
    import os

    if args.index_dir and args.faiss_index:
        raise UsageError("give either --index-dir or --faiss-index, not both")
    if not args.index_dir and not (args.faiss_index and args.corpus):
        raise UsageError("no index: pass --index-dir DIR, or --faiss-index FILE with --corpus FILE.jsonl")
    if args.index_dir:
        check_index_dir(args.index_dir)
    for flag, path in (("--faiss-index", args.faiss_index), ("--corpus", args.corpus)):
        if path and not os.path.isfile(path):
            raise UsageError(f"{flag} {path!r} is not a file")
    if args.port > 65535:
        raise UsageError(f"--port must be at most 65535, got {args.port}")
    problem = encoder_args_problem(args)
    if problem:
        raise UsageError(problem)
    for flag in ("torch_threads", "faiss_threads", "query_cache_size"):
        if (getattr(args, flag) or 0) < 0:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")


def load_from_args(args) -> Retriever:
    from megatron_searchr1.search.retrievers import load_retriever, open_faiss_index

    runtime = {**encoder_options(args, runtime_only=True), "use_gpu": args.faiss_gpu,
               "num_threads": args.faiss_threads or None, "faiss_mmap": args.faiss_mmap or None,
               "query_cache_size": args.query_cache_size}
    runtime = {k: v for k, v in runtime.items() if v is not None}
    if args.index_dir:
        return load_retriever(args.index_dir, corpus_path=args.corpus, bm25_mmap=args.bm25_mmap, **runtime)
    # The same meta and loading code as register_faiss_index + load_retriever (the corpus offsets are cached
    # next to the corpus when its directory is writable, so wiki-18 is not rescanned on every start).
    index_fields = {k: v for k, v in encoder_options(args).items()
                    if k not in ("batch_size", "fp16", "device") and v is not None}
    return open_faiss_index(args.faiss_index, args.corpus, runtime=runtime, **index_fields)


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    check_args(args)
    try:
        config = ServerConfig(host=args.host, port=args.port, default_topk=args.default_topk,
                              max_queries=args.max_queries, max_topk=args.max_topk,
                              max_query_chars=args.max_query_chars, max_body_bytes=args.max_body_bytes,
                              search_timeout_s=args.search_timeout_s, batch_window_ms=args.batch_window_ms,
                              batch_max_wait_ms=args.batch_max_wait_ms,
                              max_batch_queries=args.max_batch_queries,
                              max_pending_queries=args.max_pending_queries or max(ServerConfig.max_pending_queries,
                                                                                  args.max_queries))
    except ValueError as e:
        raise UsageError(str(e)) from None
    import uvicorn

    from megatron_searchr1.search.encoder import set_cpu_threads

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    threads = set_cpu_threads(args.torch_threads)
    logger.info("%d CPU threads for the encoder and faiss (--torch-threads)", threads)
    t0 = time.time()
    retriever = load_from_args(args)
    logger.info("loaded %s in %.1fs", json.dumps(retriever.describe()), time.time() - t0)
    try:
        sock = bind_socket(config.host, config.port)
    except OSError as e:
        raise UsageError(str(e)) from None
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
    return 0


cli = console(main)  # the console script (setup.py)


if __name__ == "__main__":
    raise SystemExit(run_main(main))
