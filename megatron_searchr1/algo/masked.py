"""Statistics over the tokens a mask selects (verl's ``masked_mean`` / ``masked_whiten``).

Masked-out entries are *selected away* (``torch.where``), not multiplied by zero, so a NaN or inf sitting at a
mask-0 position (a retrieved token's log-prob, a padded value) can never leak into a result. Masks may be bool,
int or float; nonzero means "counts".
"""
from __future__ import annotations

from typing import Callable, Optional

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


Reduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a 1-D float64 tensor over the ranks that hold the rest of the batch (e.g. an all-reduce over DP); every
rank must call it the same number of times. None: this batch is the whole batch."""


def masked_moments(values: torch.Tensor, mask: torch.Tensor, reduce: Optional[Reduce] = None,
                   unbiased: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, variance) of the selected entries, over the whole batch when `reduce` sums across its shards.

    Two passes (sum and count, then the squared deviations from the global mean), each reduced once, in float64:
    the same numbers as one process holding the whole batch. With fewer than 2 selected entries (1 when
    ``unbiased=False``) the variance is 0, not an error: a rank whose every trajectory was dropped still takes
    part in the reductions, and a batch with a single token has no spread to normalise.

    >>> masked_moments(torch.tensor([1., 3., 100.]), torch.tensor([1, 1, 0]))
    (tensor(2.), tensor(2.))
    """
    m = mask.bool()
    v = values.detach().to(torch.float64)
    first = torch.stack([masked_sum(v, m), m.sum().to(torch.float64)])  # (2,) sum, count
    if reduce is not None:
        first = reduce(first)
    total, count = first[0], first[1]
    mean = total / count.clamp(min=1)
    second = masked_sum((v - mean) ** 2, m).reshape(1)  # (1,)
    if reduce is not None:
        second = reduce(second)
    need = 2 if unbiased else 1
    var = second[0] / (count - 1 if unbiased else count) if count >= need else torch.zeros((), dtype=torch.float64)
    return mean.to(values.dtype), var.to(values.dtype)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the selected entries (with Bessel's correction by default, as verl); 0 with fewer than 2
    selected entries (verl raises; see `masked_moments`).

    >>> masked_var(torch.tensor([1., 3., 100.]), torch.tensor([1, 1, 0]))  # mean 2, squares 1+1, / (2-1)
    tensor(2.)
    >>> masked_var(torch.tensor([5.]), torch.tensor([1]))
    tensor(0.)
    """
    return masked_moments(values, mask, unbiased=unbiased)[1]


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  reduce: Optional[Reduce] = None) -> torch.Tensor:
    """Normalise the selected entries to mean 0, variance 1 (statistics from those entries only, over the whole
    batch when `reduce` sums across its shards); masked entries come out as 0. With ``shift_mean=False`` the mean
    is kept (only the scale changes). Fewer than 2 selected entries: variance 0, so a lone entry becomes 0.

    >>> masked_whiten(torch.tensor([1., 3., 100.]), torch.tensor([1, 1, 0]))  # mean 2, std sqrt(2)
    tensor([-0.7071,  0.7071,  0.0000])
    """
    mean, var = masked_moments(values, mask, reduce)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros((), dtype=whitened.dtype, device=whitened.device))
