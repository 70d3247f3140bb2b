"""A collapse detector for the lazy-likelihood-displacement death spiral (see ``llds``): the mean log-likelihood of
positive-advantage tokens (``llds``' metric ``logp_pos_mean``, logged every step) first stagnates, then decays,
then falls fast as training collapses. A fall of more than a few tenths of a nat over some tens of steps is the
warning sign; the trainer can stop (``trainer.stop_on_collapse``) or just report it.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence


def likelihood_drop(history: Sequence[Optional[float]], window: int) -> Optional[float]:
    """How far the value fell over the last `window` steps: ``value window steps ago - latest value`` (positive
    when it fell), over the steps that have a value; None until there are ``window + 1`` of them.

    Steps logged as None or NaN (a batch without a positive-advantage token) are skipped, so the window counts
    measured steps.

    >>> likelihood_drop([-0.30, -0.32, None, -0.41, -0.55], window=3)  # -0.30 - (-0.55)
    0.25
    """
    if window < 1:
        raise ValueError(f"collapse window must be >= 1 step, got {window}")
    values = [float(v) for v in history if v is not None and not math.isnan(float(v))]
    if len(values) <= window:
        return None
    return round(values[-1 - window] - values[-1], 12)


def has_collapsed(history: Sequence[Optional[float]], window: int, threshold: float) -> bool:
    """True when the mean log-likelihood of positive-advantage tokens fell by more than `threshold` nats over the
    last `window` measured steps (``likelihood_drop``); False while the history is shorter than that.

    >>> has_collapsed([-0.30, -0.32, -0.41, -0.55], window=3, threshold=0.2), has_collapsed([-0.3, -0.4], 3, 0.2)
    (True, False)
    """
    if threshold <= 0:
        raise ValueError(f"collapse threshold must be > 0 nats, got {threshold}")
    drop = likelihood_drop(history, window)
    return drop is not None and drop > threshold
