"""What every retriever shares: row-number search (`search_ids`) and docs-with-scores search (`search`).

Retrievers work in corpus row numbers; the doc dicts come from the corpus only at the end. Top-k results are
ordered by score, ties broken by the lower row number, so a query gives the same answer alone or in a batch and
for any k (the server relies on this when it micro-batches requests together).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def topk_desc(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k of a 1-D score array, best first, ties broken by the lower index; (k,) ids and (k,) scores.

    k larger than the array pads with id -1 and score -inf.

    >>> topk_desc(np.array([0.5, 2.0, 0.5, 1.0]), 3)
    (array([1, 3, 0]), array([2. , 1. , 0.5]))
    """
    n = scores.shape[0]
    kk = min(k, n)
    if kk == 0:
        ids = np.empty(0, np.int64)
    else:
        if kk < n:
            part = np.argpartition(-scores, kk - 1)[:kk]
            cand = np.flatnonzero(scores >= scores[part].min())  # every doc tied with the k-th best
        else:
            cand = np.arange(n)
        order = np.lexsort((cand, -scores[cand]))  # primary key: score desc; secondary: row asc
        ids = cand[order[:kk]].astype(np.int64)
    out_scores = scores[ids].astype(np.float64)
    if kk < k:
        ids = np.concatenate([ids, np.full(k - kk, -1, np.int64)])
        out_scores = np.concatenate([out_scores, np.full(k - kk, -np.inf)])
    return ids, out_scores


class Retriever:
    """Base class. Subclasses set `self.corpus` (a sequence of doc dicts) and implement `search_ids`."""

    kind: str = "base"
    corpus: Sequence[dict]

    def search_ids(self, queries: list[str], topk: int) -> tuple[np.ndarray, np.ndarray]:
        """Row numbers (B, topk) int64 and scores (B, topk) float32, best first; -1 pads a short result."""
        raise NotImplementedError

    def search(self, queries: list[str], topk: int) -> list[list[tuple[dict, float]]]:
        """For each query, up to `topk` (doc, score) pairs, best first; doc has id/title/text/contents."""
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        if not queries:
            return []
        ids, scores = self.search_ids(list(queries), topk)
        return [[(self.corpus[int(i)], float(s)) for i, s in zip(row_ids, row_scores) if i >= 0]
                for row_ids, row_scores in zip(ids, scores)]

    def __len__(self) -> int:
        return len(self.corpus)

    def describe(self) -> dict:
        """A JSON-able summary for /health and logs."""
        return {"kind": self.kind, "num_docs": len(self.corpus)}
