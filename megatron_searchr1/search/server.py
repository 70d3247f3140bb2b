r"""The retrieval server: Search-R1's `POST /retrieve` over any of our retrievers, `POST /open` (a document by its
id, for tool-calling policies) and `GET /health`.

    python -m megatron_searchr1.search.server --index-dir /data/index --host 127.0.0.1 --port 8000
    python -m megatron_searchr1.search.server --faiss-index e5_Flat.index --corpus wiki-18.jsonl \
        --encoder /models/e5-base-v2 --port 8000        # an existing Search-R1 index, unchanged
    python -m megatron_searchr1.search.server --index-dir D --torch-threads 2   # beside a trainer: a thread budget
    python -m megatron_searchr1.search.server --faiss-index e5_Flat.index --corpus wiki-18.jsonl \
        --encoder /models/e5-base-v2 --rerank cross --rerank-model CE_DIR --rerank-candidates 10   # rerank.py

What it promises: Search-R1's request and response, read as leniently as Search-R1's pydantic model reads them
(protocol.py); concurrent requests searched together (batcher.py). What it refuses, and how: bad input gets a 4xx
whose `detail` says what is wrong and what the limit is, and the server stays up. A body over `max_body_bytes` gets
413 before it is read. When more than `max_pending_queries` queries wait already, a request gets 429 with
Retry-After instead of growing the queue without bound. A search that runs past `search_timeout_s` fails its
requests with 503 and turns /health to 503 "stalled" until it finishes.

`POST /open` serves the tool_calls protocol's `open` tool (rollout/protocols/tools.py's HTTP contract): the request
`{"arguments": [{"doc_id": "7", "offset": 0}, ...], "max_chars": 1000}`, the response `{"results": [text, ...]}`, one
text per call: `Document 7 (Title: ...), characters 0-1000 of 5120:` and the window of the document's text, ending
with how to read on. A call the server cannot answer (an unknown id, an offset past the end) gets its reason as its
text (`Error: ...`): the model reads it like any observation. A request that is not of this shape gets a 400. The
window is at most `max_chars` (the tool's length budget, capped at OPEN_MAX_CHARS). Ids are looked up as corpus row
numbers first (wiki-18's ids are), then through an id -> row map built at the first request that needs it.

Every setting of `ServerConfig` (protocol.py) is declared once, as a dataclass field with its docstring; the flags
of the "server" group are generated from those fields.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import socket
import threading
import time
import typing

import uvicorn
from fastapi import FastAPI, Request  # module level: FastAPI resolves the handlers' annotations from globals
from fastapi.responses import JSONResponse, Response

from megatron_searchr1.cli import ArgumentParser, UsageError, at_least, console, run_main
from megatron_searchr1.field_docs import field_docs
from megatron_searchr1.search import rerank
from megatron_searchr1.search.base import Retriever
from megatron_searchr1.search.batcher import BatchStats, MicroBatcher, SearchTimeout  # noqa: F401  (re-exported)
from megatron_searchr1.search.encoder import add_encoder_args, encoder_args_problem, encoder_options, set_cpu_threads
from megatron_searchr1.search.protocol import (  # noqa: F401  (re-exported: callers import them from server)
    RequestError, ServerConfig, parse_request, render_result,
)

logger = logging.getLogger("megatron_searchr1.search.server")

OPEN_MAX_CHARS = 20000
"""The most characters one /open call returns, whatever the request asks."""


class DocLookup:
    """Corpus rows by document id: the row number when the row holds that id (wiki-18, our corpora), else a map built
    once, on first need, under a lock (one pass over the corpus)."""

    def __init__(self, corpus):
        self.corpus, self._map, self._lock = corpus, None, threading.Lock()

    def row(self, doc_id: str):
        if doc_id.isdigit() and int(doc_id) < len(self.corpus) and str(self.corpus[int(doc_id)]["id"]) == doc_id:
            return int(doc_id)
        with self._lock:
            if self._map is None:
                self._map = {str(doc["id"]): i for i, doc in enumerate(self.corpus)}
        return self._map.get(doc_id)

    def window(self, args: dict, max_chars: int) -> str:
        """The text of one /open call (module doc)."""
        doc_id, offset = args.get("doc_id"), args.get("offset", 0)
        if isinstance(doc_id, int) and not isinstance(doc_id, bool):
            doc_id = str(doc_id)
        if not isinstance(doc_id, str) or not doc_id.strip():
            return "Error: doc_id must be the id a search result carried, e.g. \"7\""
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            return f"Error: offset must be a character position >= 0, got {json.dumps(offset)}"
        row = self.row(doc_id.strip())
        if row is None:
            return f"Error: no document with id {json.dumps(doc_id)}; open an id a search result carried"
        doc = self.corpus[row]
        text = doc.get("text", "")
        if offset and offset >= len(text):
            return f"Error: offset {offset} is past the end of document {doc['id']} ({len(text)} characters)"
        end = min(offset + max_chars, len(text))
        more = f"\n(continues: open it with offset {end})" if end < len(text) else ""
        return (f"Document {doc['id']} (Title: {doc.get('title', '')}), characters {offset}-{end} of {len(text)}:\n"
                f"{text[offset:end]}{more}")


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

    lookup = DocLookup(retriever.corpus)

    @app.post("/open")
    async def open_document(request: Request):
        body = await request.body()
        if len(body) > config.max_body_bytes:
            return too_big(str(len(body)))
        try:
            req = json.loads(body or b"{}")
            calls, max_chars = req["arguments"], req.get("max_chars", 1000)
            ok = (isinstance(calls, list) and all(isinstance(c, dict) for c in calls) and isinstance(max_chars, int)
                  and not isinstance(max_chars, bool) and max_chars >= 1)
        except (ValueError, KeyError, TypeError, AttributeError):
            ok = False
        if not ok:
            return JSONResponse({"detail": 'expected {"arguments": [{"doc_id": "7", "offset": 0}, ...], "max_chars": '
                                           'N >= 1}'}, status_code=400)
        if len(calls) > config.max_queries:
            return JSONResponse({"detail": f"{len(calls)} calls in one request, the limit is {config.max_queries} "
                                           "(server --max-queries); split the batch"}, status_code=400)
        max_chars = min(max_chars, OPEN_MAX_CHARS)
        # off the event loop: the first lookup of a non-row id reads the whole corpus once
        loop = asyncio.get_running_loop()
        results = await loop.run_in_executor(None, lambda: [lookup.window(c, max_chars) for c in calls])
        return JSONResponse({"results": results})

    return app


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0 = any free port), bound before the server starts so its URL is known."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP, and without it
    # Nagle + delayed ACK add ~40 ms to every response (tools/benchmarks/NOTES-retrieval-server.md).
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
    add_settings_flags(srv, ServerConfig)
    srv.add_argument("--query-cache-size", type=int, default=16384,
                     help="query embeddings kept in an LRU (GRPO repeats each question n times); 0 = off")
    srv.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    srv.add_argument("--access-log", action="store_true", help="log every request (noisy under load)")
    rt = p.add_argument_group("search runtime")
    rt.add_argument("--faiss-gpu", action="store_true", help="put a Flat faiss index on all GPUs (faiss-gpu)")
    rt.add_argument("--faiss-threads", type=int, default=0, help="faiss OpenMP threads; 0 = --torch-threads")
    rt.add_argument("--nprobe", type=int, default=None,
                    help="IVF lists visited per query (ivf_* indexes); default: the index's, else a quarter of its "
                         "lists, at least 16, at most 512 (recall holds as the corpus grows; /health shows it)")
    rt.add_argument("--ef-search", type=int, default=None, help="HNSW candidate list size (hnsw indexes)")
    rt.add_argument("--refine-k-factor", type=int, default=None,
                    help="re-score this many x topk candidates exactly from the stored vectors (0 = off; "
                         "needs an index built with refine vectors)")
    rt.add_argument("--refine-flat", metavar="FLAT_INDEX",
                    help="re-score candidates exactly from this faiss Flat (inner product) file of the same corpus "
                         "and encoder, e.g. e5_Flat.index, memory-mapped: nothing of it is read into RAM but the "
                         "candidates' rows (default refine: 4 x topk for lossy types; /health shows the source)")
    rt.add_argument("--bm25-mmap", action="store_true", help="memory-map the BM25 arrays (large corpora)")
    rt.add_argument("--faiss-mmap", action="store_true",
                    help="memory-map the faiss vectors instead of reading them into RAM (a 65 GB e5_Flat.index)")
    rerank.add_rerank_args(p)
    return p


def add_settings_flags(group, cls) -> None:
    """One `--field-name` flag per field of the dataclass `cls`: type and default from the field, help from its
    docstring, a lowest value from metadata["min"]. An Optional field's flag defaults to None (the dataclass
    resolves it)."""
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if typing.get_origin(kind) is typing.Union:  # Optional[X]
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        convert = at_least(f.metadata["min"], kind) if "min" in f.metadata else kind
        help_text = " ".join(docs.get(f.name, "").split()).replace("%", "%%")
        group.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=convert, default=f.default,
                           help=help_text or None)


def settings_from_args(args: argparse.Namespace, cls):
    """The dataclass `cls` from the flags `add_settings_flags` made."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def check_index_dir(index_dir: str, flag: str = "--index-dir") -> None:
    """UsageError unless `index_dir` holds an index; the message names the step that writes one, or the index
    folder(s) inside when the user passed their parent (`data/synthetic` instead of `data/synthetic/index_bm25`)."""
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


def check_index_contents(args) -> None:
    """Truncated index files (.npy headers against sizes, the bm25s JSON files) and a corpus cut mid-line: one
    line naming the file, before faiss, torch or the corpus load (seconds to minutes on wiki-18)."""
    from megatron_searchr1.search.retrievers import (IndexFileError, check_corpus_file, check_index_files,
                                                     read_index_meta)
    try:
        corpus, meta = args.corpus, None
        if args.index_dir:
            meta = read_index_meta(args.index_dir)
            check_index_files(args.index_dir, meta, refine_flat=args.refine_flat)
            if not corpus and isinstance(meta.get("corpus"), str):
                corpus = meta["corpus"] if os.path.isabs(meta["corpus"]) else os.path.join(args.index_dir,
                                                                                            meta["corpus"])
        if corpus and (os.path.isfile(corpus) or not args.corpus):  # a missing --corpus: check_args names the flag
            check_corpus_file(corpus, args.index_dir, meta)  # missing, cut short, or not the index's (fingerprint)
    except IndexFileError as e:
        raise UsageError(str(e)) from None


def check_args(args) -> None:
    """Mistakes in the flags, found before anything heavy loads (UsageError: one `error:` line, exit 2)."""
    if args.index_dir and args.faiss_index:
        raise UsageError("give either --index-dir or --faiss-index, not both")
    if not args.index_dir and not (args.faiss_index and args.corpus):
        raise UsageError("no index: pass --index-dir DIR, or --faiss-index FILE with --corpus FILE.jsonl")
    if args.index_dir:
        check_index_dir(args.index_dir)
        meta_path = os.path.join(args.index_dir, "index_meta.json")
        try:
            with open(meta_path) as f:
                json.load(f)
        except (ValueError, UnicodeDecodeError) as e:  # before faiss, torch and the corpus load
            raise UsageError(f"{meta_path} is damaged (not JSON: {e}): rebuild the index with "
                             f"tools/build_index.py --out-dir {args.index_dir}") from None
    check_index_contents(args)
    for flag, path in (("--faiss-index", args.faiss_index), ("--corpus", args.corpus),
                       ("--refine-flat", args.refine_flat)):
        if path and not os.path.isfile(path):
            raise UsageError(f"{flag} {path!r} is not a file")
    if args.refine_flat:
        from megatron_searchr1.search.dense import IndexFileError, flat_file_layout
        try:
            flat_file_layout(args.refine_flat)  # the header only: a wrong file is refused before anything loads
        except IndexFileError as e:
            raise UsageError(str(e)) from None
    if args.ef_search is not None and args.ef_search < 1:
        raise UsageError(f"--ef-search must be >= 1, got {args.ef_search}")
    if args.nprobe == 0:
        raise UsageError("--nprobe must be >= 1 (leave it out for the index's default)")
    if args.port > 65535:
        raise UsageError(f"--port must be at most 65535, got {args.port}")
    problem = encoder_args_problem(args)
    if problem:
        raise UsageError(problem)
    for flag in ("torch_threads", "faiss_threads", "query_cache_size", "nprobe", "refine_k_factor"):
        if (getattr(args, flag) or 0) < 0:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    problem = rerank.args_problem(args, *_index_encoder_and_kind(args))
    if problem:
        raise UsageError(problem)


def _index_encoder_and_kind(args) -> tuple[str | None, str | None]:
    """The served index's dense encoder model and kind, from index_meta.json (or the flags for --faiss-index)."""
    if args.faiss_index:
        return args.encoder, "dense"
    try:
        with open(os.path.join(args.index_dir, "index_meta.json")) as f:
            meta = json.load(f)
        return (meta.get("dense") or {}).get("encoder", {}).get("model"), meta.get("kind")
    except (OSError, ValueError, AttributeError):
        return None, None


def load_from_args(args) -> Retriever:
    from megatron_searchr1.search.retrievers import load_retriever, open_faiss_index

    runtime = {**encoder_options(args, runtime_only=True), "use_gpu": args.faiss_gpu,
               "num_threads": args.faiss_threads or None, "faiss_mmap": args.faiss_mmap or None,
               "query_cache_size": args.query_cache_size, "nprobe": args.nprobe, "hnsw_ef_search": args.ef_search,
               "refine_k_factor": args.refine_k_factor, "refine_flat": args.refine_flat}
    runtime = {k: v for k, v in runtime.items() if v is not None}
    if args.index_dir:
        retriever = load_retriever(args.index_dir, corpus_path=args.corpus, bm25_mmap=args.bm25_mmap, **runtime)
    else:
        # The same meta and loading code as register_faiss_index + load_retriever (the corpus offsets are cached
        # next to the corpus when its directory is writable, so wiki-18 is not rescanned on every start).
        index_fields = {k: v for k, v in encoder_options(args).items()
                        if k not in ("batch_size", "fp16", "device") and v is not None}
        retriever = open_faiss_index(args.faiss_index, args.corpus, runtime=runtime, **index_fields)
    config = rerank.config_from_args(args)
    if config is None:
        return retriever
    scorer = rerank.make_scorer(config, device=args.device, fp16=args.fp16, backend=args.encoder_backend)
    return rerank.RerankingRetriever(retriever, scorer, config)


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    check_args(args)
    try:
        config = settings_from_args(args, ServerConfig)
    except ValueError as e:
        raise UsageError(str(e)) from None
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    threads = set_cpu_threads(args.torch_threads)
    logger.info("%d CPU threads for the encoder and faiss (--torch-threads)", threads)
    from megatron_searchr1.search.retrievers import IndexFileError

    t0 = time.time()
    try:
        retriever = load_from_args(args)
    except IndexFileError as e:
        raise UsageError(str(e)) from None
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
