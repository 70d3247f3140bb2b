"""Rollout engines behind one interface (`rollout/engine.py`): `make_engine("vllm" | "hf", model_dir, **kw)`.

    engine = make_engine("vllm", "/path/to/hf_dir", dtype="float32", kv_cache_gib=1)   # the default engine
    engine = make_engine("hf", "/path/to/hf_dir")        # the transformers reference (cross-checks, no vLLM)

Each engine module is imported only when asked for, so `hf` works on machines without vLLM.
"""
from __future__ import annotations

ENGINES = ("vllm", "hf")


def make_engine(name: str, model_dir: str, **kwargs):
    """Build the engine `name` on the Hugging Face checkpoint in `model_dir`; kwargs go to its constructor."""
    if name == "vllm":
        from megatron_searchr1.rollout.engines.vllm_engine import VLLMEngine

        return VLLMEngine(model_dir, **kwargs)
    if name == "hf":
        from megatron_searchr1.rollout.engines.hf_engine import HFEngine

        return HFEngine(model_dir, **kwargs)
    raise ValueError(f"unknown rollout engine {name!r}; use one of {', '.join(ENGINES)}")
