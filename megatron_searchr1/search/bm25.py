"""BM25 over the corpus with `bm25s` (sparse, pure numpy; saved and reloaded in bm25s's own format).

Search-R1's BM25 is Pyserini/Lucene over `contents` (title + text) with k1=0.9, b=0.4; we index the same text
with the same Lucene BM25 variant and parameters, and stem with Porter's stemmer as Pyserini/Anserini does by
default (PyStemmer, a core requirement: without stemming "founded" never matches "founding").
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from megatron_searchr1.search.base import Retriever, topk_desc


@dataclass
class BM25Config:
    """How the BM25 index is built and queries are tokenised (stored in index_meta.json)."""

    k1: float = 0.9
    """Term-frequency saturation (Pyserini's default, as Search-R1 uses)."""
    b: float = 0.4
    """Length normalisation (Pyserini's default)."""
    method: str = "lucene"
    """bm25s scoring variant: lucene | robertson | atire | bm25l | bm25+."""
    stopwords: str = "en"
    """Stopword list for bm25s's tokenizer ("en", another language code, or "" for none)."""
    stemmer: str = "porter"
    """PyStemmer algorithm ("porter", Anserini's default; "english" is Snowball/Porter2), or "" for none."""

    def __post_init__(self):
        if self.k1 < 0 or not 0 <= self.b <= 1:
            raise ValueError(f"BM25 needs k1 >= 0 and 0 <= b <= 1, got k1={self.k1}, b={self.b}")


def _make_stemmer(name: str):
    if not name:
        return None
    try:
        import Stemmer
    except ImportError:
        raise ImportError(f"BM25Config.stemmer={name!r} needs PyStemmer: pip install PyStemmer "
                          "(or set stemmer to \"\")") from None
    return Stemmer.Stemmer(name).stemWords


class BM25Retriever(Retriever):
    """Lexical retrieval. Build with `BM25Retriever.build(corpus)`, persist with `save`/`load`."""

    kind = "bm25"

    def __init__(self, corpus: Sequence[dict], model, config: BM25Config):
        import bm25s  # noqa: F401  (imported here so `import megatron_searchr1.search` stays light)

        self.corpus, self.model, self.config = corpus, model, config
        self._stem = _make_stemmer(config.stemmer)
        if model.scores["num_docs"] != len(corpus):
            raise ValueError(f"BM25 index has {model.scores['num_docs']} docs but the corpus has {len(corpus)}: "
                             "they were built from different files; rebuild the index or pass the right corpus")

    def _tokenize(self, texts: list[str], show_progress: bool = False) -> list[list[str]]:
        import bm25s

        return bm25s.tokenize(texts, stopwords=self.config.stopwords or None, stemmer=self._stem,
                              return_ids=False, show_progress=show_progress)

    @classmethod
    def build(cls, corpus: Sequence[dict], config: BM25Config | None = None,
              show_progress: bool = True) -> "BM25Retriever":
        import bm25s

        config = config or BM25Config()
        model = bm25s.BM25(k1=config.k1, b=config.b, method=config.method)
        texts = [doc["contents"] for doc in corpus]
        tokens = bm25s.tokenize(texts, stopwords=config.stopwords or None, stemmer=_make_stemmer(config.stemmer),
                                show_progress=show_progress)
        model.index(tokens, show_progress=show_progress)
        return cls(corpus, model, config)

    def save(self, out_dir: str | os.PathLike) -> dict:
        """Write the bm25s index files under `out_dir`; returns the index_meta.json entry."""
        self.model.save(os.fspath(out_dir), show_progress=False)
        return asdict(self.config)

    @classmethod
    def load(cls, index_dir: str | os.PathLike, corpus: Sequence[dict], config: BM25Config | None = None,
             mmap: bool = False) -> "BM25Retriever":
        import bm25s

        model = bm25s.BM25.load(os.fspath(index_dir), mmap=mmap, show_progress=False)
        return cls(corpus, model, config or BM25Config())

    def search_ids(self, queries: list[str], topk: int) -> tuple[np.ndarray, np.ndarray]:
        # Score every doc and take our own tie-stable top-k (bm25s's top-k orders ties arbitrarily).
        ids = np.empty((len(queries), topk), np.int64)
        scores = np.empty((len(queries), topk), np.float32)
        for row, tokens in enumerate(self._tokenize(queries)):
            if not tokens:  # empty or stopwords only: nothing can match
                ids[row], scores[row] = -1, 0.0
                continue
            all_scores = self.model.get_scores(tokens)  # (N,) ; unknown tokens are ignored
            # Like Lucene (Search-R1's BM25), a doc sharing no term with the query is not a hit. Ranking only the
            # matching docs also keeps a rare query cheap: over all N docs, fewer than topk matches make the k-th
            # score 0 and every zero-score doc a tie candidate (a 21M-doc sort for one query).
            hits = np.flatnonzero(all_scores > 0)  # (M,) ascending rows, so topk_desc's tie order is by row
            top, top_scores = topk_desc(all_scores[hits], topk)  # positions into hits; -1 pads
            n = min(topk, hits.size)  # the padding (-1) comes after the n real hits
            ids[row], scores[row] = -1, 0.0
            ids[row, :n], scores[row, :n] = hits[top[:n]], top_scores[:n]
        return ids, scores
