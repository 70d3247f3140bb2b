"""The collapse detector on hand-made likelihood histories."""
import pytest

from megatron_searchr1.algo.collapse import has_collapsed, likelihood_drop


def test_a_fall_over_the_window_larger_than_the_threshold_is_a_collapse():
    steady = [-0.30, -0.31, -0.29, -0.30, -0.32]
    decaying = steady + [-0.40, -0.55, -0.80]
    # window 3 ends at -0.80 and starts 3 measured steps earlier at -0.32: a fall of 0.48 nats
    assert likelihood_drop(decaying, window=3) == pytest.approx(0.48)
    assert has_collapsed(decaying, window=3, threshold=0.4)
    assert not has_collapsed(decaying, window=3, threshold=0.5)
    # the steady run: -0.31 -> -0.32 over 3 steps, a fall of 0.01
    assert likelihood_drop(steady, window=3) == pytest.approx(0.01)
    assert not has_collapsed(steady, window=3, threshold=0.1)


def test_a_rise_is_not_a_collapse_and_short_histories_say_nothing():
    assert likelihood_drop([-0.8, -0.5, -0.3], window=2) == pytest.approx(-0.5)
    assert not has_collapsed([-0.8, -0.5, -0.3], window=2, threshold=0.1)
    assert likelihood_drop([-0.3, -0.9], window=2) is None
    assert not has_collapsed([-0.3, -0.9], window=2, threshold=0.1)


def test_unmeasured_steps_are_skipped():
    # None / NaN: steps without a positive-advantage token; the window counts the 3 measured steps before -0.9
    history = [-0.3, None, -0.35, float("nan"), -0.5, -0.9]
    assert likelihood_drop(history, window=3) == pytest.approx(-0.3 - -0.9)


def test_bad_window_or_threshold_is_refused():
    with pytest.raises(ValueError, match="window must be >= 1"):
        likelihood_drop([-0.3], window=0)
    with pytest.raises(ValueError, match="threshold must be > 0"):
        has_collapsed([-0.3], window=1, threshold=0)
