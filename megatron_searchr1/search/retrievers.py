"""Index directories: `index_corpus` writes one, `load_retriever` reopens it without re-indexing.

An index directory holds `index_meta.json` and the index files:
  bm25/          bm25s's own files            (kind bm25 or hybrid)
  dense.index    a faiss index, row i = doc i (kind dense or hybrid; may instead point to a file elsewhere)
index_meta.json records the kind, the corpus path (absolute, or relative to the directory when the corpus was
copied in), the doc count, a fingerprint of the corpus (a hash of its first and last passages: a corpus swapped for
another of the same size is refused, not served), and everything the query side must repeat (BM25 tokenisation,
encoder pooling and prefixes). `register_faiss_index` writes a meta for an existing Search-R1 `e5_Flat.index` +
`wiki-18.jsonl` without touching either file.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import fields

import numpy as np

from megatron_searchr1.search.base import Retriever
from megatron_searchr1.search.bm25 import BM25Config, BM25Retriever
from megatron_searchr1.search.corpus import corpus_fingerprint, last_row_problem, open_corpus
from megatron_searchr1.search.dense import (VECTORS_FILE_SUFFIX, DenseRetriever, FaissConfig, IndexFileError,
                                            check_corpus_size, index_type_of, read_faiss_index)
from megatron_searchr1.search.encoder import EncoderConfig
from megatron_searchr1.search.hybrid import HybridConfig, HybridRetriever

__all__ = ["BM25Retriever", "DenseRetriever", "HybridRetriever", "Retriever", "index_corpus", "load_retriever",
           "register_faiss_index", "faiss_index_meta", "open_faiss_index", "read_index_meta", "KINDS", "META_FILE"]

logger = logging.getLogger(__name__)

KINDS = ("bm25", "dense", "hybrid")
META_FILE = "index_meta.json"
FORMAT_VERSION = 1


def _pick(cls, options: dict) -> dict:
    """The entries of `options` that are fields of dataclass `cls` (None values mean "keep the default")."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in options.items() if k in names and v is not None}


def _split_options(options: dict) -> tuple[EncoderConfig, FaissConfig, BM25Config, HybridConfig]:
    known = set()
    configs = []
    for cls in (EncoderConfig, FaissConfig, BM25Config, HybridConfig):
        picked = _pick(cls, options)
        known |= {f.name for f in fields(cls)}
        configs.append(cls(**picked))
    unknown = set(options) - known
    if unknown:
        raise TypeError(f"unknown index options {sorted(unknown)}; valid: {sorted(known)}")
    return tuple(configs)


def index_corpus(corpus_path: str | os.PathLike, out_dir: str | os.PathLike, kind: str = "bm25",
                copy_corpus: bool = False, show_progress: bool = True, from_flat: str | os.PathLike | None = None,
                **options) -> Retriever:
    """Index a corpus JSONL into `out_dir` and return the ready retriever.

    kind: bm25 | dense | hybrid. options: any field of EncoderConfig (model, pooling, normalize, query_prefix,
    passage_prefix, max_length, batch_size, fp16, device, backend), FaissConfig (index_type, hnsw_m, ...), BM25Config
    (k1, b, method, stopwords, stemmer) or HybridConfig (rrf_k, depth). copy_corpus puts the corpus inside
    out_dir so the directory can be moved as a whole. from_flat: a Flat index file of this corpus by this encoder
    (e5_Flat.index) whose vectors are indexed instead of encoding, and re-scored from by the refine stage (see
    `DenseRetriever.build`); the index then refers to that file by its absolute path.
    """
    if kind not in KINDS:
        raise ValueError(f"index kind must be one of {KINDS}, got {kind!r}")
    encoder_cfg, faiss_cfg, bm25_cfg, hybrid_cfg = _split_options(options)
    os.makedirs(out_dir, exist_ok=True)
    corpus_path = os.path.abspath(corpus_path)
    corpus_ref = corpus_path
    if copy_corpus:
        shutil.copyfile(corpus_path, os.path.join(out_dir, "corpus.jsonl"))
        corpus_path, corpus_ref = os.path.join(out_dir, "corpus.jsonl"), "corpus.jsonl"
    corpus = open_corpus(corpus_path, offsets_cache=os.path.join(out_dir, "corpus_offsets.npz"))
    if len(corpus) == 0:
        raise ValueError(f"corpus {corpus_path} has no docs")
    if kind != "bm25":
        check_corpus_size(faiss_cfg.index_type, len(corpus))  # before the encoder loads
    meta = {"format_version": FORMAT_VERSION, "kind": kind, "corpus": corpus_ref, "num_docs": len(corpus),
            "corpus_fingerprint": corpus_fingerprint(corpus_path),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if from_flat is not None and kind != "bm25":
        check_flat_file_corpus(from_flat, corpus_path, meta["corpus_fingerprint"])
    t0 = time.time()
    bm25 = dense = None
    if kind in ("bm25", "hybrid"):
        bm25 = BM25Retriever.build(corpus, bm25_cfg, show_progress=show_progress)
        meta["bm25"] = {"dir": "bm25", **bm25.save(os.path.join(out_dir, "bm25"))}
    if kind in ("dense", "hybrid"):
        # Chunk vectors go to dense_shards/ as they are made, so an interrupted build resumes; gone once saved.
        shard_dir = os.path.join(out_dir, "dense_shards")
        dense = DenseRetriever.build(corpus, encoder_cfg, faiss_cfg, show_progress=show_progress, shard_dir=shard_dir,
                                     vectors_path=os.path.join(out_dir, "dense" + VECTORS_FILE_SUFFIX),
                                     from_flat=from_flat)
        meta["dense"] = {"faiss_index": "dense.index", **dense.save(os.path.join(out_dir, "dense.index"))}
        shutil.rmtree(shard_dir, ignore_errors=True)
    if kind == "hybrid":
        meta["hybrid"] = {"rrf_k": hybrid_cfg.rrf_k, "depth": hybrid_cfg.depth}
    meta["build_seconds"] = round(time.time() - t0, 2)
    _write_meta(out_dir, meta)
    logger.info("built %s index over %d docs in %s (%.1fs)", kind, len(corpus), out_dir, meta["build_seconds"])
    return bm25 if kind == "bm25" else dense if kind == "dense" else HybridRetriever(bm25, dense, hybrid_cfg)


def faiss_index_meta(faiss_index_path: str | os.PathLike, corpus_path: str | os.PathLike, **options) -> dict:
    """The index_meta.json content that serves an existing faiss index + corpus as they are (see
    `register_faiss_index`). Only the index header matters here, so the vectors are memory-mapped, not read:
    for wiki-18's e5_Flat.index a full read would cost ~65 GB of RAM just to learn ntotal and d."""
    encoder_cfg, faiss_cfg, _, _ = _split_options(options)
    if not os.path.exists(faiss_index_path):
        raise FileNotFoundError(f"faiss index not found: {faiss_index_path}")
    index = read_faiss_index(faiss_index_path, mmap=True)
    meta = {"format_version": FORMAT_VERSION, "kind": "dense", "corpus": os.path.abspath(corpus_path),
            "num_docs": int(index.ntotal),
            "dense": {"faiss_index": os.path.abspath(faiss_index_path), "dim": int(index.d),
                      "faiss": {**_pick(FaissConfig, vars(faiss_cfg)),
                                "index_type": index_type_of(index)},
                      "encoder": encoder_cfg.index_fields()},
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    del index
    if os.path.isfile(corpus_path) and not last_row_problem(corpus_path):  # else the load says what is wrong
        meta["corpus_fingerprint"] = corpus_fingerprint(corpus_path)
    return meta


def register_faiss_index(faiss_index_path: str | os.PathLike, corpus_path: str | os.PathLike,
                         out_dir: str | os.PathLike, **options) -> dict:
    """Write an index_meta.json that serves an existing faiss index + corpus (e.g. Search-R1's e5_Flat.index
    and wiki-18.jsonl) as they are. options: EncoderConfig fields describing the encoder that made the vectors
    (for e5: model=/path/to/e5-base-v2; prefixes and mean pooling follow from the name)."""
    meta = faiss_index_meta(faiss_index_path, corpus_path, **options)
    os.makedirs(out_dir, exist_ok=True)
    _write_meta(out_dir, meta)
    return meta


def open_faiss_index(faiss_index_path: str | os.PathLike, corpus_path: str | os.PathLike,
                     lazy_corpus: bool | None = None, runtime: dict | None = None, **options) -> Retriever:
    """Serve an existing faiss index + corpus without an index directory (the server's --faiss-index --corpus):
    the same meta as `register_faiss_index`, opened by the same code as `load_retriever`. The corpus's line
    offsets are cached next to it (`<corpus>.offsets.npz`) when its directory is writable, so a lazily opened
    wiki-18 is scanned once, not on every start."""
    meta = faiss_index_meta(faiss_index_path, corpus_path, **options)
    corpus_dir = os.path.dirname(os.path.abspath(corpus_path))
    offsets_cache = os.fspath(corpus_path) + ".offsets.npz" if os.access(corpus_dir, os.W_OK) else None
    return _open(meta, corpus_dir, os.fspath(corpus_path), lazy_corpus, offsets_cache, dict(runtime or {}))


def _write_meta(out_dir, meta: dict) -> None:
    tmp = os.path.join(out_dir, META_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=2)
    os.replace(tmp, os.path.join(out_dir, META_FILE))  # atomic: a reader never sees half a meta file


def read_index_meta(index_dir: str | os.PathLike) -> dict:
    path = os.path.join(index_dir, META_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: build the index first "
                                f"(python tools/build_index.py --corpus C --out-dir {index_dir} --kind bm25)")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise IndexFileError(f"{path} is damaged (not JSON: {e}): rebuild the index with tools/build_index.py "
                             f"--out-dir {index_dir}") from None
    if not isinstance(meta, dict) or meta.get("kind") not in KINDS:
        raise IndexFileError(f"{path}: unknown index kind {meta.get('kind') if isinstance(meta, dict) else meta!r}; "
                             f"rebuild the index with tools/build_index.py --out-dir {index_dir}")
    return meta


def _in_dir(index_dir, path: str) -> str:
    return path if os.path.isabs(path) else os.path.join(index_dir, path)


def npy_problem(path: str | os.PathLike) -> str | None:
    """What is wrong with a .npy file, or None: its header must parse and the file must hold all the data the
    header promises (a copy or write cut short fails here, not deep inside numpy or bm25s)."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            shape, _, dtype = read_header(f)
            data_start = f.tell()
    except (ValueError, OSError, EOFError) as e:
        return f"not a readable .npy file ({e})"
    if dtype.hasobject:
        return None
    need = data_start + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    have = os.path.getsize(path)
    return None if have >= need else f"truncated: {have} bytes, its header needs {need}"


def bm25_files(method: str = "lucene") -> list[str]:
    """The files `bm25s.BM25.load` opens for an index of `method`, read from its own signature (its `*_name`
    arguments' defaults), so a file a later bm25s adds is checked too. Two are opened only on a condition: the
    corpus copy (only with load_corpus=True, which we never pass: the corpus is ours) and the non-occurrence array
    (only for the methods bm25s lists as needing it)."""
    import inspect

    import bm25s

    names = {k: p.default for k, p in inspect.signature(bm25s.BM25.load).parameters.items()
             if k.endswith("_name") and isinstance(p.default, str)}
    names.pop("corpus_name", None)
    if method not in bm25s.BM25(method=method).methods_requiring_nonoccurrence:
        names.pop("nnoc_name", None)
    return sorted(names.values())


def index_file_problems(index_dir, meta: dict) -> list[str]:
    """The index files of `meta` that are missing, truncated or not parseable, each as "PATH: what". Cheap
    (headers and sizes only), so the server runs it before faiss, torch or the corpus load."""
    problems = []
    if meta.get("kind") in ("bm25", "hybrid") and isinstance(meta.get("bm25"), dict):
        bm25_dir = _in_dir(index_dir, meta["bm25"].get("dir", "bm25"))
        if not os.path.isdir(bm25_dir):
            problems.append(f"{bm25_dir}: missing")
        else:
            method = meta["bm25"].get("method") or "lucene"
            problems += [f"{os.path.join(bm25_dir, name)}: missing" for name in bm25_files(method)
                         if not os.path.isfile(os.path.join(bm25_dir, name))]
            for name in sorted(os.listdir(bm25_dir)):
                path = os.path.join(bm25_dir, name)
                if name.endswith(".npy"):
                    problem = npy_problem(path)
                elif name.endswith(".json"):
                    try:
                        with open(path) as f:
                            json.load(f)
                        problem = None
                    except (ValueError, UnicodeDecodeError) as e:
                        problem = f"not JSON ({e})"
                else:
                    continue
                if problem:
                    problems.append(f"{path}: {problem}")
    if meta.get("kind") in ("dense", "hybrid") and isinstance(meta.get("dense"), dict):
        m = meta["dense"]
        for key in ("faiss_index", "vectors", "refine_flat"):
            if not m.get(key):
                continue
            path = _in_dir(index_dir, m[key])
            if not os.path.isfile(path) and key == "refine_flat":  # outside the directory: rebuilding will not help
                problems.append(f"{path}: missing: the index re-scores from this Flat file (it was built with "
                                f"--from-flat {path}), which lives outside {index_dir}: put the file back there, or "
                                f"start the server with --refine-flat NEW_PATH")
            elif not os.path.isfile(path):
                problems.append(f"{path}: missing")
            elif key == "vectors" and npy_problem(path):
                problems.append(f"{path}: {npy_problem(path)}")
    return problems


def check_index_files(index_dir, meta: dict | None = None, refine_flat=None) -> None:
    """IndexFileError naming the first damaged file of the index in `index_dir` and how to get a good one.
    refine_flat: the Flat file given at load time (--refine-flat), which replaces the one the meta records."""
    meta = read_index_meta(index_dir) if meta is None else meta
    if refine_flat and isinstance(meta.get("dense"), dict):
        meta = {**meta, "dense": {k: v for k, v in meta["dense"].items() if k != "refine_flat"}}
    problems = index_file_problems(index_dir, meta)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        if "--refine-flat NEW_PATH" in problems[0]:  # the hint is in the problem: the file is not the directory's
            raise IndexFileError(f"{problems[0]}{more}")
        raise IndexFileError(f"{problems[0]}{more}: rebuild the index with tools/build_index.py "
                             f"--out-dir {index_dir} (or copy the whole directory again)")


_SAID_NO_FINGERPRINT: set[str] = set()


def check_corpus_file(corpus_file: str, index_dir=None, meta: dict | None = None) -> None:
    """IndexFileError when the corpus is missing, ends in half a row (cut short by a copy or a full disk) or, with
    the index's `meta`, is not the corpus the index was built over (its fingerprint differs). Milliseconds: the
    file's two ends are read. An index built before fingerprints were recorded is served after one warning."""
    if not os.path.isfile(corpus_file):
        named = meta is not None and index_dir is not None and isinstance(meta.get("corpus"), str) and \
            os.path.abspath(corpus_file) == os.path.abspath(_in_dir(index_dir, meta["corpus"]))
        if not named:
            raise IndexFileError(f"corpus file not found: {corpus_file}: pass the corpus with --corpus")
        raise IndexFileError(f"{corpus_file}, the corpus {os.path.join(index_dir, META_FILE)} names, does not exist "
                             f"(an index moved without its corpus): pass the corpus with --corpus PATH, or rebuild "
                             f"the index with --copy-corpus so that the corpus moves with the directory")
    problem = last_row_problem(corpus_file)
    if problem:
        raise IndexFileError(f"{corpus_file}: {problem}: the file looks cut short; pass the complete corpus "
                             f"with --corpus (or copy it again)")
    if meta is None:
        return
    recorded = meta.get("corpus_fingerprint")
    if not isinstance(recorded, dict):
        key = os.path.abspath(os.fspath(index_dir))
        if key not in _SAID_NO_FINGERPRINT:
            _SAID_NO_FINGERPRINT.add(key)
            logger.warning("%s records no corpus fingerprint (built before indexes kept one): %s is checked by "
                           "its passage count only; rebuild the index to have it checked fully",
                           os.path.join(index_dir, META_FILE), corpus_file)
        return
    try:
        found = corpus_fingerprint(corpus_file)
    except ValueError as e:
        raise IndexFileError(f"{e}: pass an intact corpus with --corpus (or copy it again)") from None
    if found != {k: recorded.get(k) for k in found}:
        raise IndexFileError(f"{corpus_file} is not the corpus the index in {index_dir} was built over (its first "
                             f"or last passage differs from the fingerprint in {META_FILE}): pass that corpus with "
                             f"--corpus, or rebuild the index over this one (tools/build_index.py --corpus "
                             f"{corpus_file} --out-dir {index_dir})")


def flat_file_fingerprint(flat_path) -> dict | None:
    """The corpus fingerprint recorded for a Flat faiss file: the index_meta.json beside it when that meta's dense
    index is this file (a Flat index built by tools/build_index.py); None for a file without one (Search-R1's
    e5_Flat.index), which `DenseRetriever.build` checks from its vectors instead."""
    flat_path = os.path.abspath(os.fspath(flat_path))
    meta_path = os.path.join(os.path.dirname(flat_path), META_FILE)
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        faiss_index = meta["dense"]["faiss_index"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if os.path.abspath(_in_dir(os.path.dirname(flat_path), faiss_index)) != flat_path:
        return None
    fingerprint = meta.get("corpus_fingerprint")
    return fingerprint if isinstance(fingerprint, dict) else None


def check_flat_file_corpus(flat_path, corpus_path, fingerprint: dict | None = None) -> None:
    """IndexFileError when the Flat file's recorded corpus fingerprint (`flat_file_fingerprint`) is not the
    corpus's: its vectors are another corpus's passages, and an index built from them retrieves the wrong ones."""
    recorded = flat_file_fingerprint(flat_path)
    if recorded is None:
        return
    fingerprint = fingerprint or corpus_fingerprint(corpus_path)
    if {k: recorded.get(k) for k in fingerprint} != fingerprint:
        raise IndexFileError(f"{flat_path} was built over another corpus than {corpus_path} (the corpus fingerprint "
                             f"in {os.path.join(os.path.dirname(os.path.abspath(flat_path)), META_FILE)} differs): "
                             f"pass the Flat file made from {corpus_path}, or the corpus that file was made from")


def load_retriever(index_dir: str | os.PathLike, corpus_path: str | os.PathLike | None = None,
                   lazy_corpus: bool | None = None, **runtime) -> Retriever:
    """Reopen an index directory. corpus_path overrides the recorded corpus (e.g. after moving it).

    runtime: settings that may differ from build time: EncoderConfig device/fp16/batch_size/backend, FaissConfig
    use_gpu/num_threads/hnsw_ef_search/nprobe/refine_k_factor, HybridConfig rrf_k/depth, bm25_mmap (memory-map the BM25 arrays) and
    faiss_mmap (memory-map the faiss vectors: the page cache holds them instead of a private copy; with use_gpu
    they go from the file to the GPUs without a full CPU copy), query_cache_size (query embeddings kept in an
    LRU, for a server that sees repeated queries) and refine_flat (a Flat index file of the same corpus and encoder
    to re-score candidates from, memory-mapped, instead of the index's fp16 refine vectors).
    """
    meta = read_index_meta(index_dir)
    corpus_file = os.fspath(corpus_path) if corpus_path else _in_dir(index_dir, meta["corpus"])
    check_corpus_file(corpus_file, index_dir, meta)
    offsets_cache = os.path.join(index_dir, "corpus_offsets.npz") if os.access(index_dir, os.W_OK) else None
    return _open(meta, index_dir, corpus_file, lazy_corpus, offsets_cache, runtime)


def _open(meta: dict, index_dir, corpus_file: str, lazy_corpus: bool | None, offsets_cache: str | None,
          runtime: dict) -> Retriever:
    """The retriever an index meta describes; relative paths in it are relative to index_dir."""
    kind = meta["kind"]
    bm25_mmap = bool(runtime.pop("bm25_mmap", False))
    faiss_mmap = bool(runtime.pop("faiss_mmap", False))
    query_cache_size = int(runtime.pop("query_cache_size", 0) or 0)
    refine_flat = runtime.pop("refine_flat", None)
    allowed = {"device", "fp16", "batch_size", "backend", "use_gpu", "num_threads", "hnsw_ef_search", "nprobe",
               "refine_k_factor", "rrf_k", "depth"}
    bad = set(runtime) - allowed
    if bad:
        raise TypeError(f"load_retriever cannot change {sorted(bad)} (fixed at build time); "
                        f"runtime options: "
                        f"{sorted(allowed | {'bm25_mmap', 'faiss_mmap', 'query_cache_size', 'refine_flat'})}")
    check_index_files(index_dir, meta, refine_flat=refine_flat)
    if os.path.isfile(corpus_file):
        check_corpus_file(corpus_file)
    try:
        corpus = open_corpus(corpus_file, lazy=lazy_corpus, offsets_cache=offsets_cache)
    except ValueError as e:  # a damaged row inside the corpus; the message names the file and line
        raise IndexFileError(f"{e}: pass an intact corpus with --corpus (or copy it again)") from None
    if len(corpus) != meta["num_docs"]:
        raise IndexFileError(f"{corpus_file} has {len(corpus)} docs but the index in {index_dir} was built over "
                             f"{meta['num_docs']}: pass the corpus it was built from with --corpus (or rebuild "
                             f"the index over this one)")
    bm25 = dense = None
    if kind in ("bm25", "hybrid"):
        m = meta["bm25"]
        cfg = BM25Config(**_pick(BM25Config, m))
        bm25 = BM25Retriever.load(_in_dir(index_dir, m["dir"]), corpus, cfg, mmap=bm25_mmap)
    if kind in ("dense", "hybrid"):
        m = meta["dense"]
        enc_cfg = EncoderConfig(**{**m["encoder"], **_pick(EncoderConfig, runtime)})
        faiss_cfg = FaissConfig(**{**_pick(FaissConfig, m.get("faiss", {})), **_pick(FaissConfig, runtime)})
        vectors = _in_dir(index_dir, m["vectors"]) if m.get("vectors") else None
        flat = refine_flat or (_in_dir(index_dir, m["refine_flat"]) if m.get("refine_flat") else None)
        dense = DenseRetriever.from_faiss(_in_dir(index_dir, m["faiss_index"]), corpus, enc_cfg, faiss_cfg,
                                          mmap=faiss_mmap, query_cache_size=query_cache_size, vectors_path=vectors,
                                          refine_flat=flat)
    if kind == "bm25":
        return bm25
    if kind == "dense":
        return dense
    return HybridRetriever(bm25, dense, HybridConfig(**{**meta.get("hybrid", {}), **_pick(HybridConfig, runtime)}))
