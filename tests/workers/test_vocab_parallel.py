"""vocab_parallel_log_probs (megatron_searchr1/megatron/vocab_parallel.py): values and gradients equal torch's
log_softmax / entropy over the real vocabulary, in one process and split over 2 gloo ranks."""
from pathlib import Path

import pytest
import torch

from megatron_searchr1.megatron.vocab_parallel import vocab_parallel_log_probs
from tests.dist_utils import run_torchrun


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
