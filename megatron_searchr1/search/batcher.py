"""The micro-batcher: requests that arrive together are searched together, in one encoder/faiss call.

Requests that arrive together (each within `batch_window_ms` of the one before, for at most `batch_max_wait_ms`)
are searched together on a single worker thread, so the event loop keeps accepting requests meanwhile; that thread
also builds the response documents and JSON, off the event loop. Repeated queries are encoded once (deduplicated
per batch, and a bounded LRU of query embeddings in the retriever; /health reports its hit rate). What a query was
batched with does not change its results beyond float rounding: BM25 scores are per query, and a dense embedding
moves by ~1e-7 with the padding of its batch (ties in score break by row number); a cached query's embedding is
reused as computed, so repeats give identical results.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from megatron_searchr1.search.base import Retriever
from megatron_searchr1.search.protocol import render_result

logger = logging.getLogger("megatron_searchr1.search.server")


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
                 render: Callable[[np.ndarray, np.ndarray, bool], bytes] | None = None,
                 max_wait_s: float | None = None):
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
            # for a later batch (tools/benchmarks/NOTES-retrieval-server.md has the measurements).
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
