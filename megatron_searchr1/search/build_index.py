r"""CLI: build a retrieval index directory from a corpus JSONL, or register an existing faiss index.

    python tools/build_index.py --corpus corpus.jsonl --out-dir index/bm25 --kind bm25
    python tools/build_index.py --corpus corpus.jsonl --out-dir index/dense --kind dense          # packaged MiniLM
    python tools/build_index.py --corpus wiki-18.jsonl --out-dir index/e5 --kind dense \
        --encoder /models/e5-base-v2 --index-type flat --encoder-batch-size 512 --fp16      # Search-R1's e5 setup, on a GPU
    python tools/build_index.py --corpus wiki-18.jsonl --out-dir index/e5 \
        --faiss-index e5_Flat.index --encoder /models/e5-base-v2    # reuse Search-R1's index: no encoding at all
    python tools/build_index.py --corpus wiki-18.jsonl --out-dir index/pq --kind dense --index-type ivf_pq \
        --encoder /models/e5-base-v2       # compressed: ~200 bytes per passage + memory-mapped refine vectors
    python tools/build_index.py --corpus wiki-18.jsonl --out-dir index/sq6 --kind dense --index-type sq6 \
        --from-flat e5_Flat.index --encoder /models/e5-base-v2   # from e5_Flat.index's vectors: no encoding, and
                                                                # exact re-scoring from that file, memory-mapped
Then: python -m megatron_searchr1.search.server --index-dir index/bm25
"""
from __future__ import annotations

import json
import logging
import os
import time

from megatron_searchr1.cli import ArgumentParser, UsageError, console, run_main
from megatron_searchr1.search.encoder import add_encoder_args, encoder_args_problem, encoder_options

KINDS = ("bm25", "dense", "hybrid")  # = retrievers.KINDS, repeated so --help needs no faiss/bm25s import
# = dense.FACTORY, written out for --help (tests/search check the two agree). N passages, d dims.
INDEX_TYPE_HELP = """faiss index, by its index_factory string (inner product). flat: "Flat" (exact, 4d bytes per
passage, Search-R1's e5_Flat.index); fp16: "SQfp16" (2d); sq8: "SQ8" (d); sq6: "SQ6" (3d/4);
hnsw: "HNSW{hnsw_m},Flat" (4d + graph); ivf_flat: "IVF{nlist},Flat"; ivf_sq8: "IVF{nlist},SQ8";
ivf_pq: "IVF{nlist},PQ{pq_m}x{pq_nbits}" (pq_m bytes); opq_ivf_pq: "OPQ{pq_m},IVF{nlist},PQ{pq_m}x{pq_nbits}". Defaults follow N: nlist = min(4 sqrt(N), N/39),
pq_m = d/4, pq_nbits = 8 (fewer under 256 passages), training sample = min(N, max(40 nlist, 10000)); the server
probes nlist/4 lists (16 to 512) unless --nprobe is given.
ivf_pq / opq_ivf_pq also keep fp16 vectors (dense.vectors.npy, memory-mapped by the server) to re-score
4 x topk candidates exactly; with --from-flat every lossy type re-scores from the Flat file instead."""


def build_arg_parser() -> ArgumentParser:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True, help="corpus JSONL ({id, contents} or {id, title, text} per line)")
    p.add_argument("--out-dir", required=True, help="index directory to write (index_meta.json + index files); "
                                                    "an interrupted dense build resumes from its dense_shards/")
    p.add_argument("--kind", choices=KINDS, default="bm25")
    p.add_argument("--copy-corpus", action="store_true", help="copy the corpus into --out-dir (movable index)")
    p.add_argument("--faiss-index", help="register this existing faiss index instead of encoding (kind dense)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_encoder_args(p)
    f = p.add_argument_group("faiss")
    f.add_argument("--index-type", choices=["flat", "fp16", "sq8", "sq6", "hnsw", "ivf_flat", "ivf_sq8", "ivf_pq",
                                            "opq_ivf_pq"], default="flat", help=INDEX_TYPE_HELP.replace("%", "%%"))
    f.add_argument("--hnsw-m", type=int, default=32)
    f.add_argument("--hnsw-ef-construction", type=int, default=200)
    f.add_argument("--hnsw-ef-search", type=int, default=128)
    f.add_argument("--nlist", type=int, default=0, help="IVF lists (0 = from the corpus size)")
    f.add_argument("--pq-m", type=int, default=0, help="PQ bytes per passage; divides the dim (0 = dim/4)")
    f.add_argument("--pq-nbits", type=int, default=0, help="bits per PQ code (0 = 8, fewer on small corpora)")
    f.add_argument("--train-size", type=int, default=0, help="passages sampled to train IVF/PQ/SQ (0 = auto)")
    f.add_argument("--refine-k-factor", type=int, default=-1,
                   help="keep exact vectors to re-score this many x topk candidates (0 = off, -1 = 4 for PQ types, "
                        "and for every lossy type with --from-flat)")
    f.add_argument("--from-flat", metavar="FLAT_INDEX",
                   help="a faiss Flat (inner product) index of this corpus made by this encoder, e.g. Search-R1's "
                        "e5_Flat.index: its vectors are indexed instead of encoding the corpus, and candidates are "
                        "re-scored exactly from it, memory-mapped (no fp16 copy written; the index refers to the "
                        "file by its absolute path)")
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


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    if not os.path.isfile(args.corpus):
        raise UsageError(f"--corpus {args.corpus!r} is not a file: pass a corpus JSONL")
    if args.faiss_index and args.kind != "dense":
        raise UsageError("--faiss-index registers a dense index: add --kind dense")
    if args.faiss_index and not os.path.isfile(args.faiss_index):
        raise UsageError(f"--faiss-index {args.faiss_index!r} is not a file")
    if args.from_flat:
        if args.kind == "bm25" or args.faiss_index:
            raise UsageError("--from-flat builds a dense index from a Flat file's vectors: use it with --kind dense "
                             "(or hybrid), without --faiss-index")
        if args.index_type == "flat":
            raise UsageError(f"--from-flat with --index-type flat would copy {args.from_flat}: serve it as it is "
                             f"with --faiss-index {args.from_flat}, or pick a compressed --index-type")
        if not os.path.isfile(args.from_flat):
            raise UsageError(f"--from-flat {args.from_flat!r} is not a file")
        from megatron_searchr1.search.dense import IndexFileError, flat_file_layout
        from megatron_searchr1.search.retrievers import check_flat_file_corpus
        try:
            flat_file_layout(args.from_flat)
            # a Flat file our builder wrote carries its corpus's fingerprint (index_meta.json beside it): compared
            # here, in milliseconds; one without (e5_Flat.index) is checked from its vectors once the encoder loads
            check_flat_file_corpus(args.from_flat, args.corpus)
        except (IndexFileError, ValueError) as e:
            raise UsageError(str(e)) from None
    if problem := encoder_args_problem(args):
        raise UsageError(problem)
    for flag in ("nlist", "pq_m", "pq_nbits", "train_size"):
        if getattr(args, flag) < 0:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 0 (0 = follow the corpus size)")
    if args.refine_k_factor < -1:
        raise UsageError("--refine-k-factor must be >= 0, or -1 for the type's default")
    if args.torch_threads is not None and args.torch_threads < 0:
        raise UsageError(f"--torch-threads must be >= 0 (0 = every core), got {args.torch_threads}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # faiss trains (k-means, PQ, OPQ) in thousands of short OpenMP loops; with the default spin-wait each loop's
    # barrier waits out the time slices of every other process on a shared machine (a GPU node whose trainer
    # runs). PASSIVE puts idle threads to sleep; a policy the caller set wins. Read when faiss / torch load: below.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from megatron_searchr1.search.encoder import set_cpu_threads
    from megatron_searchr1.search.retrievers import index_corpus, register_faiss_index

    encoder = {k: v for k, v in encoder_options(args).items() if v is not None}
    if args.faiss_index:
        encoder.pop("batch_size", None), encoder.pop("fp16", None), encoder.pop("device", None)
        meta = register_faiss_index(args.faiss_index, args.corpus, args.out_dir, **encoder,
                                    hnsw_ef_search=args.hnsw_ef_search)
        print(json.dumps(meta, indent=2))
        return 0
    if args.kind != "bm25":
        set_cpu_threads(args.torch_threads)
    from megatron_searchr1.search.dense import IndexFileError, IndexTooSmall

    t0 = time.time()
    try:
        retriever = index_corpus(
            args.corpus, args.out_dir, kind=args.kind, copy_corpus=args.copy_corpus, show_progress=not args.quiet,
            **encoder, index_type=args.index_type, hnsw_m=args.hnsw_m, hnsw_ef_construction=args.hnsw_ef_construction,
            hnsw_ef_search=args.hnsw_ef_search, nlist=args.nlist, pq_m=args.pq_m, pq_nbits=args.pq_nbits,
            train_size=args.train_size, refine_k_factor=args.refine_k_factor, k1=args.k1, b=args.b,
            stopwords=args.stopwords, stemmer=args.stemmer, rrf_k=args.rrf_k, depth=args.depth,
            from_flat=args.from_flat)
    except (IndexTooSmall, IndexFileError) as e:
        raise UsageError(str(e)) from None
    print(f"built a {args.kind} index over {len(retriever)} docs in {args.out_dir} ({time.time() - t0:.1f}s); "
          f"serve it with: python -m megatron_searchr1.search.server --index-dir {args.out_dir}")
    return 0


cli = console(main)  # the console script (setup.py)


if __name__ == "__main__":
    raise SystemExit(run_main(main))
