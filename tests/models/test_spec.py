"""Tests for megatron_searchr1/models/spec.py: every norm (the block's final one included) follows `use_te`, and a
Transformer Engine that fails to import says why."""
from __future__ import annotations

import logging
import sys

import pytest
import torch

from megatron_searchr1.models import spec
from megatron_searchr1.models.gpt import build_gpt_model, gpt_model_kwargs, transformer_config_from_hf
from tests.models.test_gpt import megatron_tp1, tiny_config  # noqa: F401  (fixture)


def test_final_norm_follows_the_spec_not_what_is_installed(megatron_tp1, monkeypatch):
    """Handed a layer spec, Megatron builds the block's final norm from whatever is installed (Apex's LayerNorm-only
    FusedLayerNorm where Apex imports, TE's where TE does). Stand in for such a machine: the build must not use it."""
    import megatron.core.transformer.transformer_block as tb
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    class InstalledNorm(torch.nn.Module):
        def __init__(self, *args, **kwargs):
            raise AssertionError("the final norm came from the installed-norm fallback, not from the spec")

    monkeypatch.setattr(tb, "LayerNormImpl", InstalledNorm)
    cfg = tiny_config("qwen2", num_hidden_layers=2)
    model = build_gpt_model(cfg)
    assert isinstance(model.decoder.final_layernorm, torch.nn.RMSNorm)
    assert all(isinstance(layer.input_layernorm, torch.nn.RMSNorm) for layer in model.decoder.layers)
    block = gpt_model_kwargs(cfg, transformer_config_from_hf(cfg), use_te=False)["transformer_layer_spec"]
    assert isinstance(block, TransformerBlockSubmodules) and block.layer_norm is spec.TorchNorm
    assert len(block.layer_specs) == 2


def test_qk_norm_spec_uses_torch_norms():
    layer = spec.layer_spec(use_te=False, qk_norm=True).submodules.self_attention.submodules

    assert layer.q_layernorm is spec.TorchNorm and layer.k_layernorm is spec.TorchNorm
    assert spec.layer_spec(use_te=False).submodules.self_attention.submodules.q_layernorm is not spec.TorchNorm


def test_te_import_failure_is_logged_not_hidden(monkeypatch, caplog):
    """With CUDA present but TE broken, the local spec is chosen and the log says why (once)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # `import transformer_engine...` raises ImportError
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    monkeypatch.setattr(spec, "_te_import_error", None)
    with caplog.at_level(logging.WARNING, logger=spec.__name__):
        assert spec.te_available() is False
        assert spec.resolve_use_te(None) is False
    warnings = [r for r in caplog.records if "Transformer Engine does not import" in r.getMessage()]
    assert len(warnings) == 1 and "halted" in warnings[0].getMessage()
    with pytest.raises(RuntimeError, match="halted"):
        spec.resolve_use_te(True)


def test_torch_norm_is_megatrons_without_sp_and_marks_its_weight_for_the_tp_sum_with_sp():
    """Without sequence parallelism TorchNorm builds exactly what WrappedTorchNorm builds (the CPU numbers do not
    move); with it (which WrappedTorchNorm refuses) the same norm, its weight marked `sequence_parallel` so that
    finalize_model_grads sums the per-rank partial gradients over TP."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    cfg = tiny_config("qwen2")
    off = transformer_config_from_hf(cfg, tp=2)
    on = transformer_config_from_hf(cfg, tp=2, sequence_parallel=True)
    a, b = spec.TorchNorm(off, 64, eps=1e-6), WrappedTorchNorm(off, 64, eps=1e-6)
    assert type(a) is type(b) is torch.nn.RMSNorm and a.eps == b.eps and torch.equal(a.weight, b.weight)
    assert not getattr(a.weight, "sequence_parallel", False)
    with pytest.raises(AssertionError, match="sequence parallel"):
        WrappedTorchNorm(on, 64)
    c = spec.TorchNorm(on, 64, eps=1e-6)
    assert type(c) is torch.nn.RMSNorm and c.weight.sequence_parallel is True
