"""SDPAttention equals Megatron's DotProductAttention (forward and gradients, GQA, causal or explicit mask)."""
from __future__ import annotations

import pytest
import torch

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_searchr1.models.attention import SDPAttention
from tests.models.test_gpt import megatron_tp1  # noqa: F401  (fixture)


def _config(heads=4, groups=2, dropout=0.0, **kw):
    return TransformerConfig(num_layers=1, hidden_size=heads * 16, num_attention_heads=heads, num_query_groups=groups,
                             attention_dropout=dropout, hidden_dropout=0.0, use_cpu_initialization=True, **kw)


def _pair(config, mask_type=AttnMaskType.causal):
    kw = dict(config=config, layer_number=1, attn_mask_type=mask_type, attention_type="self")
    return SDPAttention(**kw), DotProductAttention(**kw)


def _qkv(s=24, b=3, heads=4, groups=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s, b, heads, d, generator=g, requires_grad=True)
    k = torch.randn(s, b, groups, d, generator=g, requires_grad=True)
    v = torch.randn(s, b, groups, d, generator=g, requires_grad=True)
    return q, k, v


def _fwd_bwd(module, q, k, v, mask):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = module(q, k, v, mask)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    (out * weights).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("heads, groups", [(4, 2), (4, 4), (4, 1)])
def test_causal_matches_dot_product_attention(megatron_tp1, heads, groups):
    ours, ref = _pair(_config(heads, groups))
    q, k, v = _qkv(heads=heads, groups=groups)
    got, want = _fwd_bwd(ours, q, k, v, None), _fwd_bwd(ref, q, k, v, None)
    assert got[0].shape == (24, 3, heads * 16)
    for a, b, name in zip(got, want, ["out", "dq", "dk", "dv"]):
        assert (a - b).abs().max().item() <= 1e-5, name
    # Causality: the first position sees only itself, so changing the last key leaves it unchanged.
    k2 = k.detach().clone()
    k2[-1] += 5.0
    assert torch.allclose(ours(q, k2, v, None)[0], got[0][0], atol=1e-6)
    assert not torch.allclose(ours(q, k2, v, None)[-1], got[0][-1], atol=1e-3)


def test_explicit_padding_mask_matches_dot_product_attention(megatron_tp1):
    ours, ref = _pair(_config())
    q, k, v = _qkv(s=12, b=2)
    # Megatron's convention: True = masked out. Causal plus two padded keys at the end of row 1.
    mask = torch.triu(torch.ones(12, 12, dtype=torch.bool), diagonal=1).expand(2, 1, 12, 12).clone()
    mask[1, :, :, 10:] = True
    mask[1, :, 10:, :] = False  # keep padded queries' rows non-empty (their outputs are never used)
    mask[1, :, 10:, 10:] = True
    got, want = _fwd_bwd(ours, q, k, v, mask), _fwd_bwd(ref, q, k, v, mask)
    for a, b, name in zip(got, want, ["out", "dq", "dk", "dv"]):
        assert (a - b).abs().max().item() <= 1e-5, name


def test_dropout_only_in_training(megatron_tp1):
    ours, _ = _pair(_config(dropout=0.5))
    q, k, v = _qkv()
    ours.eval()
    clean = ours(q, k, v, None)
    ours.train()
    dropped = ours(q, k, v, None)
    assert not torch.allclose(clean, dropped)
    ours.eval()
    assert torch.equal(ours(q, k, v, None), clean)


def test_unsupported_features_fail_loudly(megatron_tp1):
    with pytest.raises(ValueError, match="sliding-window"):
        SDPAttention(_config(window_size=(8, 0)), 1, AttnMaskType.causal, "self")
    ours, _ = _pair(_config())
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="bias"):
        ours(q, k, v, None, attention_bias=torch.zeros(1))


def test_rope_in_core_attention_is_bit_identical_to_megatron_rope(megatron_tp1):
    """SDPSelfAttention's RoPE shortcut against the same layer taking Megatron's own RoPE path."""
    from transformers import Qwen2Config

    from megatron_searchr1.models.gpt import build_gpt_model

    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    model = build_gpt_model(cfg)
    attn = model.decoder.layers[0].self_attention
    assert attn.rope_in_core
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(3))

    def run(shortcut):
        attn.rope_in_core = shortcut
        model.zero_grad(set_to_none=True)
        logits = model(ids, None, None)
        logits.square().mean().backward()
        return logits.detach(), attn.linear_qkv.weight.grad.clone()

    (fast_logits, fast_grad), (meg_logits, meg_grad) = run(True), run(False)
    assert torch.equal(fast_logits, meg_logits)
    assert torch.allclose(fast_grad, meg_grad, atol=1e-6, rtol=1e-5)


def test_model_with_explicit_causal_mask_equals_implicit_causal(megatron_tp1):
    """The masked path (batch kept, RoPE in standard layout) gives the same logits as the unmasked fast path."""
    from transformers import Qwen2Config

    from megatron_searchr1.models.gpt import build_gpt_model

    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = build_gpt_model(cfg).eval()
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(4))
    causal = torch.triu(torch.ones(20, 20, dtype=torch.bool), diagonal=1).expand(2, 1, 20, 20)
    with torch.no_grad():
        implicit = model(ids, None, None)
        explicit = model(ids, None, causal)
    assert (implicit - explicit).abs().max().item() <= 1e-5


def test_training_forward_after_inference_mode_forward_at_same_length(megatron_tp1):
    """The trainer computes old log-probs under torch.inference_mode, then trains on the same batch: the RoPE
    cos/sin cache must not hand an inference tensor to the training forward (it cannot be saved for backward)."""
    from transformers import Qwen2Config

    from megatron_searchr1.models.gpt import build_gpt_model

    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = build_gpt_model(cfg)
    assert model.decoder.layers[0].self_attention.rope_in_core
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        old = model(ids, None, None)
    new = model(ids, None, None)
    new.square().mean().backward()
    assert model.decoder.layers[0].self_attention.linear_qkv.weight.grad.abs().sum() > 0
    assert torch.equal(old, new.detach())
    with torch.inference_mode():  # and back: the training entry does not disturb inference
        assert torch.equal(model(ids, None, None), old)
