"""tools/benchmarks/bench_retrieval.py: its load generator's HTTP/1.1 client, against a real uvicorn on loopback."""
import asyncio
import importlib.util
import json
import subprocess
import sys
import threading
import time

import pytest

from tests.dist_utils import REPO

_spec = importlib.util.spec_from_file_location("bench_retrieval", REPO / "tools" / "benchmarks" / "bench_retrieval.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.fixture(scope="module")
def echo_url():
    """A FastAPI app on uvicorn that answers /retrieve with n copies of each query (n from the body) and records
    each request's client port (one port per kept-alive connection)."""
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    from megatron_searchr1.search.server import bind_socket

    app, ports = FastAPI(), []

    @app.post("/retrieve")
    async def retrieve(request: Request):
        body = await request.json()
        ports.append(request.client.port)
        if "queries" not in body:
            return JSONResponse({"detail": "missing queries"}, status_code=422)
        return {"result": [[q] * body.get("topk", 1) for q in body["queries"]]}

    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", ports
    server.should_exit = True
    thread.join(timeout=10)


def test_connection_reads_each_response_whole_on_one_kept_alive_connection(echo_url):
    url, ports = echo_url
    big = "x" * 50_000  # a body longer than one read

    async def run():
        conn = bench.Connection(url)
        try:
            return [await conn.post("/retrieve", {"queries": [big, "b"], "topk": 3}),
                    await conn.post("/retrieve", {"topk": 1}),
                    await conn.post("/retrieve", {"queries": ["c"], "topk": 2})]
        finally:
            conn.close()

    before = len(ports)
    (s1, b1), (s2, b2), (s3, b3) = asyncio.run(run())
    assert (s1, s2, s3) == (200, 422, 200)
    assert json.loads(b1) == {"result": [[big] * 3, ["b"] * 3]}
    assert json.loads(b2) == {"detail": "missing queries"} and json.loads(b3) == {"result": [["c", "c"]]}
    assert len(set(ports[before:])) == 1  # the three requests shared one connection


def test_closed_loop_counts_every_answer_once(echo_url):
    url, ports = echo_url
    before = len(ports)
    r = asyncio.run(bench.closed_loop(url, bench.Queries(), clients=4, seconds=0.5, topk=3))
    served = len(ports) - before
    assert r["errors"] == 0 and served > 4
    # every request was answered and counted, from 4 connections
    assert abs(r["qps"] * 0.5 - served) / served < 0.2 and len(set(ports[before:])) == 4


@pytest.mark.parametrize("types", ["sq6", "flat,lsh", ""])
def test_index_types_need_flat_first_and_known_types(types):
    r = subprocess.run([sys.executable, str(REPO / "tools" / "benchmarks" / "bench_retrieval.py"), "--index-types",
                        types], capture_output=True, text=True, timeout=120, cwd=REPO)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "--index-types: flat first" in errors[0], r.stderr
