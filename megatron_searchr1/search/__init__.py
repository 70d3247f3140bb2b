"""Retrieval service: corpus, BM25 / dense / hybrid retrievers, the /retrieve server and its client.

Heavy dependencies (torch, transformers, faiss, bm25s, fastapi) are imported only when used.
"""
from megatron_searchr1.search.corpus import load_corpus, open_corpus, write_corpus
from megatron_searchr1.search.retrievers import (
    BM25Retriever,
    DenseRetriever,
    HybridRetriever,
    Retriever,
    index_corpus,
    load_retriever,
    register_faiss_index,
)

__all__ = ["load_corpus", "open_corpus", "write_corpus", "BM25Retriever", "DenseRetriever", "HybridRetriever",
           "Retriever", "index_corpus", "load_retriever", "register_faiss_index"]
