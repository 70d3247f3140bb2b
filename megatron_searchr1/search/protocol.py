"""The /retrieve protocol (Search-R1's), as pure functions: a request body in, (queries, topk, return_scores)
out; row ids and scores in, the response body out. No sockets, no threads: server.py serves them, batcher.py
batches them.

Request (Search-R1's):  {"queries": ["q1", ...], "topk": 3, "return_scores": true}
Response:  return_scores true  -> {"result": [[{"document": {"id": ..., "contents": ...}, "score": f}, ...], ...]}
           return_scores false -> {"result": [[{"id": ..., "contents": ...}, ...], ...]}
(Search-R1's own server crashes on return_scores=false; ours answers with the plain list of documents.)

A drop-in for Search-R1's trainer, which talks to it unchanged: `{"queries": []}` (a turn in which no sample
searched) answers `{"result": []}`; one request may carry a whole RL batch (train_batch_size 512 x n_agent 5 =
2,560 queries; the default limit is 4,096); `topk` is read as Search-R1's pydantic model reads it ("3" and 3.0 are 3;
0 or null mean the default), `return_scores` likewise (true/false, 1/0, "true"/"false").
Bad input gets a 4xx whose `detail` says what is wrong and what the limit is.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

DEFAULT_MAX_PENDING_QUERIES = 16384
"""max_pending_queries when not given (raised to max_queries when that is larger, so a full request fits)."""


@dataclass
class ServerConfig:
    """Limits and batching of the /retrieve endpoint; each field is also a server flag (`--max-topk` for
    max_topk; the field's docstring is its help, metadata["min"] its lowest value)."""

    host: str = "127.0.0.1"
    """Interface to listen on; 0.0.0.0 to serve other nodes of a multi-node run."""
    port: int = field(default=8000, metadata={"min": 0})
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
    max_pending_queries: Optional[int] = None
    """Most queries waiting or being searched at once; a request that would exceed it gets 429 (retry later).
    None = 16384, or max_queries when that is larger."""
    max_body_bytes: int = 64 * 1024 * 1024
    """Largest request body; a bigger one gets 413 before it is read (Content-Length) or as soon as it passes."""
    search_timeout_s: float = 300.0
    """A micro-batch's search that runs longer fails its requests with 503 and marks /health stalled; 0 = none."""

    def __post_init__(self):
        if self.max_pending_queries is None:
            self.max_pending_queries = max(DEFAULT_MAX_PENDING_QUERIES, self.max_queries)
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
    """Validate a /retrieve body into (queries, topk, return_scores) or raise RequestError.

    >>> parse_request(b'{"queries": ["who?"], "topk": "2"}', ServerConfig())
    (['who?'], 2, False)
    >>> parse_request(b'{"queries": [], "topk": null, "return_scores": 1}', ServerConfig())
    ([], 3, True)
    >>> for body in (b'{"queries": "who?"}', b'[1]', b'{"queries": ["q"], "topk": 101}', b'{"queries"'):
    ...     try:
    ...         parse_request(body, ServerConfig())
    ...     except RequestError as e:
    ...         print(e.status, str(e).split(" line ")[0])
    422 'queries' must be a list of strings, got str
    422 body must be a JSON object, got list
    422 'topk' is 101, the limit is 100
    400 malformed JSON body: Expecting ':' delimiter:
    """
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


def _response_doc(doc: dict) -> dict:
    return {"id": doc["id"], "contents": doc["contents"]}


def render_result(corpus, ids: np.ndarray, scores: np.ndarray, return_scores: bool) -> bytes:
    """The /retrieve response body for (B, k) row ids and scores, as JSON bytes (run off the event loop: for a
    2,560-query batch the documents and the JSON take as long as a MiniLM search). Row id -1 (faiss: fewer than
    k hits) is left out.

    >>> corpus = [{"id": "0", "contents": "Paris is in France.", "title": "unused"}]
    >>> render_result(corpus, np.array([[0, -1]]), np.array([[1.5, 0.0]]), True)
    b'{"result":[[{"document":{"id":"0","contents":"Paris is in France."},"score":1.5}]]}'
    >>> render_result(corpus, np.array([[0]]), np.array([[1.5]]), False)
    b'{"result":[[{"id":"0","contents":"Paris is in France."}]]}'
    """
    result = []
    for row_ids, row_scores in zip(ids, scores):
        docs = [(_response_doc(corpus[int(i)]), float(s)) for i, s in zip(row_ids, row_scores) if i >= 0]
        result.append([{"document": d, "score": s} for d, s in docs] if return_scores else [d for d, _ in docs])
    # the same bytes as FastAPI's JSONResponse
    return json.dumps({"result": result}, ensure_ascii=False, allow_nan=False, indent=None,
                      separators=(",", ":")).encode("utf-8")
