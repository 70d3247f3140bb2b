"""The rollout's retrieval client: Search-R1 formatting, chunking, retries, and never raising on failure."""
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from megatron_searchr1.search.client import (
    RetrievalClient, RetrievalDown, RetrievalError, SearchFailure, SearchGuard, format_docs, is_search_failure,
)
from megatron_searchr1.search.server import BackgroundServer, ServerConfig


@pytest.fixture(scope="module")
def server(bm25_index):
    with BackgroundServer(bm25_index[1], ServerConfig(port=0, max_queries=8, max_topk=20,
                                                      max_query_chars=200)) as srv:
        yield srv


class FaultyRetriever:
    """Wraps a real retriever; fails its first `fail_first` calls, any call with "__boom__", and sleeps `delay`."""

    def __init__(self, inner, fail_first=0, delay=0.0):
        self.inner, self.corpus, self.kind = inner, inner.corpus, "faulty"
        self.fail_first, self.delay, self.calls = fail_first, delay, 0

    def search_ids(self, queries, topk):
        self.calls += 1
        time.sleep(self.delay)
        if self.calls <= self.fail_first or "__boom__" in queries:
            raise RuntimeError("transient index failure")
        return self.inner.search_ids(queries, topk)

    def describe(self):
        return self.inner.describe()


def search_r1_observations(url, queries, topk):
    """What Search-R1's generation.py does: one POST with return_scores=True, then `_passages2string` per query
    (written out again here from the study guide, independently of `format_docs`)."""
    results = httpx.post(f"{url}/retrieve", json={"queries": queries, "topk": topk, "return_scores": True},
                         timeout=30).json()["result"]
    texts = []
    for retrieval_result in results:
        format_reference = ""
        for idx, doc_item in enumerate(retrieval_result):
            content = doc_item["document"]["contents"]
            title = content.split("\n")[0]
            text = "\n".join(content.split("\n")[1:])
            format_reference += f"Doc {idx + 1}(Title: {title}) {text}\n"
        texts.append(format_reference)
    return texts


# ---- formatting --------------------------------------------------------------------------------------------

def test_format_docs_is_search_r1_passages2string():
    docs = [{"id": "1", "contents": '"Paris"\nParis is the capital of France.'},
            {"id": "2", "contents": '"Seine"\nA river.\nIt flows through Paris.'}]
    want = ('Doc 1(Title: "Paris") Paris is the capital of France.\n'
            'Doc 2(Title: "Seine") A river.\nIt flows through Paris.\n')
    assert format_docs(docs) == want  # return_scores=false items
    assert format_docs([{"document": d, "score": 1.0} for d in docs]) == want  # return_scores=true items
    assert format_docs([(dict(d, title="x", text="y"), 0.5) for d in docs]) == want  # Retriever.search pairs
    assert format_docs([{"title": "Paris", "text": "Paris is the capital of France."}]) == want.split("\n")[0] + "\n"
    assert format_docs([]) == ""


def test_search_matches_search_r1_client_byte_for_byte(world, server):
    queries = world["queries"][:12]
    with RetrievalClient(f"{server.url}/retrieve", topk=3) as client:  # Search-R1 style URL is accepted
        assert client.search(queries[:8]) == search_r1_observations(server.url, queries[:8], 3)
        assert client.search([]) == []


def test_search_equals_formatting_the_in_process_retriever(world, server, bm25_index):
    queries = world["queries"][100:105]
    with RetrievalClient(server.url, topk=2) as client:
        assert client.search(queries) == [format_docs(hits) for hits in bm25_index[1].search(queries, 2)]


# ---- batching ----------------------------------------------------------------------------------------------

def test_chunks_follow_the_servers_limit_and_keep_order(world, server):
    queries = world["queries"][:20]
    with RetrievalClient(server.url, topk=2) as client:  # the server allows 8 queries per request
        out = client.search(queries)
        assert client.stats.requests == 3 and client.stats.errors == 0 and client.stats.queries == 20
    with RetrievalClient(server.url, topk=2, max_queries_per_request=3) as client:
        assert client.search(queries) == out and client.stats.requests == 7
    singles = [RetrievalClient(server.url, topk=2).search([q])[0] for q in queries]
    assert out == singles


def test_overlong_query_is_truncated_not_rejected(world, server):
    with RetrievalClient(server.url) as client:
        long_query = world["queries"][60] + " " + "x" * 400
        out = client.search([long_query, world["queries"][61]])
    assert not out[0].startswith("Search failed") and not out[1].startswith("Search failed")
    assert client.stats.truncated_queries == 1 and client.stats.errors == 0


def test_one_client_shared_by_threads(world, server):
    queries = world["queries"][:64]
    with RetrievalClient(server.url, topk=1) as client:
        want = client.search(queries)
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda i: client.search(queries[i::8]), range(8)))
    for i in range(8):
        assert got[i] == want[i::8]


# ---- failures never raise ----------------------------------------------------------------------------------

def _closed_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_server_down_gives_error_observations_counts_and_retries():
    client = RetrievalClient(f"http://127.0.0.1:{_closed_port()}", max_retries=2, backoff=0.05)
    t0 = time.time()
    out = client.search(["q1", "q2", "q3"])
    elapsed = time.time() - t0
    assert len(out) == 3 and all(o.startswith("Search failed: ") and "ConnectError" in o for o in out)
    assert "after 3 attempts" in out[0]
    assert all(isinstance(o, SearchFailure) and o == f"Search failed: {o.reason}" for o in out)  # typed, same text
    s = client.stats
    assert (s.requests, s.retries, s.errors, s.failed_queries) == (3, 2, 1, 3)
    assert elapsed >= 0.05 + 0.10  # exponential backoff: 0.05 s, then 0.10 s
    with pytest.raises(RetrievalError, match="ConnectError"):
        client.retrieve(["q1"])
    client.close()


def test_transient_server_errors_are_retried_until_success(world, bm25_index):
    faulty = FaultyRetriever(bm25_index[1], fail_first=2)
    with BackgroundServer(faulty, ServerConfig(port=0)) as srv, \
            RetrievalClient(srv.url, topk=1, max_retries=3, backoff=0.01) as client:
        out = client.search([world["queries"][9]])
    assert out == [format_docs(bm25_index[1].search([world["queries"][9]], 1)[0])]
    assert (client.stats.requests, client.stats.retries, client.stats.errors) == (3, 2, 0)


def test_a_rejected_request_is_not_retried(server):
    with RetrievalClient(server.url, topk=50, max_retries=3, backoff=0.01) as client:
        out = client.search(["anything"])
    assert out == ["Search failed: HTTP 422: 'topk' is 50, the limit is 20"]
    assert (client.stats.requests, client.stats.retries, client.stats.errors) == (1, 0, 1)


def test_timeout_is_an_error_observation(world, bm25_index):
    slow = FaultyRetriever(bm25_index[1], delay=1.0)
    with BackgroundServer(slow, ServerConfig(port=0)) as srv, \
            RetrievalClient(srv.url, timeout=0.25, max_retries=1, backoff=0.01) as client:
        out = client.search([world["queries"][0]])
    assert out[0].startswith("Search failed: timeout after 0.25s") and "after 2 attempts" in out[0]
    assert (client.stats.retries, client.stats.errors) == (1, 1)


def test_a_failing_chunk_spares_the_other_chunks(world, bm25_index):
    faulty = FaultyRetriever(bm25_index[1])
    queries = [world["queries"][20], world["queries"][21], "__boom__", world["queries"][22]]
    with BackgroundServer(faulty, ServerConfig(port=0)) as srv, \
            RetrievalClient(srv.url, topk=1, max_retries=1, backoff=0.01, max_queries_per_request=2) as client:
        out = client.search(queries)
    assert out[:2] == [format_docs(h) for h in bm25_index[1].search(queries[:2], 1)]
    assert out[2] == out[3] and out[2].startswith("Search failed: HTTP 500: retrieval failed: RuntimeError")
    assert (client.stats.errors, client.stats.failed_queries) == (1, 2)


class _OneBadDocRetriever:
    """A real retriever whose corpus row `bad` has non-text contents (a broken corpus line, a buggy server)."""

    def __init__(self, inner, bad):
        self.inner, self.kind = inner, "bm25"
        self.corpus = [dict(d, contents=12345) if i == bad else d for i, d in enumerate(inner.corpus)]

    def search_ids(self, queries, topk):
        return self.inner.search_ids(queries, topk)

    def describe(self):
        return self.inner.describe()


def test_a_malformed_result_item_fails_only_its_own_chunk_counted_once(world, bm25_index):
    queries = [world["queries"][i] for i in (30, 31, 32, 33, 34, 35)]
    bad = _OneBadDocRetriever(bm25_index[1], bad=32)
    with BackgroundServer(bad, ServerConfig(port=0)) as srv, \
            RetrievalClient(srv.url, topk=1, max_retries=0, max_queries_per_request=2) as client:
        out = client.search(queries)
    good = [format_docs(h) for h in bm25_index[1].search(queries, 1)]
    assert out[:2] == good[:2] and out[4:] == good[4:]  # the chunks before and after are intact
    assert out[2] == out[3] and out[2].startswith("Search failed: malformed result item: AttributeError")
    assert (client.stats.errors, client.stats.failed_queries, client.stats.queries) == (1, 2, 6)


def test_retrieve_returns_raw_results(world, server):
    with RetrievalClient(server.url, topk=2) as client:
        with_scores = client.retrieve(world["queries"][:3])
        plain = client.retrieve(world["queries"][:3], topk=1, return_scores=False)
    assert len(with_scores) == 3 and set(with_scores[0][0]) == {"document", "score"}
    assert [row[0] for row in plain] == [row[0]["document"] for row in with_scores]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="topk=0"):
        RetrievalClient("http://127.0.0.1:1", topk=0)


# ---- the guard: failure counts and the circuit breaker -------------------------------------------------------

def test_guard_opens_after_consecutive_failed_rounds_and_stops_asking_a_dead_server():
    client = RetrievalClient(f"http://127.0.0.1:{_closed_port()}", max_retries=0)
    guard = SearchGuard(client.search, client.base_url, max_error_rate=0.2, max_failed_rounds=3)
    for _ in range(3):
        assert all(is_search_failure(o) for o in guard(["a", "b"]))
    assert guard.open and client.stats.requests == 3  # one request per round so far
    t0 = time.time()
    out = guard(["c"] * 5)
    assert time.time() - t0 < 0.1 and client.stats.requests == 3  # open: failed at once, nothing sent
    assert is_search_failure(out[0]) and "not sent" in out[0] and "ConnectError" in out[0]
    failed, searched, opened, last = guard.take()
    assert (failed, searched, opened) == (11, 11, True) and "ConnectError" in last
    with pytest.raises(RetrievalDown, match=rf"{client.base_url} failed 11 of 11 searches during a step "
                                            r"\(retrieval.max_failed_rounds=3 .*ConnectError"):
        guard.down(failed, searched, opened, last, "a step")
    assert guard.take()[:2] == (0, 0)  # counts start again after a take
    client.close()


def test_guard_a_success_resets_the_failed_rounds_and_the_rate_decides(world, server):
    flaky = {"down": True}
    client = RetrievalClient(server.url)
    guard = SearchGuard(lambda qs: [SearchFailure("x")] * len(qs) if flaky["down"] else client.search(qs),
                        server.url, max_error_rate=0.25, max_failed_rounds=2)
    guard(["q"])  # one failed round
    flaky["down"] = False
    assert not is_search_failure(guard(["who founded x?"] * 3)[0])  # a real search: the round counter restarts
    flaky["down"] = True
    guard(["q"])
    assert not guard.open and guard.failed_rounds == 1
    failed, searched, opened, _ = guard.take()
    assert (failed, searched) == (2, 5)
    assert guard.verdict(1, 4, False) is None and "max_error_rate=0.25" in guard.verdict(2, 5, False)
    client.close()


def test_a_hung_server_costs_bounded_time_per_round(bm25_index):
    # a server that accepts connections but never answers (what SIGSTOP leaves: the kernel still accepts)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    client = RetrievalClient(f"http://127.0.0.1:{s.getsockname()[1]}", timeout=0.3, max_retries=1, backoff=0.05)
    guard = SearchGuard(client.search, client.base_url, max_failed_rounds=2)
    t0 = time.time()
    for _ in range(5):
        guard(["q"])
    elapsed = time.time() - t0
    # two rounds of 2 attempts x 0.3 s (plus the /health probe per round), then nothing is sent
    assert guard.open and elapsed < 4.0, elapsed
    assert "timeout" in guard.take()[3]
    client.close()
    s.close()
