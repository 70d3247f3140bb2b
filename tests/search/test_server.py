"""The /retrieve server on a real uvicorn over loopback: Search-R1's JSON shapes, bad input, load, the CLI."""
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from megatron_searchr1.search.launch import ServerProcess
from megatron_searchr1.search.server import BackgroundServer, ServerConfig

LIMITS = dict(max_queries=8, max_topk=20, max_query_chars=200)


@pytest.fixture(scope="module")
def bm25_server(bm25_index):
    with BackgroundServer(bm25_index[1], ServerConfig(port=0, **LIMITS)) as srv:
        yield srv


@pytest.fixture(scope="module")
def dense_server(dense_index):
    with BackgroundServer(dense_index[1], ServerConfig(port=0, **LIMITS)) as srv:
        yield srv


def post(url, body, **kw):
    if isinstance(body, (dict, list)):
        return httpx.post(f"{url}/retrieve", json=body, timeout=60, **kw)
    return httpx.post(f"{url}/retrieve", content=body, timeout=60,
                      headers={"content-type": "application/json"}, **kw)


# ---- the contract ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("server, index", [("bm25_server", "bm25_index"), ("dense_server", "dense_index")])
def test_return_scores_true_shape_matches_search_r1(world, server, index, request):
    srv, retriever = request.getfixturevalue(server), request.getfixturevalue(index)[1]
    queries = [world["queries"][3], world["queries"][150]]
    r = post(srv.url, {"queries": queries, "topk": 4, "return_scores": True})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert list(body) == ["result"] and len(body["result"]) == 2
    expected = retriever.search(queries, 4)
    assert len(body["result"][1]) == 4  # a person query matches many docs (BM25 may find fewer for a topic)
    for got, want in zip(body["result"], expected):
        assert len(got) == len(want)
        for item, (doc, score) in zip(got, want):
            assert set(item) == {"document", "score"} and set(item["document"]) == {"id", "contents"}
            assert item["document"] == {"id": doc["id"], "contents": doc["contents"]}
            assert isinstance(item["score"], float) and item["score"] == pytest.approx(score, rel=1e-5)
        scores = [item["score"] for item in got]
        assert scores == sorted(scores, reverse=True)


def test_return_scores_false_is_a_plain_list_of_documents(world, bm25_server, bm25_index):
    """Search-R1's own server crashes here; ours answers [[{id, contents}, ...], ...]."""
    queries = world["queries"][20:23]
    body = post(bm25_server.url, {"queries": queries, "topk": 2, "return_scores": False}).json()
    want = bm25_index[1].search(queries, 2)
    assert body["result"] == [[{"id": d["id"], "contents": d["contents"]} for d, _ in hits] for hits in want]


def test_defaults_topk_3_and_no_scores(world, bm25_server):
    for body in ({"queries": [world["queries"][40]]}, {"queries": [world["queries"][40]], "topk": None}):
        result = post(bm25_server.url, body).json()["result"]
        assert len(result[0]) == 3 and set(result[0][0]) == {"id", "contents"}


def test_health_reports_index_limits_and_batching(bm25_server):
    h = httpx.get(f"{bm25_server.url}/health", timeout=10).json()
    assert h["status"] == "ok" and h["kind"] == "bm25" and h["num_docs"] == 300
    d = ServerConfig()
    assert h["limits"] == {**LIMITS, "default_topk": 3, "max_pending_queries": d.max_pending_queries,
                           "max_body_bytes": d.max_body_bytes, "search_timeout_s": d.search_timeout_s}
    assert {"requests", "batches", "mean_batch_queries"} <= set(h["batching"])


def test_empty_string_query_is_allowed(bm25_server):
    # A policy may emit <search></search>: that is an (empty) search, not a client bug.
    r = post(bm25_server.url, {"queries": ["", "   "], "topk": 3, "return_scores": True})
    assert r.status_code == 200 and r.json() == {"result": [[], []]}


def test_no_nagle_delay_on_loopback(world, bm25_server):
    """Without TCP_NODELAY every response waited ~40 ms for a delayed ACK; a keep-alive request takes ~1 ms."""
    with httpx.Client(timeout=10) as c:
        c.get(f"{bm25_server.url}/health")
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            c.post(f"{bm25_server.url}/retrieve", json={"queries": [world["queries"][1]], "topk": 1})
            times.append(time.perf_counter() - t0)
    assert sorted(times)[len(times) // 2] < 0.030  # median; generous for busy shared cores


# ---- bad input -------------------------------------------------------------------------------------------------

BAD = [
    ("malformed JSON", b'{"queries": ["a"', 400, "malformed JSON"),
    ("not UTF-8", b'\xff\xfe{"queries"', 400, "malformed JSON"),
    ("body not an object", [1, 2], 422, "must be a JSON object"),
    ("missing queries", {"topk": 3}, 422, "missing field 'queries'"),
    ("queries a string", {"queries": "who?"}, 422, "'queries' must be a list of strings, got str"),
    ("query not a string", {"queries": ["a", 5]}, 422, "queries[1] must be a string, got int"),
    ("too many queries", {"queries": ["q"] * 9}, 413, "9 in one request, the limit is 8"),
    ("query too long", {"queries": ["x" * 201]}, 413, "201 characters long, the limit is 200"),
    ("topk negative", {"queries": ["a"], "topk": -3}, 422, "'topk' must be >= 1, got -3"),
    ("topk not a number", {"queries": ["a"], "topk": "three"}, 422, "'topk' must be an integer, got str"),
    ("topk a fraction", {"queries": ["a"], "topk": 2.5}, 422, "'topk' must be an integer, got float"),
    ("topk a bool", {"queries": ["a"], "topk": True}, 422, "'topk' must be an integer, got bool"),
    ("topk over limit", {"queries": ["a"], "topk": 21}, 422, "'topk' is 21, the limit is 20"),
    ("return_scores not bool", {"queries": ["a"], "return_scores": "maybe"}, 422,
     "'return_scores' must be true or false"),
    # json.loads raises RecursionError and ValueError for these, not JSONDecodeError: unhandled, they would be 500s
    ("nested too deeply", b'{"queries": ["a"], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400,
     "malformed JSON body: nested too deeply"),
    ("integer over 4300 digits", b'{"queries": ["a"], "topk": 1' + b"0" * 5000 + b"}", 400,
     "(4300 digits)"),
]


@pytest.mark.parametrize("name, body, status, message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_a_4xx_that_says_why_and_the_server_stays_up(world, bm25_server, name, body, status,
                                                                   message):
    r = post(bm25_server.url, body)
    assert r.status_code == status, r.text
    assert message in r.json()["detail"]
    ok = post(bm25_server.url, {"queries": [world["queries"][5]], "topk": 1, "return_scores": True})
    assert ok.status_code == 200 and ok.json()["result"][0][0]["document"]["id"] == world["docs"][5]["id"]


def test_wrong_method_and_path(bm25_server):
    assert httpx.get(f"{bm25_server.url}/retrieve", timeout=10).status_code == 405
    assert httpx.post(f"{bm25_server.url}/search", json={"queries": ["a"]}, timeout=10).status_code == 404


def _load_requests(world, n):
    qs = world["queries"]
    return [{"queries": [qs[(7 * i + j) % len(qs)] for j in range(1 + i % 4)], "topk": 1 + i % 5,
             "return_scores": True} for i in range(n)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("server", ["bm25_server", "dense_server"])
def test_32_concurrent_clients_match_sequential_results(world, server, request):
    srv = request.getfixturevalue(server)
    n_clients, per_client = 32, 6
    bodies = _load_requests(world, n_clients * per_client)
    with httpx.Client(timeout=60) as c:
        sequential = [c.post(f"{srv.url}/retrieve", json=b).json()["result"] for b in bodies]
    before = httpx.get(f"{srv.url}/health", timeout=10).json()["batching"]

    start = threading.Barrier(n_clients)
    errors = []

    def client(k):
        out = {}
        with httpx.Client(timeout=60) as c:
            start.wait()
            for i in range(k, len(bodies), n_clients):
                r = c.post(f"{srv.url}/retrieve", json=bodies[i])
                if r.status_code != 200:
                    errors.append((i, r.status_code, r.text))
                else:
                    out[i] = r.json()["result"]
        return out

    with ThreadPoolExecutor(n_clients) as pool:
        concurrent = {}
        for part in pool.map(client, range(n_clients)):
            concurrent.update(part)
    assert errors == [] and len(concurrent) == len(bodies)
    for i, want in enumerate(sequential):
        got = concurrent[i]
        assert [[d["document"] for d in row] for row in got] == [[d["document"] for d in row] for row in want]
        np.testing.assert_allclose([d["score"] for row in got for d in row],
                                   [d["score"] for row in want for d in row], rtol=1e-5, atol=1e-6)
    after = httpx.get(f"{srv.url}/health", timeout=10).json()["batching"]
    requests_served = after["requests"] - before["requests"]
    assert requests_served == len(bodies)
    assert after["batches"] - before["batches"] < requests_served  # concurrent requests were micro-batched


# ---- the command line ------------------------------------------------------------------------------------------

def _start_cli(args) -> ServerProcess:
    return ServerProcess(args, start_timeout=120).start()


def _stop_cli(server: ServerProcess) -> str:
    """SIGINT, then the rest of its output; uvicorn shuts down gracefully and re-raises the signal."""
    rc = server.stop()
    out = "".join(server.output)
    assert rc == 0, out
    return out


def test_cli_serves_an_index_dir_and_stops_on_sigint(world, bm25_index):
    server = _start_cli(["--index-dir", bm25_index[0], "--max-queries", "4", "--log-level", "warning"])
    url = server.url
    try:
        assert url.startswith("http://127.0.0.1:")
        assert httpx.get(f"{url}/health", timeout=10).json()["limits"]["max_queries"] == 4
        r = post(url, {"queries": [world["queries"][77]], "topk": 1, "return_scores": True})
        assert r.json()["result"][0][0]["document"]["id"] == world["docs"][77]["id"]
        assert post(url, {"queries": ["a"] * 5}).status_code == 413
    finally:
        out = _stop_cli(server)
    assert "stopped" in out and '"requests": 1' in out  # graceful shutdown ran (the 413 never reached search)
    assert "Traceback" not in out


@pytest.mark.slow
def test_cli_serves_a_raw_faiss_file_with_its_corpus(tmp_path, world, dense_index):
    import faiss

    faiss.write_index(dense_index[1].cpu_index, str(tmp_path / "e5_Flat.index"))
    server = _start_cli(["--faiss-index", str(tmp_path / "e5_Flat.index"), "--corpus", world["path"],
                         "--log-level", "warning"])
    url = server.url
    try:
        queries = world["queries"][:20]
        got = post(url, {"queries": queries, "topk": 2, "return_scores": False}).json()["result"]
        want = dense_index[1].search(queries, 2)
        assert [[d["id"] for d in row] for row in got] == [[d["id"] for d, _ in row] for row in want]
        assert httpx.get(f"{url}/health", timeout=10).json()["kind"] == "dense"
    finally:
        assert "stopped" in _stop_cli(server)


def test_cli_without_an_index_says_what_to_pass():
    r = subprocess.run([sys.executable, "-m", "megatron_searchr1.search.server"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "--index-dir" in r.stderr


SERVER_FLAGS = {  # every server flag and its default before the settings were declared once (ServerConfig fields)
    "--host": "127.0.0.1", "--port": 8000, "--default-topk": 3, "--max-queries": 4096, "--max-topk": 100,
    "--max-query-chars": 4096, "--max-body-bytes": 67108864, "--search-timeout-s": 300.0, "--batch-window-ms": 5.0,
    "--batch-max-wait-ms": 50.0, "--max-batch-queries": 4096, "--max-pending-queries": None,
    "--query-cache-size": 16384, "--log-level": "info", "--access-log": False,
}
OTHER_FLAGS = ["--index-dir", "--faiss-index", "--corpus", "--encoder", "--pooling", "--no-normalize", "--query-prefix",
               "--passage-prefix", "--max-length", "--encoder-batch-size", "--fp16", "--device", "--encoder-backend",
               "--torch-threads", "--faiss-gpu", "--faiss-threads", "--bm25-mmap", "--faiss-mmap", "--nprobe",
               "--ef-search", "--refine-k-factor", "--refine-flat", "--rerank", "--rerank-model", "--rerank-candidates",
               "--rerank-batch-size", "--rerank-max-length"]


def test_cli_flags_are_generated_from_the_settings_with_the_same_names_and_defaults():
    import dataclasses

    from megatron_searchr1.search.server import build_arg_parser, settings_from_args

    parser = build_arg_parser()
    flags = {a.option_strings[0]: a for a in parser._actions if a.option_strings and a.option_strings[0] != "-h"}
    assert sorted(flags) == sorted([*SERVER_FLAGS, *OTHER_FLAGS])
    assert {f: flags[f].default for f in SERVER_FLAGS} == SERVER_FLAGS
    for f in dataclasses.fields(ServerConfig):  # each setting's help is its field's docstring
        assert flags["--" + f.name.replace("_", "-")].help, f.name
    assert "0 picks a free one" in flags["--port"].help
    with pytest.raises(SystemExit):
        parser.parse_args(["--port", "-1"])
    args = parser.parse_args(["--max-queries", "20000", "--max-topk", "7", "--batch-window-ms", "0"])
    config = settings_from_args(args, ServerConfig)
    assert (config.max_queries, config.max_topk, config.batch_window_ms, config.port) == (20000, 7, 0.0, 8000)
    assert config.max_pending_queries == 20000  # the old rule: 16384, or --max-queries when that is larger
    assert settings_from_args(parser.parse_args([]), ServerConfig) == ServerConfig()


def test_index_dir_mistakes_name_the_step_or_the_index_inside(tmp_path):
    from megatron_searchr1.cli import UsageError
    from megatron_searchr1.search.server import check_index_dir

    with pytest.raises(UsageError, match=r"does not exist: build an index first.*tools/build_index\.py.*"
                                         r"make_synthetic_world\.py .*--oracle bm25"):
        check_index_dir(str(tmp_path / "nope"))
    for name in ("index_bm25", "index_dense"):  # what make_synthetic_world leaves: the parent of two indexes
        (tmp_path / name).mkdir()
        (tmp_path / name / "index_meta.json").write_text("{}")
    with pytest.raises(UsageError, match=rf"is not an index but holds 2: pass --index-dir {tmp_path}/index_bm25 "
                                         rf"or --index-dir {tmp_path}/index_dense"):
        check_index_dir(str(tmp_path))
    check_index_dir(str(tmp_path / "index_bm25"))  # an index: no error
