# python tools/build_index.py --corpus corpus.jsonl --out-dir index/bm25 --kind bm25   (--help for dense/hybrid)
"""Build a retrieval index directory (BM25, dense or hybrid) from a corpus JSONL; see
megatron_searchr1/search/build_index.py for the options and examples."""
from megatron_searchr1.cli import run_main
from megatron_searchr1.search.build_index import main

if __name__ == "__main__":
    raise SystemExit(run_main(main))
