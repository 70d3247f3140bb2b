"""The micro-batcher (search/batcher.py), through a real server: what is batched with what, a failing search,
the wait for company, overload (429) and clients that went away."""
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from megatron_searchr1.search.server import BackgroundServer, ServerConfig
from tests.search.test_server import post


class _RecordingRetriever:
    """A real BM25 retriever that records the queries of each search call (= each micro-batch)."""

    def __init__(self, inner):
        self.inner, self.corpus, self.kind = inner, inner.corpus, "bm25"
        self.calls = []

    def search_ids(self, queries, topk):
        self.calls.append(list(queries))
        return self.inner.search_ids(queries, topk)

    def describe(self):
        return self.inner.describe()


class _PoisonRetriever(_RecordingRetriever):
    """A recording BM25 retriever that fails on one query, to exercise the server's error path."""

    def search_ids(self, queries, topk):
        if "__boom__" in queries:
            self.calls.append(list(queries))
            raise RuntimeError("index shard unavailable")
        return super().search_ids(queries, topk)


def test_a_failing_search_is_a_500_and_spares_requests_batched_with_it(world, bm25_index):
    poison = _PoisonRetriever(bm25_index[1])
    with BackgroundServer(poison, ServerConfig(port=0, batch_window_ms=200.0)) as srv:
        bodies = [{"queries": ["__boom__"], "topk": 2}] + [{"queries": [q], "topk": 2} for q in world["queries"][:8]]
        barrier = threading.Barrier(len(bodies))

        def send(body):
            with httpx.Client(timeout=60) as c:
                barrier.wait()
                return c.post(f"{srv.url}/retrieve", json=body)

        with ThreadPoolExecutor(len(bodies)) as pool:
            responses = list(pool.map(send, bodies))
        assert responses[0].status_code == 500 and "index shard unavailable" in responses[0].json()["detail"]
        assert [r.status_code for r in responses[1:]] == [200] * 8
        assert [r.json()["result"][0][0]["id"] for r in responses[1:]] == [d["id"] for d in world["docs"][:8]]
        # the poison request really shared a batch with good ones (then each was retried alone)
        assert max(len(c) for c in poison.calls if "__boom__" in c) > 1


@pytest.mark.parametrize("max_wait_ms, batches", [(5000.0, 1), (500.0, 2)])
def test_a_batch_waits_while_requests_keep_joining_up_to_its_max_wait(world, bm25_index, max_wait_ms, batches):
    # Clients answered together send their next requests one after another: 6 requests 150 ms apart, each within
    # the 400 ms window of the one before, make one batch; a 500 ms max wait closes the first batch early.
    rec = _RecordingRetriever(bm25_index[1])
    config = ServerConfig(port=0, batch_window_ms=400.0, batch_max_wait_ms=max_wait_ms)
    with BackgroundServer(rec, config) as srv:
        clients = [httpx.Client(timeout=60) for _ in range(6)]
        start = threading.Barrier(6)

        def send(i):
            start.wait()
            time.sleep(0.15 * i)
            return clients[i].post(f"{srv.url}/retrieve", json={"queries": [world["queries"][i]], "topk": 1})

        with ThreadPoolExecutor(6) as pool:
            responses = list(pool.map(send, range(6)))
        for c in clients:
            c.close()
    assert [r.json()["result"][0][0]["id"] for r in responses] == [d["id"] for d in world["docs"][:6]]
    assert len(rec.calls) == batches and sorted(q for c in rec.calls for q in c) == sorted(world["queries"][:6])


class _GatedRetriever:
    """A real BM25 retriever whose searches wait for `gate`: requests pile up behind the first one, with no sleeps."""

    def __init__(self, inner):
        self.inner, self.corpus, self.kind = inner, inner.corpus, "bm25"
        self.entered, self.gate, self.calls = threading.Event(), threading.Event(), []

    def search_ids(self, queries, topk):
        self.calls.append(list(queries))
        self.entered.set()
        assert self.gate.wait(120), "test never opened the gate"
        return self.inner.search_ids(queries, topk)

    def describe(self):
        return self.inner.describe()


def _wait_for_pending(url, n):
    deadline = time.time() + 60
    while (pending := httpx.get(f"{url}/health", timeout=10).json()["batching"]["pending_queries"]) != n:
        assert time.time() < deadline, f"pending_queries stayed {pending}, expected {n}"
        time.sleep(0.01)


def test_an_overloaded_server_answers_429_and_keeps_serving(world, bm25_index):
    gated = _GatedRetriever(bm25_index[1])
    qs = world["queries"]
    config = ServerConfig(port=0, max_queries=4, max_pending_queries=6, batch_window_ms=0)
    with BackgroundServer(gated, config) as srv, ThreadPoolExecutor(2) as pool:
        first = pool.submit(post, srv.url, {"queries": qs[0:3], "topk": 1})
        assert gated.entered.wait(60)  # being searched (3 pending) ...
        second = pool.submit(post, srv.url, {"queries": qs[3:6], "topk": 1})
        _wait_for_pending(srv.url, 6)  # ... and 3 more queued: the limit is reached
        over = post(srv.url, {"queries": [qs[6]], "topk": 1})
        assert over.status_code == 429, over.text
        assert "overloaded" in over.json()["detail"] and "retry" in over.json()["detail"]
        gated.gate.set()
        for fut, rows in ((first, range(0, 3)), (second, range(3, 6))):
            r = fut.result(timeout=60)
            assert r.status_code == 200
            assert [row[0]["id"] for row in r.json()["result"]] == [world["docs"][i]["id"] for i in rows]
        again = post(srv.url, {"queries": [qs[6]], "topk": 1})  # the queue drained: served again
        assert again.status_code == 200 and again.json()["result"][0][0]["id"] == world["docs"][6]["id"]
        health = httpx.get(f"{srv.url}/health", timeout=10).json()
        assert health["batching"]["rejected_overloaded"] == 1 and health["batching"]["pending_queries"] == 0
        assert health["limits"]["max_pending_queries"] == 6
        assert [q for call in gated.calls for q in call] == qs[0:7]  # the rejected request was never searched
    with pytest.raises(ValueError, match="max_pending_queries"):
        ServerConfig(max_queries=8, max_pending_queries=4)


def test_a_request_whose_client_went_away_is_not_searched(world, bm25_index):
    import json
    import socket

    gated = _GatedRetriever(bm25_index[1])
    with BackgroundServer(gated, ServerConfig(port=0, batch_window_ms=0)) as srv, ThreadPoolExecutor(1) as pool:
        first = pool.submit(post, srv.url, {"queries": [world["queries"][0]], "topk": 1})
        assert gated.entered.wait(60)
        body = json.dumps({"queries": ["__gone__"], "topk": 1}).encode()
        host, port = srv.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:  # sends a request, then hangs up
            sock.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            _wait_for_pending(srv.url, 2)
        httpx.get(f"{srv.url}/health", timeout=10)  # a round trip through the event loop, which saw the hang-up
        gated.gate.set()
        assert first.result(timeout=60).status_code == 200
        ok = post(srv.url, {"queries": [world["queries"][1]], "topk": 1})
        assert ok.status_code == 200
        stats = httpx.get(f"{srv.url}/health", timeout=10).json()["batching"]
    assert all("__gone__" not in call for call in gated.calls)
    assert stats["skipped_disconnected"] == 1 and stats["pending_queries"] == 0


# ---- load ------------------------------------------------------------------------------------------------------
