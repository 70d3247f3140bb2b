"""The encoder's forward pass on ONNX Runtime: the same weights, the same outputs (to ~1e-6), less time on a CPU.

Why: a small query batch on the CPU spends much of its time in PyTorch's eager overhead (one Python call and one
kernel dispatch per op, dozens of ops per layer); ONNX Runtime runs the exported graph with fused kernels (LayerNorm,
GELU, MatMul+Add) and no Python between them. The gain is largest for a single query; for batches of tens of
queries the matrix products dominate and both runtimes run them near the cores' fp32 peak (figures:
tools/benchmarks/README.md). The embeddings stay equal to the eager model's (`tests/search/test_onnx_encoder.py`
holds them to 1e-5 and the top-3 to identical).

The model is exported once per (model files, torch, transformers) with torch.onnx (the TorchScript exporter, which
needs the `onnx` package) and cached as a file (`cache_dir()`), so only the first start of a server pays the few
seconds of export. `onnxruntime` and `onnx` are installed by tools/install.sh; both are imported here, lazily: the
torch backend needs neither.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings

import numpy as np

logger = logging.getLogger(__name__)

OPSET = 17


def available() -> str | None:
    """None when ONNX Runtime can be used here, else why not (to log, or to raise when it was asked for)."""
    import importlib.util

    for module, package in (("onnxruntime", "onnxruntime"), ("onnx", "onnx")):
        if importlib.util.find_spec(module) is None:
            return f"the onnxruntime encoder backend needs the `{package}` package: bash tools/install.sh " \
                   f"(or pip install onnxruntime onnx), or pass --encoder-backend torch"
    return None


def cache_dir() -> str:
    """Where exported models are kept: $MEGATRON_SEARCHR1_CACHE/onnx, else ~/.cache/megatron_searchr1/onnx."""
    root = os.environ.get("MEGATRON_SEARCHR1_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "megatron_searchr1")
    return os.path.join(root, "onnx")


def _fingerprint(model_dir: str, input_names: list[str]) -> str:
    """A key that changes whenever the exported graph could: the model's files, the exporter's versions, inputs."""
    import torch
    import transformers

    files = []
    for name in sorted(os.listdir(model_dir)):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path) and (name.endswith((".safetensors", ".bin")) or name == "config.json"):
            st = os.stat(path)
            files.append([name, st.st_size, int(st.st_mtime)])
    key = {"model": os.path.realpath(model_dir), "files": files, "torch": torch.__version__,
           "transformers": transformers.__version__, "opset": OPSET, "inputs": input_names}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def export(model_dir: str, input_names: list[str], path: str) -> None:
    """Write the model's last_hidden_state as an ONNX graph with dynamic batch and length (atomically)."""
    import torch
    from transformers import AutoModel

    # Eager attention: the SDPA path may skip the mask when the traced one has no padding, and a trace keeps
    # whatever branch its sample took. The sample is padded too, for the same reason.
    model = AutoModel.from_pretrained(model_dir, attn_implementation="eager").float().eval()

    class LastHidden(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *inputs):
            return self.inner(**dict(zip(input_names, inputs))).last_hidden_state

    sample = {name: torch.zeros(2, 8, dtype=torch.long) for name in input_names}
    sample["input_ids"] = torch.full((2, 8), 1000, dtype=torch.long)
    if "attention_mask" in sample:
        sample["attention_mask"][0] = 1
        sample["attention_mask"][1, :5] = 1  # row 1 is padded
    axes = {name: {0: "batch", 1: "tokens"} for name in [*input_names, "last_hidden_state"]}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's notes on shape-dependent Python values: checked by the tests
        torch.onnx.export(LastHidden(model), tuple(sample[n] for n in input_names), tmp, input_names=input_names,
                          output_names=["last_hidden_state"], dynamic_axes=axes, opset_version=OPSET, dynamo=False)
    os.replace(tmp, path)  # two servers exporting at once each write their own tmp; the last rename wins, both valid


class OnnxForward:
    """`(inputs: dict of (B, T) int64 arrays) -> (B, T, H) float32 last_hidden_state`, on ONNX Runtime (CPU).

    threads: intra-op threads. Idle worker threads sleep instead of spinning (ORT spins by default), so between
    batches the server's event loop and a trainer beside it get the cores.
    """

    def __init__(self, model_dir: str, input_names: list[str], threads: int):
        import onnxruntime as ort

        self.input_names = list(input_names)
        self.path = os.path.join(cache_dir(), f"{_fingerprint(model_dir, self.input_names)}.onnx")
        if not os.path.exists(self.path):
            logger.info("exporting %s to ONNX (once; cached in %s)", model_dir, self.path)
            export(model_dir, self.input_names, self.path)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(self.path, options, providers=["CPUExecutionProvider"])

    def __call__(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        return self.session.run(None, {name: inputs[name] for name in self.input_names})[0]
