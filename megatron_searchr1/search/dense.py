"""Dense retrieval: faiss inner-product search over encoder embeddings (Flat = exact, HNSW = approximate).

faiss is imported lazily. A faiss index file written by anyone works as long as row i is corpus row i and the
query encoder matches the one that made the vectors: `DenseRetriever.from_faiss("e5_Flat.index", "wiki-18.jsonl",
EncoderConfig(model="/models/e5-base-v2"))` serves an existing Search-R1 index unchanged.
With `use_gpu=True` and faiss-gpu installed, a Flat index is copied onto all visible GPUs (fp16 storage,
sharded, as Search-R1 does); HNSW has no GPU version in faiss and stays on the CPU.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from megatron_searchr1.search.base import Retriever
from megatron_searchr1.search.encoder import Encoder, EncoderConfig

logger = logging.getLogger(__name__)


@dataclass
class FaissConfig:
    """Which faiss index is built and how it is searched."""

    index_type: str = "flat"
    """flat (exact inner product) | hnsw (graph, approximate, for very large corpora on the CPU)."""
    hnsw_m: int = 32
    """HNSW neighbours per node (build time)."""
    hnsw_ef_construction: int = 200
    """HNSW candidate list size while building."""
    hnsw_ef_search: int = 128
    """HNSW candidate list size while searching (raised to topk when topk is larger)."""
    use_gpu: bool = False
    """Move a Flat index to all visible GPUs (needs faiss-gpu). Off by default: the GPUs usually train."""
    num_threads: int = 0
    """faiss OpenMP threads on the CPU; 0 = faiss's default."""

    def __post_init__(self):
        if self.index_type not in ("flat", "hnsw"):
            raise ValueError(f"FaissConfig.index_type must be flat or hnsw, got {self.index_type!r}")


def _faiss():
    try:
        import faiss
    except ImportError:
        raise ImportError("dense retrieval needs faiss: pip install faiss-cpu (or faiss-gpu-cu12)") from None
    return faiss


def make_faiss_index(dim: int, config: FaissConfig):
    faiss = _faiss()
    if config.index_type == "flat":
        return faiss.IndexFlatIP(dim)
    index = faiss.IndexHNSWFlat(dim, config.hnsw_m, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = config.hnsw_ef_construction
    index.hnsw.efSearch = config.hnsw_ef_search
    return index


def read_faiss_index(path: str | os.PathLike, mmap: bool = False):
    """Open a faiss index file; mmap=True maps its vectors from the file instead of copying them into RAM.

    faiss's IO_FLAG_MMAP only maps inverted lists (IVF); a Flat or HNSW index is still read in full with it (a
    65 GB e5_Flat.index costs 65 GB). IO_FLAG_MMAP_IFC (recent faiss, 1.15 here) maps the codes of flat storage too:
    reading a 768 MB flat index then costs under 1 MB. An older faiss reads the whole file, with a warning.
    """
    faiss = _faiss()
    flags = 0
    if mmap:
        flags = getattr(faiss, "IO_FLAG_MMAP_IFC", 0)
        if not flags:
            logger.warning("faiss %s cannot memory-map flat indexes (no IO_FLAG_MMAP_IFC; upgrade faiss): "
                           "reading all of %s into RAM", getattr(faiss, "__version__", "?"), path)
    return faiss.read_index(os.fspath(path), flags)


def _to_gpu(index):
    faiss = _faiss()
    if not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() == 0:
        raise RuntimeError("use_gpu=True but this faiss has no GPU support or sees no GPU; "
                           "install faiss-gpu-cu12 or drop --faiss-gpu")
    if not isinstance(index, faiss.IndexFlat):
        logger.warning("faiss has no GPU version of %s; searching it on the CPU", type(index).__name__)
        return index
    co = faiss.GpuMultipleClonerOptions()
    co.useFloat16, co.shard = True, True
    return faiss.index_cpu_to_all_gpus(index, co=co)


class DenseRetriever(Retriever):
    """Embedding search. `build` encodes a corpus; `load`/`from_faiss` reopen a saved faiss index."""

    kind = "dense"

    def __init__(self, corpus: Sequence[dict], index, encoder: Encoder, faiss_config: FaissConfig | None = None,
                 keep_cpu_index: bool = True):
        """keep_cpu_index: with use_gpu, keep the exact CPU index beside the GPU copy (fp16) so `save` writes the
        vectors as built. False for an index read from a file: it is on disk already, and keeping it would hold
        the whole index (65 GB for wiki-18's e5_Flat.index) in RAM for nothing."""
        self.faiss_config = faiss_config or FaissConfig()
        if index.ntotal != len(corpus):
            raise ValueError(f"faiss index has {index.ntotal} vectors but the corpus has {len(corpus)} docs: "
                             "row i of the index must be row i of the corpus; pass the corpus it was built from")
        if index.d != encoder.dim:
            raise ValueError(f"faiss index vectors have dim {index.d} but encoder {encoder.config.model!r} "
                             f"outputs {encoder.dim}: use the encoder the index was built with")
        faiss = _faiss()
        if self.faiss_config.num_threads > 0:
            faiss.omp_set_num_threads(self.faiss_config.num_threads)
        self.index = _to_gpu(index) if self.faiss_config.use_gpu else index
        self.on_gpu = self.index is not index
        # None once the index lives on the GPUs only; save() then copies it back (see keep_cpu_index).
        self.cpu_index = index if keep_cpu_index or not self.on_gpu else None
        self.corpus, self.encoder = corpus, encoder

    @classmethod
    def build(cls, corpus: Sequence[dict], encoder_config: EncoderConfig | None = None,
              faiss_config: FaissConfig | None = None, encoder: Encoder | None = None,
              show_progress: bool = True, chunk_docs: int = 16384,
              shard_dir: str | os.PathLike | None = None) -> "DenseRetriever":
        """Encode every doc's `contents` (with the passage prefix) and add it to a new faiss index.

        The corpus goes in chunks of `chunk_docs`: only one chunk's texts and vectors are alive at once, a second
        thread tokenizes the next chunk while this one is encoded, and the encoder length-sorts within a chunk.
        shard_dir: save each chunk's vectors there (`shard_<k>.npy`, written atomically) and reuse the ones a
        previous, interrupted build left, so a wiki-scale build resumes where it stopped instead of starting over.
        """
        from concurrent.futures import ThreadPoolExecutor

        from tqdm.auto import tqdm

        faiss_config = faiss_config or FaissConfig()
        encoder = encoder or Encoder(encoder_config or EncoderConfig())
        index = make_faiss_index(encoder.dim, faiss_config)
        n = len(corpus)
        bounds = [(s, min(s + chunk_docs, n)) for s in range(0, n, chunk_docs)]
        shards = _Shards(shard_dir, {"num_docs": n, "chunk_docs": chunk_docs, "dim": encoder.dim,
                                     "encoder": encoder.config.index_fields()}) if shard_dir else None
        todo = [k for k in range(len(bounds)) if shards is None or not shards.has(k)]

        def tokenize(k: int):
            s, e = bounds[k]
            return encoder.tokenize([corpus[i]["contents"] for i in range(s, e)], is_query=False)

        with tqdm(total=n, desc="dense index", unit="doc", disable=not show_progress) as bar, \
                ThreadPoolExecutor(1, thread_name_prefix="tokenize") as pool:
            if shards is not None and len(todo) < len(bounds):
                logger.info("resuming a dense index build: %d of %d chunks are in %s already",
                            len(bounds) - len(todo), len(bounds), shard_dir)
            ahead = {todo[0]: pool.submit(tokenize, todo[0])} if todo else {}
            for k, (s, e) in enumerate(bounds):
                if k not in ahead:  # a finished shard from an earlier run
                    index.add(shards.load(k))
                    bar.update(e - s)
                    continue
                tokens = ahead.pop(k).result()
                later = [j for j in todo if j > k]
                if later:  # tokenize the next chunk on the other thread while the model encodes this one
                    ahead[later[0]] = pool.submit(tokenize, later[0])
                vectors = encoder.encode_tokens(tokens, bar)
                if shards is not None:
                    shards.save(k, vectors)
                index.add(vectors)
        return cls(corpus, index, encoder, faiss_config)

    def save(self, path: str | os.PathLike) -> dict:
        """Write the (CPU) faiss index to `path`; returns the index_meta.json entry."""
        faiss = _faiss()
        cpu_index = self.cpu_index if self.cpu_index is not None else faiss.index_gpu_to_cpu(self.index)
        faiss.write_index(cpu_index, os.fspath(path))
        return {"faiss": asdict(self.faiss_config), "encoder": self.encoder.config.index_fields(),
                "dim": self.encoder.dim}

    @classmethod
    def from_faiss(cls, faiss_index_path: str | os.PathLike, corpus: Sequence[dict],
                   encoder_config: EncoderConfig | None = None, faiss_config: FaissConfig | None = None,
                   encoder: Encoder | None = None, mmap: bool = False,
                   query_cache_size: int = 0) -> "DenseRetriever":
        """Open any faiss index file (e.g. Search-R1's e5_Flat.index) over a corpus whose row i is vector i.

        mmap: map the vectors from the file (the OS page cache holds them) instead of copying them into this
        process's memory; see `read_faiss_index`. query_cache_size: query embeddings kept in the encoder's LRU."""
        faiss = _faiss()
        if not os.path.exists(faiss_index_path):
            raise FileNotFoundError(f"faiss index not found: {faiss_index_path}")
        index = read_faiss_index(faiss_index_path, mmap=mmap)
        faiss_config = faiss_config or FaissConfig(
            index_type="hnsw" if isinstance(index, faiss.IndexHNSW) else "flat")
        if isinstance(index, faiss.IndexHNSW):
            index.hnsw.efSearch = faiss_config.hnsw_ef_search
        encoder = encoder or Encoder(encoder_config or EncoderConfig(), query_cache_size=query_cache_size)
        return cls(corpus, index, encoder, faiss_config, keep_cpu_index=False)

    def search_ids(self, queries: list[str], topk: int) -> tuple[np.ndarray, np.ndarray]:
        emb, inverse = self.encoder.encode_unique_queries(queries)  # (U, H) distinct queries, (B,) row of each
        params = None
        if isinstance(self.index, _faiss().IndexHNSW):
            # Per-call parameters instead of mutating the index: thread-safe and independent of earlier calls.
            params = _faiss().SearchParametersHNSW(efSearch=max(self.faiss_config.hnsw_ef_search, topk))
        scores, ids = self.index.search(emb, topk, params=params)  # (U, k) each; a short result pads with -1
        return ids[inverse].astype(np.int64), scores[inverse].astype(np.float32)  # (B, k): repeats share a row

    def describe(self) -> dict:
        return {**super().describe(), "encoder": self.encoder.config.index_fields(),
                "encoder_backend": self.encoder.backend, "index_type": self.faiss_config.index_type, "gpu": self.on_gpu,
                "query_cache": self.encoder.cache.stats()}


class _Shards:
    """Per-chunk embedding files of an index build in progress, valid only for the build that made them."""

    def __init__(self, directory, fingerprint: dict):
        import json
        import shutil

        self.dir = os.fspath(directory)
        meta_path = os.path.join(self.dir, "shards.json")
        if os.path.exists(meta_path):
            with open(meta_path) as f:
                if json.load(f) != fingerprint:  # another corpus, encoder or chunking: nothing to reuse
                    logger.info("discarding stale embedding shards in %s", self.dir)
                    shutil.rmtree(self.dir)
        os.makedirs(self.dir, exist_ok=True)
        with open(meta_path, "w") as f:
            json.dump(fingerprint, f)

    def _path(self, k: int) -> str:
        return os.path.join(self.dir, f"shard_{k:06d}.npy")

    def has(self, k: int) -> bool:
        return os.path.exists(self._path(k))

    def load(self, k: int) -> np.ndarray:
        return np.load(self._path(k))

    def save(self, k: int, vectors: np.ndarray) -> None:
        tmp = self._path(k) + ".tmp"
        with open(tmp, "wb") as f:
            np.save(f, vectors)
        os.replace(tmp, self._path(k))  # atomic: an interrupted write leaves no half shard behind
