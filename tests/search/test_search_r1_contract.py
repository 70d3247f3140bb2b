"""Search-R1's trainer and servers, talking to ours unchanged, and our client talking to a server shaped like
Search-R1's (no /health, one request at a time, string documents from its rerank stage): the request shapes of
its code, run against a real uvicorn on loopback."""
import threading
import time

import httpx
import pytest

from megatron_searchr1.search.client import RetrievalClient, format_docs
from megatron_searchr1.search.server import BackgroundServer, ServerConfig


@pytest.fixture(scope="module")
def server(bm25_index):
    with BackgroundServer(bm25_index[1], ServerConfig(port=0)) as srv:  # default limits, as a user starts it
        yield srv


def post(url, body):
    return httpx.post(f"{url}/retrieve", json=body, timeout=120)


def test_empty_batch_answers_an_empty_result(server):
    # Search-R1's generation.py posts every turn, even one in which no sample searched.
    for body in ({"queries": []}, {"queries": [], "topk": 3, "return_scores": True}):
        r = post(server.url, body)
        assert r.status_code == 200 and r.json() == {"result": []}


def test_a_whole_rl_batch_in_one_request(world, server, bm25_index):
    # train_batch_size 512 x n_agent 5: every rollout's query of one turn in a single POST
    queries = [world["queries"][i % len(world["queries"])] for i in range(512 * 5)]
    r = post(server.url, {"queries": queries, "topk": 3, "return_scores": True})
    assert r.status_code == 200, r.text[:300]
    result = r.json()["result"]
    assert len(result) == 2560
    want = bm25_index[1].search(queries[:300], 3)
    assert [[x["document"]["id"] for x in row] for row in result[:300]] == \
        [[d["id"] for d, _ in hits] for hits in want]
    assert result[300] == result[0]  # the same query later in the batch: the same answer


@pytest.mark.parametrize("topk, want", [("3", 3), (3.0, 3), (2, 2), ("2", 2), (0, 3), (None, 3)])
def test_topk_is_read_as_search_r1_reads_it(world, server, topk, want):
    r = post(server.url, {"queries": [world["queries"][40]], "topk": topk, "return_scores": True})
    assert r.status_code == 200, r.text
    assert len(r.json()["result"][0]) == want


@pytest.mark.parametrize("flag, scored", [(True, True), (False, False), ("true", True), (0, False), (None, False)])
def test_return_scores_both_ways(world, server, bm25_index, flag, scored):
    body = {"queries": world["queries"][43:45], "topk": 2}
    if flag is not None:
        body["return_scores"] = flag
    result = post(server.url, body).json()["result"]
    want = bm25_index[1].search(world["queries"][43:45], 2)
    if scored:
        assert [[(x["document"]["id"], round(x["score"], 4)) for x in row] for row in result] == \
            [[(d["id"], round(s, 4)) for d, s in hits] for hits in want]
    else:
        assert result == [[{"id": d["id"], "contents": d["contents"]} for d, _ in hits] for hits in want]


def test_a_body_over_the_cap_is_refused_before_it_is_read(bm25_index):
    with BackgroundServer(bm25_index[1], ServerConfig(port=0, max_body_bytes=1000)) as srv:
        r = post(srv.url, {"queries": ["x" * 600, "y" * 600]})
        assert r.status_code == 413 and "the limit is 1000" in r.json()["detail"]
        # a chunked body (no Content-Length) is cut off as soon as it passes the cap
        def body():
            for _ in range(50):
                yield b" " * 100
            yield b'{"queries": ["a"]}'
        r = httpx.post(f"{srv.url}/retrieve", content=body(), timeout=30)
        assert r.status_code == 413
        assert post(srv.url, {"queries": ["a"]}).status_code == 200


# ---- our client against a server shaped like Search-R1's ------------------------------------------------------

class _SearchR1Like:
    """A stand-in for Search-R1's retrieval_server.py: /retrieve only (no /health), fails a request that arrives
    while another is being served (its shared tokenizer raises "Already borrowed"), optionally a rerank stage
    whose documents are plain strings, and optionally 429s with Retry-After for the first few requests."""

    def __init__(self, docs, string_docs=False, busy_first=0):
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse

        self.docs, self.requests, self.health_asks, self.concurrent_failures = docs, [], 0, 0
        self.busy_first, self.busy_seen = busy_first, 0
        self._in_flight = threading.Lock()
        app = FastAPI()

        @app.post("/retrieve")
        def retrieve(body: dict):  # a sync endpoint, run on FastAPI's thread pool, as Search-R1's is
            if self.busy_seen < self.busy_first:
                self.busy_seen += 1
                return JSONResponse({"detail": "busy"}, status_code=429, headers={"Retry-After": "0.2"})
            if not self._in_flight.acquire(blocking=False):
                self.concurrent_failures += 1
                return JSONResponse({"detail": "RuntimeError: Already borrowed"}, status_code=500)
            try:
                time.sleep(0.05)
                self.requests.append(len(body["queries"]))
                out = []
                for q in body["queries"]:
                    docs = [self.docs[(len(q) + j) % len(self.docs)] for j in range(body.get("topk") or 3)]
                    if string_docs:  # rerank_server: '"title"\ntext' strings
                        out.append([{"document": d["contents"], "score": 1.0} for d in docs])
                    else:
                        out.append([{"document": d, "score": 1.0} for d in docs])
                return {"result": out}
            finally:
                self._in_flight.release()

        @app.middleware("http")
        async def count_health(request: Request, call_next):
            if request.url.path == "/health":
                self.health_asks += 1
            return await call_next(request)

        self.app = app

    def expected(self, queries, topk=3):
        return [format_docs([self.docs[(len(q) + j) % len(self.docs)] for j in range(topk)]) for q in queries]


def _serve(app):
    import uvicorn

    from megatron_searchr1.search.server import _url, bind_socket

    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    return server, thread, _url(sock, "127.0.0.1")


@pytest.fixture
def search_r1_like(world):
    docs = [{"id": d["id"], "contents": f'"{d["title"]}"\n{d["text"]}'} for d in world["docs"]]
    servers = []

    def start(**kw):
        fake = _SearchR1Like(docs, **kw)
        server, thread, url = _serve(fake.app)
        servers.append((server, thread))
        return fake, url

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(timeout=10)


def test_client_without_health_sends_the_whole_batch_once_and_stops_asking(world, search_r1_like):
    fake, url = search_r1_like()
    queries = [world["queries"][i % 300] for i in range(700)]  # more than our own DEFAULT_CHUNK and any chunk
    with RetrievalClient(f"{url}/retrieve", topk=3) as client:
        for _ in range(3):
            assert client.search(queries) == fake.expected(queries)
        assert client.has_health is False and client.stats.errors == 0
    assert fake.requests == [700, 700, 700]  # one request per batch, never concurrent chunks
    assert fake.health_asks == 1 and fake.concurrent_failures == 0


def test_client_reads_string_documents_of_a_rerank_server(world, search_r1_like):
    fake, url = search_r1_like(string_docs=True)
    queries = world["queries"][:5]
    with RetrievalClient(url, topk=3) as client:
        assert client.search(queries) == fake.expected(queries)


def test_client_waits_out_429_honouring_retry_after(world, search_r1_like):
    fake, url = search_r1_like(busy_first=4)
    queries = world["queries"][:3]
    with RetrievalClient(url, topk=3, max_retries=0, backoff=0.01) as client:  # 429 is not a failed attempt
        t0 = time.monotonic()
        assert client.search(queries) == fake.expected(queries)
        assert time.monotonic() - t0 >= 4 * 0.2 * 0.95  # waited Retry-After each time, not the 0.01 s backoff
        assert client.stats.retries == 4
    fake2, url2 = search_r1_like(busy_first=1000)
    with RetrievalClient(url2, topk=3, backoff=0.01, overload_deadline=0.5) as client:
        t0 = time.monotonic()
        out = client.search(queries)
        assert time.monotonic() - t0 < 3
        assert all(o.startswith("Search failed: HTTP 429") and "overloaded for 0.5s" in o for o in out)


SLOW_S = 4.0  # long enough that "answered before the search ended" holds on a loaded 2-core machine


class _Slow:
    """A retriever whose search of "__slow__" takes SLOW_S seconds."""

    def __init__(self, inner):
        self.inner, self.corpus, self.kind = inner, inner.corpus, "slow"

    def search_ids(self, queries, topk):
        if "__slow__" in queries:
            time.sleep(SLOW_S)
        return self.inner.search_ids(queries, topk)

    def describe(self):
        return {"kind": "slow", "num_docs": len(self.corpus)}


def test_a_search_past_the_timeout_is_a_503_and_health_says_stalled_until_it_ends(world, bm25_index):
    with BackgroundServer(_Slow(bm25_index[1]), ServerConfig(port=0, search_timeout_s=0.3)) as srv:
        t0 = time.monotonic()
        r = post(srv.url, {"queries": ["__slow__"]})
        assert r.status_code == 503 and "did not finish within 0.3s" in r.json()["detail"]
        assert time.monotonic() - t0 < SLOW_S - 1.0  # the 503 came while the search was still running
        h = httpx.get(f"{srv.url}/health", timeout=10)
        assert h.status_code == 503 and h.json()["status"] == "stalled"
        time.sleep(SLOW_S)
        h = httpx.get(f"{srv.url}/health", timeout=10)
        assert h.status_code == 200 and h.json()["status"] == "ok"
        assert h.json()["batching"]["timed_out_requests"] == 1
        assert post(srv.url, {"queries": [world["queries"][40]]}).status_code == 200
