"""The rerank stage: retrieve N candidates per query, re-score every (query, candidate) pair, return the best k.

    python -m megatron_searchr1.search.server --faiss-index e5_Flat.index --corpus wiki-18.jsonl \
        --encoder /models/e5-base-v2 --rerank cross --rerank-model /models/ms-marco-MiniLM-L12-v2 \
        --rerank-candidates 10 --default-topk 3             # Search-R1's retrieve-then-rerank setup
    python -m megatron_searchr1.search.server --index-dir idx/bm25 --rerank dense    # MiniLM re-scores BM25's top 50

Two scorers, one contract (`score(queries, ids, corpus) -> (U, N) scores`):
  cross  a sequence-classification model (any sentence-transformers CrossEncoder or transformers
         `*ForSequenceClassification` directory) reads query and passage together; its logit is the score.
         sentence-transformers puts a sigmoid on a one-label logit: the same order, so the logit is returned.
  dense  a bi-encoder (by default the packaged MiniLM) embeds the query and each candidate; the score is their inner
         product. It turns a BM25 index into a dense-quality ranking without a dense index of the whole corpus.

Why a stage of its own rather than a retriever kind: it wraps whatever the index serves (BM25, any faiss type,
hybrid), so the candidates come from the index a user already has and only N x queries pairs are scored.

What it promises: the returned order is the scorer's, ties broken by the lower corpus row (as every retriever here),
and it does not depend on how pairs were batched beyond float rounding (pairs are length-sorted into batches of
`batch_size`, padded to their batch's longest). Repeated queries in a call are scored once. What it refuses: a
cross model that is not a sequence classifier, a dense model that is one, fewer candidates than the default top-k,
and a dense re-score of a dense index with its own encoder (the same scores again); each is one `error:` line
from `args_problem` before torch loads.

Search-R1's own reranker formats a passage as "(Title: <first line of contents>) <rest>"; the cross scorer feeds
the same string, so a cross-encoder scores what it scores there.
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron_searchr1.search.base import Retriever
from megatron_searchr1.search.encoder import PACKAGED_MINILM, resolve_model_dir

MODES = ("cross", "dense")


@dataclass
class RerankConfig:
    """The rerank stage's settings (the server's --rerank* flags)."""

    mode: str
    """cross (a sequence-classification model reads each pair) | dense (a bi-encoder's inner product)."""
    model: str = ""
    """Model directory; "" = the packaged MiniLM for dense (cross has no default)."""
    candidates: int = 50
    """Passages retrieved per query before re-scoring (at least the request's topk are retrieved)."""
    batch_size: int = 32
    """(query, passage) pairs per forward pass (cross), passages per forward pass (dense)."""
    max_length: int = 512
    """Token limit of a (query, passage) pair for cross (Search-R1's reranker uses 512)."""

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"RerankConfig.mode must be one of {MODES}, got {self.mode!r}")
        if min(self.candidates, self.batch_size, self.max_length) < 1:
            raise ValueError(f"RerankConfig candidates, batch_size and max_length must be >= 1, got "
                             f"{self.candidates}, {self.batch_size}, {self.max_length}")
        if self.mode == "cross" and not self.model:
            raise ValueError("a cross reranker needs a model directory (RerankConfig.model)")


def add_rerank_args(parser) -> None:
    g = parser.add_argument_group("rerank (retrieve --rerank-candidates, re-score them, return topk)")
    g.add_argument("--rerank", choices=MODES, default=None,
                   help="cross: a sequence-classification model scores each (query, passage) pair; dense: a "
                        "bi-encoder re-scores the candidates (a BM25 index's, typically). Off by default")
    g.add_argument("--rerank-model", default=None,
                   help="model directory: a sentence-transformers CrossEncoder / transformers "
                        "*ForSequenceClassification (cross), or an embedding model (dense; default: the packaged "
                        "MiniLM)")
    g.add_argument("--rerank-candidates", type=int, default=None,
                   help="passages retrieved per query and re-scored (default 50; Search-R1's setup: 10)")
    g.add_argument("--rerank-batch-size", type=int, default=None, help="pairs per forward pass (default 32)")
    g.add_argument("--rerank-max-length", type=int, default=None,
                   help="token limit of a (query, passage) pair, cross only (default 512)")


def _architectures(model_dir: str) -> list[str] | None:
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            return list(json.load(f).get("architectures") or [])
    except (OSError, ValueError):
        return None


def args_problem(args, index_encoder: str | None = None, index_kind: str | None = None) -> str | None:
    """What is wrong with the --rerank* flags, or None; cheap (reads a config.json at most), so the server says it
    before torch, faiss or the corpus load. index_kind / index_encoder: the served index's kind and encoder model
    (None when unknown), to refuse a dense re-score that would repeat the index's own scores."""
    flags = {"--rerank-model": args.rerank_model, "--rerank-candidates": args.rerank_candidates,
             "--rerank-batch-size": args.rerank_batch_size, "--rerank-max-length": args.rerank_max_length}
    if args.rerank is None:
        given = [flag for flag, value in flags.items() if value is not None]
        return f"{given[0]} needs --rerank cross or --rerank dense" if given else None
    for flag, value in list(flags.items())[1:]:
        if value is not None and value < 1:
            return f"{flag} must be >= 1, got {value}"
    if args.rerank_max_length is not None and args.rerank == "dense":
        return "--rerank-max-length applies to --rerank cross; a dense reranker truncates at the encoder's " \
               "--max-length (drop --rerank-max-length)"
    candidates = args.rerank_candidates or RerankConfig.candidates
    topk = getattr(args, "default_topk", 1)
    if candidates < topk:
        return f"--rerank-candidates {candidates} is below --default-topk {topk}: the reranker would have " \
               f"nothing to choose from; pass at least {topk} (Search-R1's setup: 10 candidates, top-3)"
    if args.rerank == "cross" and not args.rerank_model:
        return "--rerank cross needs --rerank-model DIR (a cross-encoder such as ms-marco-MiniLM-L12-v2, as a " \
               "local directory)"
    model = args.rerank_model or PACKAGED_MINILM
    if model == PACKAGED_MINILM:
        try:
            model_dir = resolve_model_dir(model)
        except FileNotFoundError as e:
            return str(e)
    else:
        model_dir = model
        if not os.path.isdir(model_dir):
            return f"--rerank-model {model_dir!r} is not a directory: pass a local model directory"
    archs = _architectures(model_dir)
    if archs is None:
        return f"--rerank-model {model_dir!r} has no readable config.json: pass a transformers model directory"
    classifier = any(a.endswith("ForSequenceClassification") for a in archs)
    if args.rerank == "cross" and not classifier:
        return (f"--rerank-model {model_dir!r} is not a sequence-classification model (architectures {archs}): a "
                f"cross reranker needs a cross-encoder; to re-score with an embedding model use --rerank dense")
    if args.rerank == "dense" and classifier:
        return (f"--rerank-model {model_dir!r} is a sequence-classification model ({archs[0]}): use it with "
                f"--rerank cross; --rerank dense needs an embedding model")
    if args.rerank == "dense" and index_kind == "dense" and index_encoder is not None and \
            os.path.realpath(resolve_model_dir(index_encoder)) == os.path.realpath(model_dir):
        return ("--rerank dense with the encoder the dense index was built with gives the index's own scores "
                "again: rerank a bm25 or hybrid index, pass another --rerank-model, or use --rerank cross")
    return None


def config_from_args(args) -> RerankConfig | None:
    if args.rerank is None:
        return None
    given = {"candidates": args.rerank_candidates, "batch_size": args.rerank_batch_size,
             "max_length": args.rerank_max_length}
    return RerankConfig(mode=args.rerank, model=args.rerank_model or "",
                        **{k: v for k, v in given.items() if v is not None})


def passage_text(doc: dict) -> str:
    """A passage as Search-R1's reranker shows it to a cross-encoder: "(Title: <first line>) <the rest>".

    >>> passage_text({"contents": '"Paris"\\nParis is the capital of France.'})
    '(Title: "Paris") Paris is the capital of France.'
    """
    title, _, text = doc["contents"].partition("\n")
    return f"(Title: {title}) {text}"


def _device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"rerank device {device!r} requested but CUDA is not available; use --device cpu")
    return device


class CrossEncoderScorer:
    """A sequence-classification model over (query, passage) pairs; score = its logit (one label) or the
    positive-minus-negative logit (two labels: the log-odds, the order of the softmax's positive probability)."""

    def __init__(self, model_dir: str, batch_size: int = 32, max_length: int = 512, device: str = "auto",
                 fp16: bool | None = None):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.device = _device(device)
        self.fp16 = (self.device.startswith("cuda") if fp16 is None else fp16) and self.device.startswith("cuda")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForSequenceClassification.from_pretrained(model_dir)
        self.num_labels = int(model.config.num_labels)
        if self.num_labels not in (1, 2):
            raise ValueError(f"{model_dir} has {self.num_labels} labels; a reranker needs 1 (a relevance logit) "
                             f"or 2 (not relevant / relevant)")
        self.model = (model.half() if self.fp16 else model.float()).to(self.device).eval()
        self.model_dir, self.batch_size, self.max_length = model_dir, batch_size, max_length
        self.forward_batches = 0
        self._lock = threading.Lock()

    def score_pairs(self, queries: list[str], passages: list[str]) -> np.ndarray:
        """(P,) float32 scores of the pairs (queries[i], passages[i]), in length-sorted batches of `batch_size`."""
        import torch

        if not queries:
            return np.empty(0, np.float32)
        with self._lock:
            enc = self.tokenizer(queries, passages, padding=False, truncation=True, max_length=self.max_length)
            names = [k for k in enc.keys() if k in self.tokenizer.model_input_names]
        ids = enc["input_ids"]
        out = np.empty(len(ids), np.float32)
        order = np.argsort([len(x) for x in ids], kind="stable")
        pad_id = self.tokenizer.pad_token_id or 0
        with self._lock, torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                rows = order[start:start + self.batch_size]
                width = max(len(ids[i]) for i in rows)
                batch = {}
                for key in names:
                    arr = np.full((len(rows), width), pad_id if key == "input_ids" else 0, np.int64)
                    for j, i in enumerate(rows):
                        arr[j, :len(enc[key][i])] = enc[key][i]
                    batch[key] = torch.from_numpy(arr).to(self.device)
                logits = self.model(**batch).logits.float()  # (b, num_labels)
                score = logits[:, 0] if self.num_labels == 1 else logits[:, 1] - logits[:, 0]
                out[rows] = score.cpu().numpy()
                self.forward_batches += 1
        return out

    def score(self, queries: list[str], ids: np.ndarray, corpus: Sequence[dict]) -> np.ndarray:
        """(U, N) scores of queries[u] with corpus rows ids[u] (-1 = no candidate: -inf)."""
        valid = ids >= 0  # (U, N)
        us, js = np.nonzero(valid)
        scores = np.full(ids.shape, -np.inf, np.float32)
        scores[us, js] = self.score_pairs([queries[u] for u in us],
                                          [passage_text(corpus[int(ids[u, j])]) for u, j in zip(us, js)])
        return scores

    def describe(self) -> dict:
        return {"model": self.model_dir, "device": self.device, "fp16": self.fp16, "num_labels": self.num_labels,
                "forward_batches": self.forward_batches}


class DenseScorer:
    """A bi-encoder's inner product of the query with each candidate passage's `contents` (what an index build
    encodes). Each distinct candidate of a call is encoded once; queries go through the encoder's LRU."""

    def __init__(self, encoder):
        self.encoder = encoder
        self.passages_encoded = 0

    def score(self, queries: list[str], ids: np.ndarray, corpus: Sequence[dict]) -> np.ndarray:
        rows = np.unique(ids[ids >= 0])  # (R,) sorted
        if len(rows) == 0:
            return np.full(ids.shape, -np.inf, np.float32)
        q, inverse = self.encoder.encode_unique_queries(queries)  # (Q, H)
        q = q[inverse]  # (U, H)
        p = self.encoder.encode([corpus[int(r)]["contents"] for r in rows], is_query=False)  # (R, H)
        self.passages_encoded += len(rows)
        cand = p[np.searchsorted(rows, np.where(ids >= 0, ids, rows[0]))]  # (U, N, H)
        scores = np.einsum("unh,uh->un", cand, q).astype(np.float32)
        scores[ids < 0] = -np.inf
        return scores

    def describe(self) -> dict:
        return {"model": self.encoder.config.model, "encoder_backend": self.encoder.backend,
                "passages_encoded": self.passages_encoded}


def make_scorer(config: RerankConfig, device: str = "auto", fp16: bool | None = None, backend: str | None = None):
    """The scorer a RerankConfig asks for (loads the model)."""
    if config.mode == "cross":
        return CrossEncoderScorer(config.model, config.batch_size, config.max_length, device, fp16)
    from megatron_searchr1.search.encoder import Encoder, EncoderConfig

    options = {"device": device, "fp16": fp16, "backend": backend}
    enc = EncoderConfig(model=config.model or PACKAGED_MINILM, batch_size=config.batch_size,
                        **{k: v for k, v in options.items() if v is not None})
    return DenseScorer(Encoder(enc, query_cache_size=16384))


class RerankingRetriever(Retriever):
    """`base` retrieves max(candidates, topk) rows per query; `scorer` re-scores them; the best topk are returned,
    ties broken by the lower row. Scores are the scorer's (a logit, or an inner product), not the base's."""

    def __init__(self, base: Retriever, scorer, config: RerankConfig):
        self.base, self.scorer, self.config = base, scorer, config
        self.corpus = base.corpus
        self.kind = base.kind
        self.calls = self.queries = self.unique_queries = self.pairs = 0
        self.retrieve_seconds = self.rerank_seconds = 0.0
        self._stats_lock = threading.Lock()

    def search_ids(self, queries: list[str], topk: int) -> tuple[np.ndarray, np.ndarray]:
        position: dict[str, int] = {}
        inverse = np.fromiter((position.setdefault(q, len(position)) for q in queries), np.int64, len(queries))
        unique = list(position)
        t0 = time.perf_counter()
        cand, _ = self.base.search_ids(unique, max(self.config.candidates, topk))  # (U, N)
        t1 = time.perf_counter()
        scores = self.scorer.score(unique, cand, self.corpus)  # (U, N), -inf where cand is -1
        order = np.lexsort((np.where(cand >= 0, cand, np.iinfo(np.int64).max), -scores))[:, :topk]  # (U, k)
        ids = np.take_along_axis(cand, order, 1)
        best = np.take_along_axis(scores, order, 1)
        if ids.shape[1] < topk:  # the base returned fewer columns than asked: pad as every retriever does
            pad = topk - ids.shape[1]
            ids = np.pad(ids, ((0, 0), (0, pad)), constant_values=-1)
            best = np.pad(best, ((0, 0), (0, pad)), constant_values=-np.inf)
        t2 = time.perf_counter()
        with self._stats_lock:
            self.calls += 1
            self.queries += len(queries)
            self.unique_queries += len(unique)
            self.pairs += int((cand >= 0).sum())
            self.retrieve_seconds += t1 - t0
            self.rerank_seconds += t2 - t1
        return ids[inverse].astype(np.int64), best[inverse].astype(np.float32)

    def describe(self) -> dict:
        with self._stats_lock:
            stats = {"mode": self.config.mode, "candidates": self.config.candidates,
                     "batch_size": self.config.batch_size, "calls": self.calls, "queries": self.queries,
                     "unique_queries": self.unique_queries, "pairs_scored": self.pairs,
                     "retrieve_seconds": round(self.retrieve_seconds, 4),
                     "rerank_seconds": round(self.rerank_seconds, 4),
                     "rerank_ms_per_pair": round(1000 * self.rerank_seconds / self.pairs, 4) if self.pairs else 0.0}
        return {**self.base.describe(), "rerank": {**stats, **self.scorer.describe()}}
