"""Masked statistics: only selected entries count, NaNs at masked entries never leak, clear errors for too few."""
import math

import pytest
import torch

from megatron_searchr1.algo import masked_mean, masked_sum, masked_var, masked_whiten

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


def test_masked_var_needs_two_entries():
    with pytest.raises(ValueError, match="at least 2 unmasked entries, got 1"):
        masked_whiten(V, torch.tensor([[1, 0, 0], [0, 0, 0]]))
