"""vocab_parallel_log_probs (megatron_searchr1/megatron/vocab_parallel.py): values and gradients equal torch's
log_softmax / entropy over the real vocabulary, in one process and split over 2 gloo ranks."""
from pathlib import Path

import pytest
import torch

from megatron_searchr1.megatron.vocab_parallel import vocab_parallel_log_probs
from tests.dist_utils import run_torchrun
from tests.models.test_gpt import megatron_tp1  # noqa: F401  (fixture)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_single_rank_equals_torch(temperature):
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 40, dtype=torch.float64)
    logits[..., 33:] = 30.0  # padded columns
    targets = torch.randint(0, 33, (2, 6))
    x = logits.clone().requires_grad_(True)
    lp, ent = vocab_parallel_log_probs(x, targets, real_vocab_size=33, temperature=temperature, with_entropy=True)
    ref = torch.log_softmax(logits[..., :33] / temperature, -1)
    torch.testing.assert_close(lp.double(), ref.gather(-1, targets[..., None])[..., 0], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), -(ref.exp() * ref).sum(-1), atol=1e-5, rtol=0)

    w1, w2 = torch.randn(2, 6), torch.randn(2, 6)
    (g,) = torch.autograd.grad((w1 * lp).sum() + (w2 * ent).sum(), x)
    y = logits.clone().requires_grad_(True)
    lsm = torch.log_softmax(y[..., :33] / temperature, -1)
    ref_loss = (w1 * lsm.gather(-1, targets[..., None])[..., 0]).sum() + (w2 * -(lsm.exp() * lsm).sum(-1)).sum()
    (g_ref,) = torch.autograd.grad(ref_loss, y)
    torch.testing.assert_close(g.double(), g_ref, atol=1e-5, rtol=0)
    assert float(g[..., 33:].abs().max()) == 0.0


def test_without_entropy_returns_none_and_log_probs_only():
    logits = torch.randn(3, 10, requires_grad=True)
    lp, ent = vocab_parallel_log_probs(logits, torch.tensor([0, 5, 9]), real_vocab_size=10)
    assert ent is None
    lp.sum().backward()
    torch.testing.assert_close(logits.grad, torch.eye(10)[[0, 5, 9]] - torch.softmax(logits.detach(), -1))


def test_bad_arguments():
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_log_probs(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), real_vocab_size=4,
                                 temperature=0)
    with pytest.raises(ValueError, match="must match"):
        vocab_parallel_log_probs(torch.zeros(2, 4), torch.zeros(3, dtype=torch.long), real_vocab_size=4)


@pytest.mark.slow  # ~10-25 s: torchrun start-up on a shared 2-core machine
def test_two_ranks_equal_one():
    out = run_torchrun(Path(__file__).with_name("vocab_parallel_script.py"), 2, timeout=120)
    assert "VOCAB_PARALLEL_OK" in out


def _saved_bytes(fn):
    """Bytes that `fn()`'s autograd graph keeps for backward (what a micro-batch holds until its backward)."""
    sizes = []

    def pack(t):
        sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(sizes), out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_as_a_metric_saves_nothing_more_than_log_probs_alone(temperature):
    """entropy_grad=False (entropy_coeff 0): the entropy's value is the same, detached, and backward keeps only the
    softmax, not the shifted logits as well: one (b, R, V) fp32 tensor less (~5 GB per 8k tokens at a 152k
    vocabulary). The log-prob gradient is the same bit for bit."""
    torch.manual_seed(1)
    logits = torch.randn(2, 5, 64)
    targets = torch.randint(0, 50, (2, 5))
    kw = dict(real_vocab_size=50, temperature=temperature)
    x1, x2, x3 = (logits.clone().requires_grad_(True) for _ in range(3))
    alone, (lp1, _) = _saved_bytes(lambda: vocab_parallel_log_probs(x1, targets, **kw))
    metric, (lp2, ent2) = _saved_bytes(lambda: vocab_parallel_log_probs(x2, targets, with_entropy=True,
                                                                        entropy_grad=False, **kw))
    full, (lp3, ent3) = _saved_bytes(lambda: vocab_parallel_log_probs(x3, targets, with_entropy=True, **kw))
    vocab_tensor = 2 * 5 * 50 * 4
    assert metric == alone and full >= alone + vocab_tensor
    assert not ent2.requires_grad and ent3.requires_grad
    torch.testing.assert_close(ent2, ent3, atol=1e-6, rtol=0)
    assert torch.equal(lp1, lp2) and torch.equal(lp2, lp3)
    lp1.sum().backward()
    lp2.sum().backward()
    assert torch.equal(x1.grad, x2.grad)


def test_entropy_for_the_loss_is_computed_only_when_asked(monkeypatch):
    """The spy: the gradient-carrying entropy (_expected_logit, which makes the saved shifted logits necessary) runs
    for entropy_grad=True only; the metric path runs otherwise."""
    import megatron_searchr1.megatron.vocab_parallel as vp

    calls = []
    for name in ("_expected_logit", "_entropy_metric"):
        real = getattr(vp, name)
        monkeypatch.setattr(vp, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    x = torch.randn(3, 12, requires_grad=True)
    t = torch.tensor([0, 3, 7])
    vocab_parallel_log_probs(x, t, real_vocab_size=12)
    assert calls == []
    vocab_parallel_log_probs(x, t, real_vocab_size=12, with_entropy=True, entropy_grad=False)
    assert calls == ["_entropy_metric"]
    calls.clear()
    vocab_parallel_log_probs(x, t, real_vocab_size=12, with_entropy=True)
    assert calls == ["_expected_logit"]


def test_model_log_probs_leave_out_the_rows_beyond_the_tokenizer(megatron_tp1):
    """A checkpoint whose config.json pads the vocabulary past its tokenizer (Qwen2.5: 152,064 rows, 151,665 ids):
    the trainer's log-probs (megatron/outputs.model_outputs on a model built with tokenizer_vocab_size) equal a
    log_softmax over the tokenizer's ids only, and differ from one over config.json's rows."""
    from megatron_searchr1.megatron.batching import MicroBatch
    from megatron_searchr1.megatron.outputs import model_outputs
    from megatron_searchr1.models.gpt import build_gpt_model
    from tests.models.test_gpt import tiny_config

    cfg = tiny_config("qwen2", vocab_size=250)
    tok = 230
    torch.manual_seed(0)
    model = build_gpt_model(cfg, tokenizer_vocab_size=tok).eval()
    assert model.hf_vocab_size == tok and model.output_layer.weight.shape[0] == 256
    with torch.no_grad():
        model.output_layer.weight[tok:250] += 0.5  # give the padding rows real mass, as trained checkpoints may
    ids = torch.randint(0, tok, (2, 12))
    mb = MicroBatch(indices=[0, 1], input_ids=ids, prompt_lens=torch.tensor([4, 4]),
                    response_lens=torch.tensor([8, 8]), response_mask=torch.ones(2, 8), fields={})
    with torch.no_grad():
        logits = model(ids, None, None)  # (b, T, 256): TP=1 holds the whole padded vocabulary
        got = model_outputs(model, logits, mb, with_entropy=True)
    pos, targets = mb.response_positions(), mb.response_targets()
    rows = torch.arange(2).unsqueeze(1)
    at = logits[rows, pos].double()  # (b, R, 256)
    masked = torch.log_softmax(at.masked_fill(torch.arange(256) >= tok, float("-inf")), -1)
    want = masked.gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(got["log_probs"].double(), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(got["entropy"].double(), -(masked.exp() * masked.nan_to_num(0.0)).sum(-1),
                               atol=1e-5, rtol=0)
    unmasked = torch.log_softmax(at[..., :250], -1).gather(-1, targets[..., None])[..., 0]
    assert float((got["log_probs"].double() - unmasked).abs().max()) > 1e-3
