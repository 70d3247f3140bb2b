"""Kernel settings (megatron_searchr1/models/config.py kernel_overrides, models/gpt.py model_settings): model.use_te,
model.recompute and parallel.sequence_parallel reach the TransformerConfig; fusions only with TE on CUDA; the CPU
config unchanged."""
import dataclasses
import functools
import sys
from pathlib import Path

import pytest
import torch

from megatron_searchr1.models import config as model_config
from megatron_searchr1.models import spec
from megatron_searchr1.models.gpt import model_settings, transformer_config_from_hf
from tests.models.test_gpt import megatron_tp1, tiny_config  # noqa: F401  (fixture)

FUSIONS = ("bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion", "apply_rope_fusion",
           "gradient_accumulation_fusion")


def _fields(config) -> dict:
    """The config's fields, init-method partials as (function, keywords) (a partial compares by identity)."""
    out = {}
    for f in dataclasses.fields(config):
        v = getattr(config, f.name)
        out[f.name] = (v.func, v.args, v.keywords) if isinstance(v, functools.partial) else v
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU defaults")
def test_cpu_defaults_build_the_same_config_as_before_with_fusions_off():
    """The CPU demo's numbers depend on it: with the run's defaults the config is the one build_gpt_model made
    before model_settings existed, the local spec, every fusion off."""
    cfg = tiny_config("qwen2")
    got = model_settings(cfg, tp=2, pp=1, params_dtype=torch.float32)
    assert got["use_te"] is False and got["params_dtype"] == torch.float32
    assert _fields(got["config"]) == _fields(transformer_config_from_hf(cfg, tp=2, pp=1))
    assert not any(getattr(got["config"], f) for f in FUSIONS)
    assert got["config"].recompute_granularity is None and not got["config"].sequence_parallel


@pytest.fixture
def te_on_cuda(monkeypatch):
    """Stand in for a GPU machine with Transformer Engine: CUDA reported, TE importable, TE's fused RoPE present
    (TransformerConfig checks for it when apply_rope_fusion is on)."""
    from megatron.core.models.common.embeddings import rope_utils

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(spec, "te_available", lambda: True)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *a, **k: None, raising=False)


@pytest.mark.parametrize("wgrad", [False, True])
def test_te_on_cuda_turns_fusions_sequence_parallel_and_recompute_on(te_on_cuda, monkeypatch, wgrad):
    monkeypatch.setattr(model_config, "wgrad_fusion_available", lambda: wgrad)
    import megatron_searchr1.models.gpt as gpt

    monkeypatch.setattr(gpt, "wgrad_fusion_available", lambda: wgrad)
    got = model_settings(tiny_config("qwen2"), tp=2, pp=1, params_dtype=torch.bfloat16, sequence_parallel=True,
                         recompute="selective")
    c = got["config"]
    assert got["use_te"] is True
    assert c.bias_activation_fusion and c.bias_dropout_fusion and c.masked_softmax_fusion and c.apply_rope_fusion
    assert c.gradient_accumulation_fusion is wgrad  # needs Apex's kernel: Megatron's output layer calls it
    assert c.sequence_parallel and c.recompute_granularity == "selective" and c.recompute_method is None
    full = model_settings(tiny_config("qwen2"), tp=2, pp=1, params_dtype=torch.bfloat16, recompute="full")["config"]
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == ("full", "uniform", 1)
    assert not full.sequence_parallel


def test_use_te_false_keeps_the_local_spec_and_no_fusions_even_with_te(te_on_cuda):
    got = model_settings(tiny_config("qwen2"), tp=1, pp=1, params_dtype=torch.float32, use_te=False)
    assert got["use_te"] is False and not any(getattr(got["config"], f) for f in FUSIONS)


def test_use_te_true_without_transformer_engine_names_the_gpu_extra(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    monkeypatch.setattr(spec, "_te_import_error", None)
    with pytest.raises(RuntimeError, match=r"pip install -e '\.\[gpu\]'.*model\.use_te=false"):
        model_settings(tiny_config("qwen2"), tp=1, pp=1, params_dtype=torch.float32, use_te=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_use_te_true_without_cuda_says_what_to_set():
    with pytest.raises(RuntimeError, match="model.use_te=false"):
        model_settings(tiny_config("qwen2"), tp=1, pp=1, params_dtype=torch.float32, use_te=True)


def test_sequence_parallel_needs_tensor_parallelism():
    with pytest.raises(ValueError, match=r"parallel.sequence_parallel=true .* needs parallel.tp > 1"):
        model_settings(tiny_config("qwen2"), tp=1, pp=1, params_dtype=torch.float32, sequence_parallel=True)
    with pytest.raises(ValueError, match="model.recompute"):
        model_config.kernel_overrides(tp=1, recompute="some")


@pytest.mark.slow  # ~30-60 s: torchrun start-up and two tiny models on a shared 2-core machine
def test_sequence_parallel_on_the_local_spec_equals_sp_off_at_tp2(tmp_path):
    """Megatron's sequence parallelism runs on the CPU over gloo with the local spec (spec.TorchNorm): tiny Qwen2
    (RoPE in SDPAttention, qkv bias) and Qwen3 (q/k norms) models at TP=2 gives the same logits with SP on as off for an odd sequence length (padded to
    a multiple of TP and cut back), and one train_step through the trainer's schedule gives the same loss, gradient
    norm (the norms' partial gradients summed over TP by finalize_model_grads) and updated weights."""
    from tests.dist_utils import run_torchrun

    out = tmp_path / "sp.pt"
    run_torchrun(Path(__file__).with_name("sequence_parallel_script.py"), 2, "--out", out, timeout=600)
    results = torch.load(out)
    for kind in ("qwen2", "qwen3"):
        r = {k.split("/")[1]: v for k, v in results.items() if k.startswith(kind + "/")}
        assert r["logits_sp0"].shape[1] == 13
        torch.testing.assert_close(r["logits_sp1"], r["logits_sp0"], atol=1e-5, rtol=0)
        assert r["loss_sp1"] == pytest.approx(r["loss_sp0"], abs=1e-6)
        assert r["grad_norm_sp1"] == pytest.approx(r["grad_norm_sp0"], rel=1e-5)
        assert r["sp_marked_sp0"] == [] and "decoder.final_layernorm.weight" in r["sp_marked_sp1"]
        for name, want in r["params_sp0"].items():
            torch.testing.assert_close(r["params_sp1"][name], want, atol=1e-5, rtol=0, msg=f"{kind} {name}")


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_gives_the_same_gradients(megatron_tp1, recompute):
    """model.recompute trades compute for activation memory, never the numbers: one backward of the local spec with
    selective (attention core) or full (every layer) recomputation equals the one without."""
    from megatron_searchr1.models.gpt import build_gpt_model
    from tests.models.test_gpt import sample_ids

    cfg = tiny_config("qwen2")
    ids = sample_ids(batch=2, seq=17, seed=5)
    grads = {}
    for mode in ("none", recompute):
        torch.manual_seed(0)
        model = build_gpt_model(cfg, **model_settings(cfg, tp=1, pp=1, params_dtype=torch.float32, recompute=mode))
        assert model.config.recompute_granularity == (None if mode == "none" else mode)
        model.train()
        model(ids[:, :-1], None, None, labels=ids[:, 1:]).mean().backward()
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name, want in grads["none"].items():
        torch.testing.assert_close(grads[recompute][name], want, atol=1e-6, rtol=1e-5, msg=name)


def test_models_built_from_one_settings_dict_do_not_share_their_config(megatron_tp1):
    """runtime builds the actor, the reference and the critic from one model_settings dict; wrap_ddp writes each
    model's DDP hooks into its config, so a shared config would give the actor the critic's no_sync (on GPUs, where
    gradient reduction overlaps backward, its micro-batches would reduce early)."""
    from megatron_searchr1.trainer.roles import build_actor, build_reference
    from megatron_searchr1.trainer.roles import build_critic

    cfg = tiny_config("qwen2")
    settings = model_settings(cfg, tp=1, pp=1, params_dtype=torch.float32)
    actor, critic = build_actor(cfg, **settings), build_critic(cfg, **settings)
    ref = build_reference(cfg, **settings)
    configs = [actor.module.config, critic.module.config, ref.config, settings["config"]]
    assert len({id(c) for c in configs}) == 4
    assert actor.module.config.no_sync_func.__self__ is actor
    assert critic.module.config.no_sync_func.__self__ is critic
