"""Masked statistics: only selected entries count, NaNs at masked entries never leak, fewer than 2 entries defined."""
import math

import pytest
import torch

from megatron_searchr1.algo import masked_mean, masked_sum, masked_var, masked_whiten
from tests.fake_dp import run_ranks

V = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
M = torch.tensor([[1, 1, 0], [1, 0, 1]])


def test_masked_sum_and_mean():
    assert masked_sum(V, M).item() == 13.0
    torch.testing.assert_close(masked_sum(V, M, axis=-1), torch.tensor([3.0, 10.0]))
    assert masked_mean(V, M).item() == pytest.approx(13 / 4)
    torch.testing.assert_close(masked_mean(V, M.bool(), axis=-1), torch.tensor([1.5, 5.0]))
    torch.testing.assert_close(masked_mean(V, M.float(), axis=0), torch.tensor([2.5, 2.0, 6.0]))
    torch.testing.assert_close(masked_mean(V, torch.zeros_like(M), axis=-1), torch.tensor([0.0, 0.0]))


def test_masked_var_and_whiten():
    # selected: 1, 2, 4, 6: mean 13/4, squared deviations sum 14.75, unbiased var 14.75/3
    var = 14.75 / 3
    assert masked_var(V, M).item() == pytest.approx(var)
    assert masked_var(V, M, unbiased=False).item() == pytest.approx(14.75 / 4)
    w = masked_whiten(V, M)
    sd = math.sqrt(var)
    expected = torch.tensor([[(1 - 3.25) / sd, (2 - 3.25) / sd, 0.0], [(4 - 3.25) / sd, 0.0, (6 - 3.25) / sd]])
    torch.testing.assert_close(w, expected)
    kept = masked_whiten(V, M, shift_mean=False)
    torch.testing.assert_close(kept[M.bool()], expected[M.bool()] + 3.25)


def test_fewer_than_two_entries_are_defined_not_an_error():
    """A DP rank whose every trajectory was dropped (all-zero mask) or a batch with one token must not raise: the
    other ranks would wait for it in the next collective."""
    one, none = torch.tensor([[1, 0, 0], [0, 0, 0]]), torch.zeros(2, 3)
    assert masked_var(V, one).item() == 0.0 and masked_var(V, none).item() == 0.0
    assert masked_whiten(V, one).abs().sum() == 0 and masked_whiten(V, none).abs().sum() == 0
    assert torch.isfinite(masked_whiten(V, one)).all()


def test_whitening_over_shards_equals_whitening_the_whole_batch():
    """DP=2 with the statistics all-reduced gives DP=1's whitening."""
    torch.manual_seed(0)
    X, M = torch.randn(6, 5) * 3 + 1, (torch.rand(6, 5) > 0.3).int()
    M[4:] = 0  # the second shard has one row without tokens: it still takes part in the reductions
    whole = masked_whiten(X, M)
    shards = [(X[:3], M[:3]), (X[3:], M[3:])]
    out = run_ranks([lambda reduce, sh=sh: masked_whiten(*sh, reduce=reduce) for sh in shards])
    torch.testing.assert_close(torch.cat(out), whole, atol=1e-5, rtol=1e-5)
    # without the reduction each shard is whitened on its own statistics: not the whole batch's
    assert not torch.allclose(torch.cat([masked_whiten(*shards[0]), masked_whiten(*shards[1])]), whole, atol=1e-3)


@pytest.mark.slow
def test_gae_whitening_over_two_gloo_ranks_equals_one_rank():
    """The same check with a real all-reduce (trainer/losses.dp_sum over gloo) through GAE."""
    import os

    from tests.dist_utils import run_torchrun

    out = run_torchrun(os.path.join(os.path.dirname(__file__), "whiten_dp_script.py"), 2, timeout=300)
    assert "WHITEN_DP_OK" in out
