"""Dense retrieval: faiss inner-product search over encoder embeddings (Flat = exact, HNSW = approximate).

faiss is imported lazily. A faiss index file written by anyone works as long as row i is corpus row i and the
query encoder matches the one that made the vectors: `DenseRetriever.from_faiss("e5_Flat.index", "wiki-18.jsonl",
EncoderConfig(model="/models/e5-base-v2"))` serves an existing Search-R1 index unchanged.
With `use_gpu=True` and faiss-gpu installed, a Flat index is copied onto all visible GPUs (fp16 storage,
sharded, as Search-R1 does); HNSW has no GPU version in faiss and stays on the CPU.
"""
from __future__ import annotations

import logging
import mmap
import os
import struct
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from megatron_searchr1.search.base import Retriever
from megatron_searchr1.search.encoder import Encoder, EncoderConfig

logger = logging.getLogger(__name__)


# faiss index_factory strings per --index-type; {nlist}, {pq_m}, {pq_nbits}, {hnsw_m} follow the corpus size
# (see `resolve_build`). Bytes per passage at dim d: flat 4d, fp16 2d, sq8 d, sq6 3d/4, pq pq_m (+8 for an IVF id).
FACTORY = {
    "flat": "Flat",
    "fp16": "SQfp16",
    "sq8": "SQ8",
    "sq6": "SQ6",
    "hnsw": "HNSW{hnsw_m},Flat",
    "ivf_flat": "IVF{nlist},Flat",
    "ivf_sq8": "IVF{nlist},SQ8",
    "ivf_pq": "IVF{nlist},PQ{pq_m}x{pq_nbits}",
    "opq_ivf_pq": "OPQ{pq_m},IVF{nlist},PQ{pq_m}x{pq_nbits}",
}
INDEX_TYPES = tuple(FACTORY)
# Fewest passages each type can be trained on (k-means needs points per centroid; OPQ's rotation trains an
# 8-bit PQ internally, 256 centroids per sub-space).
MIN_PASSAGES = {"ivf_flat": 100, "ivf_sq8": 100, "ivf_pq": 100, "opq_ivf_pq": 1000}
# Types whose scores are approximate enough that exact re-scoring of a few times topk candidates pays.
REFINED_BY_DEFAULT = ("ivf_pq", "opq_ivf_pq")
# Types that store the vectors lossily: re-scoring from an exact Flat file (no extra disk) is on by default for them.
LOSSY = ("fp16", "sq8", "sq6", "ivf_sq8", "ivf_pq", "opq_ivf_pq")


# OPQ rotation training: updates (and k-means iterations of its first PQ fit), vectors sampled (`make_faiss_index`).
OPQ_NITER, OPQ_MAX_TRAIN = 10, 10_000
# The default nprobe: a fixed share of the lists, with a floor and a cap (`default_nprobe`).
NPROBE_SHARE, NPROBE_MIN, NPROBE_MAX = 4, 16, 512


def default_nprobe(nlist: int) -> int:
    """IVF lists probed when no --nprobe is given: nlist / 4, at least 16 (all lists of a small index), at most 512.

    With nlist ~ 4 sqrt(N) (the low end of faiss's 4-16 sqrt(N)) a fixed share of the lists keeps recall against
    Flat from falling as the corpus grows (a query's neighbours come to lie in fewer lists relative to nlist); a
    fixed count, as before, lost recall with every doubling. The cost is share x N codes scanned per query, so the
    cap bounds it past ~260k passages (21M: 512 of ~18,000 lists, 3 % of the codes), where the lists needed for the
    same recall grow far slower than nlist. Measured figures: examples/retrieval.md.

    >>> [default_nprobe(n) for n in (7, 25, 64, 514, 18330)]
    [7, 16, 16, 129, 512]
    """
    return min(nlist, max(NPROBE_MIN, min(NPROBE_MAX, -(-nlist // NPROBE_SHARE))))


class IndexTooSmall(ValueError):
    """The corpus has too few passages to train the chosen index type."""


@dataclass
class FaissConfig:
    """Which faiss index is built and how it is searched. 0 means "follow the corpus size" for the sizes."""

    index_type: str = "flat"
    """flat | fp16 | sq8 | sq6 | hnsw | ivf_flat | ivf_sq8 | ivf_pq | opq_ivf_pq (see FACTORY for the faiss strings)."""
    hnsw_m: int = 32
    """HNSW neighbours per node (build time)."""
    hnsw_ef_construction: int = 200
    """HNSW candidate list size while building."""
    hnsw_ef_search: int = 128
    """HNSW candidate list size while searching (raised to topk when topk is larger)."""
    nlist: int = 0
    """IVF lists; 0 = min(4 sqrt(N), N / 39) for N passages (39 training points per list at least)."""
    pq_m: int = 0
    """PQ sub-quantizers = bytes per passage at 8 bits; 0 = dim / 4 (the largest divisor of dim at most that)."""
    pq_nbits: int = 0
    """bits per PQ code; 0 = 8, fewer on a corpus of under 256 passages (k-means needs a point per centroid)."""
    train_size: int = 0
    """passages sampled to train IVF/PQ/SQ; 0 = min(N, max(40 nlist, 10000))."""
    nprobe: int = 0
    """IVF lists visited per query (search time); 0 = a quarter of the lists, at least 16 (or all), at most 512
    (see `default_nprobe`)."""
    refine_k_factor: int = -1
    """re-score refine_k_factor * topk candidates exactly from the stored vectors (search time); 0 = off,
    -1 = 4 for ivf_pq / opq_ivf_pq, off otherwise."""
    factory: str = ""
    """the faiss factory string the index was built with (filled in at build time)."""
    use_gpu: bool = False
    """Move a Flat index to all visible GPUs (needs faiss-gpu). Off by default: the GPUs usually train."""
    num_threads: int = 0
    """faiss OpenMP threads on the CPU; 0 = faiss's default."""

    def __post_init__(self):
        if self.index_type not in FACTORY:
            raise ValueError(f"FaissConfig.index_type must be one of {', '.join(FACTORY)}, got {self.index_type!r}")
        for name in ("nlist", "pq_m", "pq_nbits", "train_size", "nprobe"):
            if getattr(self, name) < 0:
                raise ValueError(f"FaissConfig.{name} must be >= 0 (0 = follow the corpus size), "
                                 f"got {getattr(self, name)}")
        if self.pq_nbits > 16:
            raise ValueError(f"FaissConfig.pq_nbits must be at most 16, got {self.pq_nbits}")
        if self.refine_k_factor < -1:
            raise ValueError(f"FaissConfig.refine_k_factor must be >= -1 (-1 = auto), got {self.refine_k_factor}")

    @property
    def trained(self) -> bool:
        """Whether the index needs a training sample before vectors are added."""
        return self.index_type not in ("flat", "hnsw", "fp16")

    def effective_refine(self, exact_source: bool = False) -> int:
        """The refine factor in force; -1 means 4 for the PQ types, and for every lossy type when the exact
        vectors come from a Flat file that exists anyway (`exact_source`), else off."""
        if self.refine_k_factor >= 0:
            return self.refine_k_factor
        refined = LOSSY if exact_source else REFINED_BY_DEFAULT
        return 4 if self.index_type in refined else 0

    def effective_nprobe(self) -> int:
        """The nprobe in force: the configured one (at most nlist), else `default_nprobe(nlist)`."""
        if self.nprobe:
            return min(self.nprobe, self.nlist) if self.nlist else self.nprobe
        return default_nprobe(self.nlist)

    def resolve_build(self, num_docs: int, dim: int) -> "FaissConfig":
        """A copy with the corpus-size defaults filled in and `factory` set; IndexTooSmall when N cannot train it."""
        import math
        from dataclasses import replace

        check_corpus_size(self.index_type, num_docs)
        nlist = self.nlist or max(1, min(int(4 * math.sqrt(num_docs)), num_docs // 39))
        train = min(num_docs, self.train_size or max(40 * nlist, 10000))
        pq_m = self.pq_m or max(m for m in range(1, max(1, dim // 4) + 1) if dim % m == 0)
        if dim % pq_m:
            raise ValueError(f"FaissConfig.pq_m={pq_m} must divide the vector dim {dim}")
        # 8 bits wherever k-means has its 256 points: under ~10k passages the sample is the whole corpus, so the
        # codes are fitted to exactly the vectors they encode (fewer bits there cost recall, nothing generalizes).
        nbits = self.pq_nbits or min(8, int(math.log2(train)))
        out = replace(self, nlist=nlist if "ivf" in self.index_type else 0, train_size=train, pq_m=pq_m,
                      pq_nbits=nbits)
        out.factory = FACTORY[self.index_type].format(nlist=nlist, pq_m=pq_m, pq_nbits=nbits, hnsw_m=self.hnsw_m)
        if "pq" not in self.index_type:
            out.pq_m = out.pq_nbits = 0
        return out


class IndexFileError(ValueError):
    """An index file or corpus that cannot be served as it is; the message names the file and the fix."""


def check_corpus_size(index_type: str, num_docs: int) -> None:
    """IndexTooSmall, naming the types that fit, when `num_docs` passages cannot train `index_type`."""
    need = MIN_PASSAGES.get(index_type, 1)
    if num_docs < need:
        fits = [t for t in FACTORY if MIN_PASSAGES.get(t, 1) <= num_docs]
        raise IndexTooSmall(f"--index-type {index_type} needs at least {need} passages to train, the corpus has "
                            f"{num_docs}: use --index-type {' / '.join(fits)} (flat is exact and fits any corpus "
                            f"up to a few million passages)")


def _faiss():
    try:
        import faiss
    except ImportError:
        raise ImportError("dense retrieval needs faiss: pip install faiss-cpu (or faiss-gpu-cu12)") from None
    return faiss


def make_faiss_index(dim: int, config: FaissConfig):
    """An empty index for a resolved config (`FaissConfig.resolve_build`); Flat and HNSW as before: IndexFlatIP
    and IndexHNSWFlat, the classes Search-R1's files hold."""
    faiss = _faiss()
    if config.index_type == "flat":
        return faiss.IndexFlatIP(dim)
    if config.index_type == "hnsw":
        index = faiss.IndexHNSWFlat(dim, config.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = config.hnsw_ef_construction
        index.hnsw.efSearch = config.hnsw_ef_search
        return index
    index = faiss.index_factory(dim, config.factory, faiss.METRIC_INNER_PRODUCT)
    if "pq" in config.index_type:
        # index_factory turns on polysemous training for IVF-PQ: a permutation of the codes for Hamming-distance
        # filtering, which a search uses only with polysemous_ht set (never here). It costs most of the training.
        faiss.downcast_index(faiss.extract_index_ivf(index)).do_polysemous_training = False
    if config.index_type == "opq_ivf_pq":
        # faiss's OPQ alternates 50 rotation updates with a PQ fit on up to 65,536 vectors (the first fit 40 k-means
        # iterations): minutes per thousand passages at pq_m = d/4, where each sub-space is 4 dims wide. The
        # rotation is a d x d matrix: 10 updates on 10,000 vectors (39 per PQ centroid, faiss's minimum) reach
        # nearly all of the full fit's gain in PQ error, and with the default refine the IVF stage sets the recall.
        opq = faiss.downcast_VectorTransform(faiss.downcast_index(index).chain.at(0))
        opq.niter, opq.niter_pq_0, opq.max_train_points = OPQ_NITER, OPQ_NITER, OPQ_MAX_TRAIN
    return index


def index_type_of(index) -> str:
    """Our index_type name for an index read from a file (a Search-R1 file is flat)."""
    faiss = _faiss()
    if isinstance(index, faiss.IndexHNSW):
        return "hnsw"
    if isinstance(index, faiss.IndexPreTransform):
        return "opq_ivf_pq"
    if isinstance(index, faiss.IndexIVFPQ):
        return "ivf_pq"
    if isinstance(index, faiss.IndexIVFScalarQuantizer):
        return "ivf_sq8"
    if isinstance(index, faiss.IndexIVFFlat):
        return "ivf_flat"
    if isinstance(index, faiss.IndexScalarQuantizer):
        return {faiss.ScalarQuantizer.QT_fp16: "fp16", faiss.ScalarQuantizer.QT_6bit: "sq6"}.get(index.sq.qtype, "sq8")
    return "flat"


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
        if _is_ivf_file(path):
            flags = faiss.IO_FLAG_MMAP  # maps the inverted lists (the codes); the quantizer is small and read
        if not flags:
            logger.warning("faiss %s cannot memory-map flat indexes (no IO_FLAG_MMAP_IFC; upgrade faiss): "
                           "reading all of %s into RAM", getattr(faiss, "__version__", "?"), path)
    try:
        return faiss.read_index(os.fspath(path), flags)
    except RuntimeError as e:  # faiss's C++ exception text has no hint of what to do
        reason = (str(e).strip().splitlines() or [type(e).__name__])[-1].split("Error: ", 1)[-1]
        raise IndexFileError(f"{path} cannot be read by faiss ({reason}): the file is truncated or not a faiss "
                             f"index; rebuild it with tools/build_index.py (or copy it again)") from None


def _is_ivf_file(path) -> bool:
    """Whether a faiss file holds an IVF index (its 4-byte tag: IwXX, or a pre-transform IxPT around one)."""
    with open(path, "rb") as f:
        tag = f.read(4)
    return tag[:2] == b"Iw" or tag == b"IxPT"


VECTORS_FILE_SUFFIX = ".vectors.npy"
# A faiss IndexFlat file: fourcc (IxFI inner product, IxF2 L2), d (int32), ntotal, two unused int64s, is_trained
# (1 byte), metric (int32), metric_arg (float32, only for metrics past L2), then its vectors as a vector<float>:
# a uint64 count followed by count float32s, row-major. The same layout since faiss 1.5 (e5_Flat.index included).
_FLAT_HEADER = struct.Struct("<4siqqq?i")


def flat_file_layout(path: str | os.PathLike) -> tuple[int, int, int]:
    """(ntotal, d, byte offset of the vectors) of a faiss IndexFlatIP file; IndexFileError for anything else.
    Reads the header only (a few dozen bytes), so the server checks a 65 GB e5_Flat.index before loading anything."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        head = f.read(_FLAT_HEADER.size)
        if len(head) < _FLAT_HEADER.size or head[:4] not in (b"IxFI", b"IxF2"):
            raise IndexFileError(f"{path} is not a faiss Flat index (it starts with {head[:4]!r}, not IxFI): "
                                 f"exact re-scoring reads the vectors of a Flat file such as Search-R1's "
                                 f"e5_Flat.index")
        fourcc, d, ntotal, _, _, _, metric = _FLAT_HEADER.unpack(head)
        if fourcc != b"IxFI" or metric != 0:
            raise IndexFileError(f"{path} is a Flat index with the L2 metric: re-scoring ranks by inner product; "
                                 f"pass an inner-product Flat file (faiss.IndexFlatIP)")
        (count,) = struct.unpack("<Q", f.read(8))
        offset = f.tell()
    if d <= 0 or ntotal < 0 or count != d * ntotal:
        raise IndexFileError(f"{path}: its header says {ntotal} vectors of dim {d} but holds {count} floats: "
                             f"the file is damaged; copy it again")
    need = offset + 4 * count
    if os.path.getsize(path) < need:
        raise IndexFileError(f"{path} is truncated: {os.path.getsize(path)} bytes, its header needs {need}; "
                             f"copy it again")
    return ntotal, d, offset


def open_flat_vectors(path: str | os.PathLike, expect: tuple[int, int] | None = None,
                      expected_by: str = "") -> np.ndarray:
    """The (ntotal, d) float32 vectors of a faiss IndexFlatIP file, memory-mapped read-only: row i is vector i.
    With `expect` (ntotal, d), a file of another shape is an IndexFileError that says what `expected_by` needs
    ("the corpus has ...") and to pass the Flat file of the same corpus and encoder; checked before mapping.

    Nothing is read until a row is used, and the mapping is advised as random access, so re-scoring a query's
    candidates reads their pages and not the kernel's read-ahead around each one. The pages are the page cache's:
    shared between processes and dropped under memory pressure, never this process's own memory."""
    ntotal, d, offset = flat_file_layout(path)
    if expect is not None and (ntotal, d) != tuple(expect):
        raise IndexFileError(f"{os.fspath(path)} holds {ntotal} vectors of dim {d} but {expected_by}: pass the Flat "
                             f"file made from the same corpus by the same encoder")
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    _advise_random(mapped)
    return np.frombuffer(mapped, dtype=np.float32, count=ntotal * d, offset=offset).reshape(ntotal, d)


FLAT_ROW_MIN_COSINE = 0.9
"""How close the Flat file's vector of a passage must be to this encoder's vector of it (cosine). Measured with the
packaged MiniLM: 1.000 for the same passage with the stored vector rounded to fp16; at most 0.83 between two different
passages of tests/search's 300 look-alike passages (0.27 and 0.34 between rows of two such corpora)."""


def check_flat_rows(vectors: np.ndarray, corpus: Sequence[dict], encoder, path) -> None:
    """IndexFileError unless rows 0, N/2 and N-1 of a Flat file's `vectors` (N, d) are this encoder's vectors of the
    corpus's passages 0, N/2 and N-1: a Flat file of another corpus of the same size (or made by another encoder)
    would build an index that retrieves the wrong passages. Three passages are encoded: a second, before the build."""
    n = len(corpus)
    rows = sorted({0, n // 2, n - 1})
    mine = encoder.encode([corpus[i]["contents"] for i in rows], is_query=False).astype(np.float32)  # (3, d)
    theirs = np.asarray(vectors[rows], dtype=np.float32)  # (3, d)
    cos = (mine * theirs).sum(-1) / np.maximum(np.linalg.norm(mine, axis=-1) * np.linalg.norm(theirs, axis=-1),
                                               1e-12)
    bad = [(r, float(c)) for r, c in zip(rows, cos) if not c >= FLAT_ROW_MIN_COSINE]
    if bad:
        row, c = bad[0]
        raise IndexFileError(f"{os.fspath(path)} was not made from this corpus by {encoder.config.model!r}: its "
                             f"vector {row} has cosine {c:.3f} with the encoder's vector of passage {row} (the same "
                             f"passage and encoder give > 0.99): pass the Flat file made from this corpus by this "
                             f"encoder (or the --encoder that made it)")


def _advise_random(mapped) -> None:
    """MADV_RANDOM on a mapping where the platform has it (Linux, Python >= 3.8)."""
    if mapped is not None and hasattr(mapped, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)


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
                 keep_cpu_index: bool = True, vectors: np.ndarray | None = None, refine_flat: str | None = None):
        """keep_cpu_index: with use_gpu, keep the exact CPU index beside the GPU copy (fp16) so `save` writes the
        vectors as built. False for an index read from a file: it is on disk already, and keeping it would hold
        the whole index (65 GB for wiki-18's e5_Flat.index) in RAM for nothing.
        vectors: the exact vectors the refine stage re-scores from (fp16 .npy or a Flat file, memory-mapped);
        refine_flat: the Flat file they were mapped from, when they were (it turns refine on for every lossy type)."""
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
        self.vectors, self.refine_flat = vectors, refine_flat
        self.ivf = None
        try:
            self.ivf = faiss.extract_index_ivf(index)
        except RuntimeError:  # not an IVF index
            pass
        if self.ivf is not None:
            self.faiss_config.nlist = int(self.ivf.nlist)
            self.ivf.nprobe = self.faiss_config.effective_nprobe()  # set once: searches only read it
        self.refine = self.faiss_config.effective_refine(refine_flat is not None) if vectors is not None else 0

    @classmethod
    def build(cls, corpus: Sequence[dict], encoder_config: EncoderConfig | None = None,
              faiss_config: FaissConfig | None = None, encoder: Encoder | None = None,
              show_progress: bool = True, chunk_docs: int = 16384,
              shard_dir: str | os.PathLike | None = None,
              vectors_path: str | os.PathLike | None = None,
              from_flat: str | os.PathLike | None = None) -> "DenseRetriever":
        """Encode every doc's `contents` (with the passage prefix) and add it to a new faiss index.

        The corpus goes in chunks of `chunk_docs`: only one chunk's texts and vectors are alive at once, a second
        thread tokenizes the next chunk while this one is encoded, and the encoder length-sorts within a chunk.
        shard_dir: save each chunk's vectors there (`shard_<k>.npy`, written atomically) and reuse the ones a
        previous, interrupted build left, so a wiki-scale build resumes where it stopped instead of starting over.
        A trained type (IVF, PQ, SQ) is trained on `train_size` passages sampled from all chunks, then filled.
        vectors_path: where the fp16 vectors for the refine stage go (when the config refines); the server maps it.
        from_flat: a faiss IndexFlatIP file of this corpus made by this encoder (Search-R1's e5_Flat.index): its
        vectors are indexed instead of encoding the corpus (minutes instead of GPU-hours at wiki-18 scale), and the
        refine stage re-scores from it, memory-mapped, so no fp16 copy is written.
        """
        from concurrent.futures import ThreadPoolExecutor

        from tqdm.auto import tqdm

        faiss_config = faiss_config or FaissConfig()
        encoder = encoder or Encoder(encoder_config or EncoderConfig())
        n = len(corpus)
        faiss_config = faiss_config.resolve_build(n, encoder.dim)
        source = None
        if from_flat is not None:
            source = open_flat_vectors(from_flat, (n, encoder.dim), f"the corpus has {n} passages and "
                                       f"{encoder.config.model!r} outputs dim {encoder.dim}")
            check_flat_rows(source, corpus, encoder, from_flat)
            shard_dir = vectors_path = None  # nothing to resume or to copy: the file is the vectors
        index = make_faiss_index(encoder.dim, faiss_config)
        bounds = [(s, min(s + chunk_docs, n)) for s in range(0, n, chunk_docs)]
        # A trained index needs every vector before the first add (the training sample spans the corpus), so its
        # chunks go to shards (on disk, or kept in memory without a shard_dir) and are added after training.
        held: dict[int, np.ndarray] = {}
        shards = _Shards(shard_dir, {"num_docs": n, "chunk_docs": chunk_docs, "dim": encoder.dim,
                                     "encoder": encoder.config.index_fields()}) if shard_dir else None
        todo = [k for k in range(len(bounds)) if shards is None or not shards.has(k)]
        keep_vectors = faiss_config.effective_refine() > 0 and vectors_path is not None
        stored = np.lib.format.open_memmap(vectors_path, mode="w+", dtype=np.float16, shape=(n, encoder.dim)) \
            if keep_vectors else None

        def tokenize(k: int):
            s, e = bounds[k]
            if source is not None:
                return np.array(source[s:e])  # read from the Flat file, off the adding thread
            return encoder.tokenize([corpus[i]["contents"] for i in range(s, e)], is_query=False)

        def chunk(k: int) -> np.ndarray:
            return held[k] if shards is None else shards.load(k)

        with tqdm(total=n, desc="dense index", unit="doc", disable=not show_progress) as bar, \
                ThreadPoolExecutor(1, thread_name_prefix="tokenize") as pool:
            if shards is not None and len(todo) < len(bounds):
                logger.info("resuming a dense index build: %d of %d chunks are in %s already",
                            len(bounds) - len(todo), len(bounds), shard_dir)
            ahead = {todo[0]: pool.submit(tokenize, todo[0])} if todo else {}
            for k, (s, e) in enumerate(bounds):
                if k not in ahead:  # a finished shard from an earlier run
                    vectors = shards.load(k)
                    bar.update(e - s)
                else:
                    tokens = ahead.pop(k).result()
                    later = [j for j in todo if j > k]
                    if later:  # tokenize the next chunk on the other thread while the model encodes this one
                        ahead[later[0]] = pool.submit(tokenize, later[0])
                    if source is not None:
                        vectors = tokens
                        bar.update(e - s)
                    else:
                        vectors = encoder.encode_tokens(tokens, bar)
                    if shards is not None:
                        shards.save(k, vectors)
                if stored is not None:
                    stored[s:e] = vectors
                if faiss_config.trained:
                    if shards is None:
                        held[k] = vectors
                else:
                    index.add(vectors)
        if faiss_config.trained:
            rows = np.sort(np.random.default_rng(0).choice(n, faiss_config.train_size, replace=False))
            sample = np.concatenate([chunk(k)[rows[(rows >= s) & (rows < e)] - s] for k, (s, e) in enumerate(bounds)])
            t0 = time.time()
            index.train(sample)
            logger.info("trained %s on %d passages in %.1fs", faiss_config.factory, len(sample), time.time() - t0)
            del sample
            for k in range(len(bounds)):
                index.add(chunk(k))
        if stored is not None:
            stored.flush()
            del stored
        vectors = np.load(vectors_path, mmap_mode="r") if keep_vectors else None
        if source is not None and faiss_config.effective_refine(exact_source=True) > 0:
            vectors = source
        return cls(corpus, index, encoder, faiss_config, vectors=vectors,
                   refine_flat=os.path.abspath(from_flat) if source is not None else None)

    def save(self, path: str | os.PathLike) -> dict:
        """Write the (CPU) faiss index to `path`; returns the index_meta.json entry."""
        faiss = _faiss()
        cpu_index = self.cpu_index if self.cpu_index is not None else faiss.index_gpu_to_cpu(self.index)
        faiss.write_index(cpu_index, os.fspath(path))
        meta = {"faiss": asdict(self.faiss_config), "encoder": self.encoder.config.index_fields(),
                "dim": self.encoder.dim}
        if self.refine_flat is not None:
            meta["refine_flat"] = self.refine_flat
        elif self.vectors is not None:
            meta["vectors"] = os.path.basename(os.fspath(self.vectors.filename))
        return meta

    @classmethod
    def from_faiss(cls, faiss_index_path: str | os.PathLike, corpus: Sequence[dict],
                   encoder_config: EncoderConfig | None = None, faiss_config: FaissConfig | None = None,
                   encoder: Encoder | None = None, mmap: bool = False,
                   query_cache_size: int = 0, vectors_path: str | os.PathLike | None = None,
                   refine_flat: str | os.PathLike | None = None) -> "DenseRetriever":
        """Open any faiss index file (e.g. Search-R1's e5_Flat.index) over a corpus whose row i is vector i.

        mmap: map the vectors from the file (the OS page cache holds them) instead of copying them into this
        process's memory; see `read_faiss_index`. query_cache_size: query embeddings kept in the encoder's LRU.
        vectors_path: fp16 refine vectors (.npy) written by `build`; refine_flat: a Flat index file of the same
        corpus and encoder (e5_Flat.index) to re-score from instead, memory-mapped (`open_flat_vectors`)."""
        faiss = _faiss()
        if not os.path.exists(faiss_index_path):
            raise FileNotFoundError(f"faiss index not found: {faiss_index_path}")
        index = read_faiss_index(faiss_index_path, mmap=mmap)
        faiss_config = faiss_config or FaissConfig(index_type=index_type_of(index))
        if isinstance(index, faiss.IndexHNSW):
            index.hnsw.efSearch = faiss_config.hnsw_ef_search
        encoder = encoder or Encoder(encoder_config or EncoderConfig(), query_cache_size=query_cache_size)
        vectors = None
        if refine_flat is not None:
            refine_flat = os.path.abspath(refine_flat)
            if faiss_config.effective_refine(exact_source=True) > 0:
                vectors = open_flat_vectors(refine_flat, (index.ntotal, index.d),
                                            f"the index has {index.ntotal} of dim {index.d}")
        elif vectors_path is not None and faiss_config.effective_refine() > 0:
            vectors = np.load(os.fspath(vectors_path), mmap_mode="r")  # pages are read on demand, shared
            _advise_random(getattr(vectors, "_mmap", None))  # only the candidates' rows, no read-ahead around them
            if vectors.shape != (index.ntotal, index.d):
                raise ValueError(f"{vectors_path} holds {vectors.shape} vectors but the index has "
                                 f"({index.ntotal}, {index.d}): rebuild the index")
        return cls(corpus, index, encoder, faiss_config, keep_cpu_index=False, vectors=vectors,
                   refine_flat=refine_flat if vectors is not None else None)

    def search_ids(self, queries: list[str], topk: int) -> tuple[np.ndarray, np.ndarray]:
        emb, inverse = self.encoder.encode_unique_queries(queries)  # (U, H) distinct queries, (B,) row of each
        params = None
        if isinstance(self.index, _faiss().IndexHNSW):
            # Per-call parameters instead of mutating the index: thread-safe and independent of earlier calls.
            params = _faiss().SearchParametersHNSW(efSearch=max(self.faiss_config.hnsw_ef_search, topk))
        depth = topk * self.refine if self.refine > 1 else topk
        scores, ids = self.index.search(emb, depth, params=params)  # (U, depth) each; a short result pads with -1
        if self.refine:
            scores, ids = self._rescore(emb, ids, topk)
        return ids[inverse].astype(np.int64), scores[inverse].astype(np.float32)  # (B, k): repeats share a row

    def _rescore(self, emb: np.ndarray, ids: np.ndarray, topk: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact inner products of each query with its candidates' stored vectors, the best topk of them."""
        safe = np.where(ids >= 0, ids, 0)  # (U, depth)
        flat = np.unique(safe)  # sorted: reads the mapped file in order
        vecs = np.asarray(self.vectors[flat], dtype=np.float32)  # (C, H)
        cand = vecs[np.searchsorted(flat, safe)]  # (U, depth, H)
        exact = np.einsum("udh,uh->ud", cand, emb).astype(np.float32)
        exact[ids < 0] = -np.inf
        order = np.argsort(-exact, axis=1, kind="stable")[:, :topk]
        new_ids = np.take_along_axis(ids, order, 1)
        new_scores = np.take_along_axis(exact, order, 1)
        return new_scores, new_ids

    def search_knobs(self) -> dict:
        """The search-time settings in force (reported by the server's /health)."""
        knobs = {"index_type": self.faiss_config.index_type, "factory": self.faiss_config.factory or None,
                 "refine_k_factor": self.refine}
        if self.refine:  # where the exact vectors are read from
            knobs["refine_from"] = ({"kind": "flat_file", "path": self.refine_flat} if self.refine_flat else
                                    {"kind": "fp16_vectors", "path": os.fspath(getattr(self.vectors, "filename", "")
                                                                              or "") or None})
        if self.ivf is not None:
            knobs.update(nlist=int(self.ivf.nlist), nprobe=int(self.ivf.nprobe))
        if isinstance(self.index, _faiss().IndexHNSW):
            knobs["ef_search"] = self.faiss_config.hnsw_ef_search
        return knobs

    def describe(self) -> dict:
        return {**super().describe(), "encoder": self.encoder.config.index_fields(),
                "encoder_backend": self.encoder.backend, "index_type": self.faiss_config.index_type, "gpu": self.on_gpu,
                "search": self.search_knobs(), "query_cache": self.encoder.cache.stats()}


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
