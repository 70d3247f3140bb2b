"""Statistics over the tokens a mask selects (verl's ``masked_mean`` / ``masked_whiten``).

Masked-out entries are *selected away* (``torch.where``), not multiplied by zero, so a NaN or inf sitting at a
mask-0 position (a retrieved token's log-prob, a padded value) can never leak into a result. Masks may be bool,
int or float; nonzero means "counts".
"""
from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is nonzero; over everything (axis None) or along `axis`.

    >>> masked_sum(torch.tensor([[1., 2., float("nan")]]), torch.tensor([[1, 1, 0]]))
    tensor(3.)
    """
    selected = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return selected.sum() if axis is None else selected.sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of `values` over the selected entries; 0 where nothing is selected.

    >>> masked_mean(torch.tensor([[1., 2., 9.], [4., 9., 9.]]), torch.tensor([[1, 1, 0], [1, 0, 0]]), axis=-1)
    tensor([1.5000, 4.0000])
    >>> masked_mean(torch.tensor([5.]), torch.tensor([0]))
    tensor(0.)
    """
    count = mask.bool().sum() if axis is None else mask.bool().sum(dim=axis)
    return masked_sum(values, mask, axis) / count.clamp(min=1).to(values.dtype)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the selected entries (with Bessel's correction by default, as verl).

    >>> masked_var(torch.tensor([1., 3., 100.]), torch.tensor([1, 1, 0]))  # mean 2, squares 1+1, / (2-1)
    tensor(2.)
    """
    count = int(mask.bool().sum())
    if count < (2 if unbiased else 1):
        raise ValueError(
            f"the variance needs at least {2 if unbiased else 1} unmasked entries, got {count}; "
            "use a larger batch (or check that the loss mask is not all zero)"
        )
    centered = values - masked_mean(values, mask)
    var = masked_mean(centered * centered, mask)
    return var * count / (count - 1) if unbiased else var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise the selected entries to mean 0, variance 1 (statistics from those entries only); masked entries
    come out as 0. With ``shift_mean=False`` the mean is kept (only the scale changes).

    >>> masked_whiten(torch.tensor([1., 3., 100.]), torch.tensor([1, 1, 0]))  # mean 2, std sqrt(2)
    tensor([-0.7071,  0.7071,  0.0000])
    """
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros((), dtype=whitened.dtype, device=whitened.device))
