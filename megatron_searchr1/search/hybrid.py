"""Hybrid retrieval: BM25 and dense ranked lists merged by reciprocal-rank fusion (RRF).

RRF score of a doc = sum over rankers of 1 / (k + rank), rank starting at 1 (Cormack et al., 2009). It needs no
score calibration between BM25 (unbounded) and cosine similarity, which is why it is the usual hybrid baseline.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_searchr1.search.base import Retriever


@dataclass
class HybridConfig:
    """Reciprocal-rank-fusion settings."""

    rrf_k: float = 60.0
    """The k in 1 / (k + rank); 60 is the value from the RRF paper."""
    depth: int = 50
    """How many candidates each ranker contributes before fusion (at least topk)."""

    def __post_init__(self):
        if self.rrf_k <= 0 or self.depth < 1:
            raise ValueError(f"HybridConfig needs rrf_k > 0 and depth >= 1, got {self.rrf_k}, {self.depth}")


def reciprocal_rank_fusion(rankings: list[np.ndarray], topk: int, rrf_k: float = 60.0,
                           ) -> tuple[np.ndarray, np.ndarray]:
    """Fuse ranked id lists. rankings: each (B, K_i) int64, best first, -1 = no doc. Returns (B, topk) ids and
    (B, topk) float32 scores; ties go to the lower id; short rows pad with -1 / -inf.

    >>> ids, s = reciprocal_rank_fusion([np.array([[3, 1, 2]]), np.array([[1, 4, -1]])], topk=3, rrf_k=1.0)
    >>> ids.tolist(), [round(float(x), 3) for x in s[0]]
    ([[1, 3, 4]], [0.833, 0.5, 0.333])
    """
    batch = rankings[0].shape[0]
    out_ids = np.full((batch, topk), -1, np.int64)
    out_scores = np.full((batch, topk), -np.inf, np.float32)
    for b in range(batch):
        fused: dict[int, float] = {}
        for ranking in rankings:
            for rank, doc in enumerate(ranking[b], start=1):
                if doc >= 0:
                    fused[int(doc)] = fused.get(int(doc), 0.0) + 1.0 / (rrf_k + rank)
        best = sorted(fused.items(), key=lambda kv: (-kv[1], kv[0]))[:topk]
        for j, (doc, score) in enumerate(best):
            out_ids[b, j], out_scores[b, j] = doc, score
    return out_ids, out_scores


class HybridRetriever(Retriever):
    """BM25 + dense over the same corpus, fused with RRF. Scores are RRF scores (not BM25 or cosine)."""

    kind = "hybrid"

    def __init__(self, bm25: Retriever, dense: Retriever, config: HybridConfig | None = None):
        if len(bm25.corpus) != len(dense.corpus):
            raise ValueError(f"hybrid needs one corpus: BM25 has {len(bm25.corpus)} docs, dense "
                             f"{len(dense.corpus)}")
        self.bm25, self.dense, self.config = bm25, dense, config or HybridConfig()
        self.corpus = dense.corpus

    def search_ids(self, queries: list[str], topk: int) -> tuple[np.ndarray, np.ndarray]:
        depth = max(topk, self.config.depth)
        bm25_ids, _ = self.bm25.search_ids(queries, depth)
        dense_ids, _ = self.dense.search_ids(queries, depth)
        return reciprocal_rank_fusion([bm25_ids, dense_ids], topk, self.config.rrf_k)

    def describe(self) -> dict:
        return {**self.dense.describe(), "kind": self.kind, "rrf_k": self.config.rrf_k, "depth": self.config.depth}
