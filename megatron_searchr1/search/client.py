"""Client of the /retrieve server, as the rollout uses it: queries in, `<information>` texts out, never raising;
and the guard that decides, from the failures it counts, when a run must stop.

    client = RetrievalClient("http://127.0.0.1:8000", topk=3)
    observations = client.search(["who founded X?", "when was Y born?"])   # one string per query

One request carries the whole batch; a batch over the server's per-request limit (read once from /health) is split
into chunks sent concurrently. Against Search-R1's own server, which has no /health, the client remembers that
after the first 404 and sends every batch as one request: its endpoint shares one tokenizer between threads and
fails under concurrent requests. Connection errors, timeouts and 5xx are retried `max_retries` times with
exponential backoff; 429 (overloaded) is retried until `overload_deadline` seconds have passed, waiting at least the
server's Retry-After. If a chunk still fails (or the server rejects it with a 4xx), its queries get the text
"Search failed: <reason>" (a `SearchFailure`, so the rollout knows it failed without reading the text) and
`client.stats` counts it: `search` itself never raises. Whether a run may go on is `SearchGuard`'s question (the
share of failed searches per step, a circuit breaker over consecutive failed rounds); it raises `RetrievalDown`.
Results are formatted exactly like Search-R1's `_passages2string` (see `format_docs`), also those of its rerank
server, whose `document` is a plain string.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

logger = logging.getLogger(__name__)

DEFAULT_CHUNK = 64
"""Queries per request when the server's limit is unknown (its /health did not answer)."""


def format_docs(docs: list, with_ids: bool = False) -> str:
    """Search-R1's `_passages2string`: `Doc {i}(Title: {title}) {text}\\n` per doc, 1-based, concatenated.
    `with_ids`: `Doc {i}(id: {id}, Title: {title}) {text}`, the id a tool-calling policy opens the document by (the
    `open` tool; a doc without an id is written without one).

    The title is the first line of `contents` as it stands (FlashRAG titles keep their quotes), the text the rest.
    Accepts the server's items with or without scores ({"document": doc, "score": s} or doc), or
    (doc, score) pairs from `Retriever.search`; a doc without `contents` is rebuilt from title/text; a doc that
    is a plain string (Search-R1's rerank server: '"title"\\ntext') is the contents itself.

    >>> format_docs([{"document": {"id": "7", "contents": '"Paris"\\nCapital of France.\\nOn the Seine.'}}])
    'Doc 1(Title: "Paris") Capital of France.\\nOn the Seine.\\n'
    >>> format_docs([{"document": '"Paris"\\nCapital of France.', "score": 0.9}])
    'Doc 1(Title: "Paris") Capital of France.\\n'
    >>> format_docs([{"document": {"id": "7", "contents": '"Paris"\\nCapital of France.'}}], with_ids=True)
    'Doc 1(id: 7, Title: "Paris") Capital of France.\\n'
    """
    out = []
    for i, item in enumerate(docs, start=1):
        if isinstance(item, (tuple, list)):
            item = item[0]
        doc = item.get("document", item) if isinstance(item, dict) else item
        contents = doc if isinstance(doc, str) else doc.get("contents")
        if contents is None:
            contents = f'"{doc.get("title", "")}"\n{doc.get("text", "")}'
        lines = contents.split("\n")
        doc_id = doc.get("id") if with_ids and isinstance(doc, dict) else None
        where = f"id: {doc_id}, " if doc_id is not None else ""
        out.append(f"Doc {i}({where}Title: {lines[0]}) {chr(10).join(lines[1:])}\n")
    return "".join(out)


class SearchFailure(str):
    """The observation of a failed search. The text the model sees is "Search failed: <reason>", as before; the type
    is what the rollout (`finish_reason` search_error) and the SFT oracle (never trains on it) check.

    >>> obs = SearchFailure("HTTP 503: stalled")
    >>> obs, obs.reason, isinstance(obs, str)
    ('Search failed: HTTP 503: stalled', 'HTTP 503: stalled', True)
    >>> is_search_failure(obs), is_search_failure("Doc 1(Title: X) ...")
    (True, False)
    """

    reason: str

    def __new__(cls, reason: object) -> "SearchFailure":
        self = super().__new__(cls, f"Search failed: {reason}")
        self.reason = str(reason)
        return self

    def __getnewargs__(self):  # pickle rebuilds it from the reason, not from the full text
        return (self.reason,)


def is_search_failure(observation: str) -> bool:
    """True for the observation of a failed search (see SearchFailure)."""
    return isinstance(observation, SearchFailure)


class RetrievalError(Exception):
    """A request that failed for good (after retries, or rejected by the server)."""


class RetrievalDown(Exception):
    """The retrieval server is gone or hung: more than `max_error_rate` of a step's (or a validation's) searches
    failed, or the circuit breaker opened. Raised on every rank at once (the trainer's rollout worker decides over
    all ranks); the entry points turn it into one `error:` line and exit code 3."""

    def __init__(self, url: str, failed: int, searched: int, last_error: str, where: str, why: str):
        self.url, self.failed, self.searched, self.last_error = url, failed, searched, last_error
        super().__init__(f"the retrieval server at {url} failed {failed} of {searched} searches during {where} "
                         f"({why}); last error: {last_error}. Bring the server back and resume the run (the "
                         "trainer resumes from its last checkpoint); retrieval.max_error_rate and "
                         "retrieval.max_failed_rounds set when a run stops")


class SearchGuard:
    """A searcher (`RetrievalClient.search`) with failure counts and a circuit breaker.

        guard = SearchGuard(client.search, url, max_error_rate=0.2, max_failed_rounds=3)
        observations = guard(queries)                    # as client.search; counts searches and failures
        counts = guard.take()                            # (failed, searched, open, last_error) since the last take
        why = guard.verdict(failed, searched, opened)    # None, or why the run must stop

    A round is one call. After `max_failed_rounds` consecutive rounds in which every query failed the circuit
    opens: later calls fail at once ("not sent: ...") instead of waiting out more timeouts, so a rollout whose
    server died finishes quickly and the caller's check at the end of the step or validation stops the run. The
    breaker stays open for the rest of the run (the run stops at that check)."""

    def __init__(self, search, url: str, max_error_rate: float = 0.2, max_failed_rounds: int = 3):
        self.search, self.url = search, url
        self.max_error_rate, self.max_failed_rounds = max_error_rate, max_failed_rounds
        self.failed = self.searched = 0
        self.failed_rounds = 0  # consecutive rounds in which every query failed
        self.open = False
        self.last_error = ""

    def __call__(self, queries: list[str]) -> list[str]:
        if not queries:
            return []
        if self.open:
            results: list[str] = [SearchFailure(f"not sent: {self.failed_rounds} search rounds in a row failed "
                                                f"(last error: {self.last_error})")] * len(queries)
        else:
            results = self.search(queries)
        failures = [r for r in results if is_search_failure(r)]
        self.searched += len(results)
        self.failed += len(failures)
        if failures:
            self.last_error = self.last_error if self.open else failures[-1].reason
        if results and len(failures) == len(results):
            self.failed_rounds += 1
            self.open = self.open or self.failed_rounds >= self.max_failed_rounds
        elif not self.open:
            self.failed_rounds = 0
        return results

    def take(self) -> tuple[int, int, bool, str]:
        """(failed, searched, circuit open, last error) since the last `take`; the counts start again."""
        out = (self.failed, self.searched, self.open, self.last_error)
        self.failed = self.searched = 0
        return out

    def verdict(self, failed: int, searched: int, opened: bool) -> str | None:
        """Why the run must stop (the breaker opened, or the failed share is above max_error_rate), or None.

        >>> g = SearchGuard(None, "u", max_error_rate=0.2)
        >>> g.verdict(2, 10, False), g.verdict(3, 10, False)
        (None, 'more than retrieval.max_error_rate=0.2 failed')
        """
        if opened:
            return f"retrieval.max_failed_rounds={self.max_failed_rounds} search rounds in a row failed"
        if searched and failed / searched > self.max_error_rate:
            return f"more than retrieval.max_error_rate={self.max_error_rate:g} failed"
        return None

    def down(self, failed: int, searched: int, opened: bool, last_error: str, where: str) -> None:
        """Raise RetrievalDown when `verdict` says the run must stop."""
        why = self.verdict(failed, searched, opened)
        if why is not None:
            raise RetrievalDown(self.url, failed, searched, last_error or "none recorded", where, why)


@dataclass
class ClientStats:
    """Counters since the client was made (read `client.stats`; `as_dict()` for logging)."""

    requests: int = 0
    """HTTP POSTs sent, retries included."""
    retries: int = 0
    """POSTs that repeated a failed one."""
    errors: int = 0
    """Chunks that failed for good (their queries got an error observation)."""
    failed_queries: int = 0
    """Queries answered with an error observation."""
    queries: int = 0
    """Queries asked in total."""
    truncated_queries: int = 0
    """Queries cut to the server's max_query_chars before sending."""

    def as_dict(self) -> dict:
        return asdict(self)


class RetrievalClient:
    """Batched, chunked, retrying client. Thread-safe; reuse one per process (it keeps connections open).

    url: the server root ("http://host:8000") or Search-R1's full "http://host:8000/retrieve".
    timeout: seconds per HTTP request. max_retries: extra attempts after the first. backoff: first wait in
    seconds, doubled per retry up to max_backoff (with 10% jitter so many ranks do not retry in lockstep).
    max_queries_per_request: chunk size; None = the server's limit from /health (no /health: the whole batch).
    overload_deadline: seconds a chunk keeps retrying while the server answers 429 (busy, not broken).
    doc_ids: write each passage's document id into the observation (`format_docs(with_ids=True)`), for policies that
    open documents by id (the tool_calls protocol's `open` tool, served by the server's `/open`).
    """

    def __init__(self, url: str, topk: int = 3, timeout: float = 30.0, max_retries: int = 3, backoff: float = 0.5,
                 max_backoff: float = 8.0, max_queries_per_request: int | None = None, max_concurrency: int = 8,
                 overload_deadline: float = 300.0, doc_ids: bool = False):
        import httpx

        if topk < 1 or max_retries < 0 or timeout <= 0 or max_concurrency < 1:
            raise ValueError(f"bad RetrievalClient settings: topk={topk} (>=1), max_retries={max_retries} (>=0), "
                             f"timeout={timeout} (>0), max_concurrency={max_concurrency} (>=1)")
        base = url.rstrip("/")
        if base.endswith("/retrieve"):
            base = base[: -len("/retrieve")]
        self.base_url, self.topk, self.timeout = base, topk, timeout
        self.max_retries, self.backoff, self.max_backoff = max_retries, backoff, max_backoff
        self.max_queries_per_request, self.max_concurrency = max_queries_per_request, max_concurrency
        self.overload_deadline = overload_deadline
        self.doc_ids = doc_ids
        self.stats = ClientStats()
        self._lock = threading.Lock()
        self._http = httpx.Client(timeout=timeout,
                                  limits=httpx.Limits(max_connections=max_concurrency * 2,
                                                      max_keepalive_connections=max_concurrency))
        self._pool: ThreadPoolExecutor | None = None
        self._limits: dict | None = None  # the server's /health limits; {} once we know it has no /health
        self.has_health: bool | None = None
        """False once the server answered /health with 404/405 (Search-R1's server): it is not asked again."""

    # ---- public API -------------------------------------------------------------------------------------

    def search(self, queries: list[str]) -> list[str]:
        """One observation text per query: formatted docs, or a SearchFailure ("Search failed: <reason>"). Never
        raises."""
        if not queries:
            return []
        results: list[str] = [""] * len(queries)
        failed = 0  # queries already counted as failed, so the catch-all below does not count them twice
        try:
            chunks = self._chunks(list(queries))
            outcomes = self._map(lambda c: self._post_chunk(c, self.topk, True), chunks)
            for (start, chunk), outcome in zip(chunks, outcomes):
                if not isinstance(outcome, Exception):
                    try:  # a malformed item fails its own chunk only, not the chunks around it
                        texts = [format_docs(docs, self.doc_ids) for docs in outcome]
                    except Exception as e:  # noqa: BLE001 - any shape the server may send
                        outcome = RetrievalError(f"malformed result item: {type(e).__name__}: {e}")
                if isinstance(outcome, Exception):
                    self._count(errors=1, failed_queries=len(chunk))
                    failed += len(chunk)
                    logger.warning("retrieval failed for %d queries: %s", len(chunk), outcome)
                    texts = [SearchFailure(outcome)] * len(chunk)
                results[start:start + len(chunk)] = texts
        except Exception as e:  # noqa: BLE001 - a bug here must not kill a training run either
            logger.exception("retrieval client error")
            self._count(errors=1, failed_queries=len(queries) - failed)
            return [SearchFailure(f"{type(e).__name__}: {e}")] * len(queries)
        return results

    def retrieve(self, queries: list[str], topk: int | None = None, return_scores: bool = True) -> list[list[dict]]:
        """The server's raw result lists (one per query); raises RetrievalError when any chunk fails."""
        if not queries:
            return []
        chunks = self._chunks(list(queries))
        outcomes = self._map(lambda c: self._post_chunk(c, topk or self.topk, return_scores), chunks)
        result: list[list[dict]] = []
        for (_, chunk), outcome in zip(chunks, outcomes):
            if isinstance(outcome, Exception):
                self._count(errors=1, failed_queries=len(chunk))
                raise outcome
            result.extend(outcome)
        return result

    def health(self) -> dict:
        """The server's /health (raises on failure)."""
        r = self._http.get(f"{self.base_url}/health", timeout=min(self.timeout, 5.0))
        r.raise_for_status()
        return r.json()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- internals --------------------------------------------------------------------------------------

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)

    def _server_limits(self) -> dict:
        if self._limits is None:
            import httpx

            try:
                self._limits = self.health().get("limits", {})
                self.has_health = True
            except httpx.HTTPStatusError as e:
                if e.response.status_code in (404, 405):  # a server without /health: remember, never ask again
                    self.has_health, self._limits = False, {}
                return {}  # 503 (stalled) and the like: ask again next time
            except Exception:  # noqa: BLE001 - unreachable for now: fall back to defaults, ask again next time
                return {}
        return self._limits

    def _chunks(self, queries: list[str]) -> list[tuple[int, list[str]]]:
        limits = self._server_limits()
        self._count(queries=len(queries))
        max_chars = limits.get("max_query_chars")
        if max_chars:
            # A runaway generated query would get the whole chunk rejected; the encoder truncates anyway.
            long = sum(len(q) > max_chars for q in queries)
            if long:
                self._count(truncated_queries=long)
                queries = [q[:max_chars] for q in queries]
        # Search-R1's server (no /health) takes any batch in one request and breaks under concurrent ones.
        whole = len(queries) if self.has_health is False else DEFAULT_CHUNK
        size = self.max_queries_per_request or limits.get("max_queries") or whole
        return [(s, queries[s:s + size]) for s in range(0, len(queries), max(size, 1))]

    def _map(self, fn, chunks: list[tuple[int, list[str]]]) -> list:
        def safe(chunk):
            try:
                return fn(chunk[1])
            except Exception as e:  # noqa: BLE001 - returned, so other chunks still complete
                return e if isinstance(e, RetrievalError) else RetrievalError(f"{type(e).__name__}: {e}")

        if len(chunks) == 1:
            return [safe(chunks[0])]
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="retrieval-client")
        return list(self._pool.map(safe, chunks))

    def _post_chunk(self, queries: list[str], topk: int, return_scores: bool) -> list[list[dict]]:
        import httpx

        payload = {"queries": queries, "topk": topk, "return_scores": return_scores}
        attempt = 0  # failed attempts other than 429; a 429 is retried until the overload deadline instead
        overloaded_until = None
        while True:
            self._count(requests=1)
            retryable, reason, wait = False, "", None
            try:
                r = self._http.post(f"{self.base_url}/retrieve", json=payload)
                if r.status_code == 200:
                    return self._check(r.json(), len(queries))
                reason = f"HTTP {r.status_code}: {_detail(r)}"
                if r.status_code == 429:
                    now = time.monotonic()
                    overloaded_until = overloaded_until or now + self.overload_deadline
                    if now < overloaded_until:
                        wait = min(max(_retry_after(r), self.backoff), overloaded_until - now)
                retryable = r.status_code >= 500
            except httpx.TimeoutException as e:
                retryable, reason = True, f"timeout after {self.timeout}s ({type(e).__name__})"
            except httpx.TransportError as e:
                retryable, reason = True, f"{type(e).__name__}: {e} (is the retrieval server at {self.base_url} up?)"
            if wait is None:
                if not retryable or attempt >= self.max_retries:
                    tries = f" after {attempt + 1} attempts" if attempt else ""
                    late = f" (overloaded for {self.overload_deadline:g}s)" if overloaded_until else ""
                    raise RetrievalError(f"{reason}{tries}{late}")
                wait = min(self.max_backoff, self.backoff * (2 ** attempt)) * (1 + 0.1 * random.random())
                attempt += 1
            self._count(retries=1)
            time.sleep(wait)

    @staticmethod
    def _check(body, n: int) -> list[list[dict]]:
        result = body.get("result") if isinstance(body, dict) else None
        if not isinstance(result, list) or len(result) != n or not all(isinstance(x, list) for x in result):
            raise RetrievalError(f"malformed response: expected {{'result': [...{n} lists...]}}, "
                                 f"got {str(body)[:200]}")
        return result


def _retry_after(response) -> float:
    """Seconds the server asked us to wait (Retry-After in seconds; an HTTP date or nothing counts as 1)."""
    try:
        return max(0.0, float(response.headers.get("retry-after", "1")))
    except ValueError:
        return 1.0


def _detail(response) -> str:
    try:
        return str(response.json().get("detail", response.text))[:500]
    except Exception:  # noqa: BLE001 - not JSON
        return response.text[:500]
