"""DAPO's overlong shaping, overlong filtering and dynamic-sampling group filter against hand-computed values."""
import pytest
import torch

from megatron_searchr1.algo.dapo import filter_groups, overlong_filter_mask, overlong_penalty


def test_overlong_penalty_is_zero_then_linear_in_the_buffer_then_the_full_factor():
    # L = 100, N = 20: the buffer starts after 80 tokens; factor 0.5
    lengths = torch.tensor([50, 80, 81, 90, 95, 100, 130])
    got = overlong_penalty(lengths, max_response_length=100, overlong_buffer=20, penalty_factor=0.5)
    # (80 - len) / 20 * 0.5 inside (80, 100]: 81 -> -1/40, 90 -> -10/40, 95 -> -15/40, 100 -> -20/40; 130 -> -0.5
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.025, -0.25, -0.375, -0.5, -0.5])


def test_overlong_penalty_refuses_a_buffer_outside_the_budget():
    with pytest.raises(ValueError, match="overlong_buffer must be in"):
        overlong_penalty(torch.tensor([1]), max_response_length=10, overlong_buffer=0)
    with pytest.raises(ValueError, match="overlong_buffer must be in"):
        overlong_penalty(torch.tensor([1]), max_response_length=10, overlong_buffer=11)
    with pytest.raises(ValueError, match="penalty_factor must be >= 0"):
        overlong_penalty(torch.tensor([1]), max_response_length=10, overlong_buffer=2, penalty_factor=-1)


def test_overlong_filter_zeroes_the_loss_mask_of_truncated_rows_only():
    mask = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]])
    got = overlong_filter_mask(mask, torch.tensor([False, True, False]))
    assert got.tolist() == [[1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 0, 0]]
    with pytest.raises(ValueError, match="2 truncated flags for 3 rows"):
        overlong_filter_mask(mask, torch.tensor([True, False]))


def test_filter_groups_keeps_groups_with_different_scores_by_id_in_any_order():
    scores = [1.0, 0.0, 1.0, 1.0, 0.5, 0.0, 0.5]
    index = ["a", "b", "a", "c", "b", "d", "c"]
    # a: (1, 1) all equal -> drop; b: (0, 0.5) -> keep; c: (1, 0.5) -> keep; d: (0,) one row -> drop
    keep, counts = filter_groups(scores, index=index)
    assert keep.tolist() == [False, True, False, True, True, False, True]
    assert counts == {"groups": 4, "kept_groups": 2, "kept_rows": 4}


def test_filter_groups_by_size_and_argument_errors():
    keep, counts = filter_groups(torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0, 0.0]), group_size=3)
    assert keep.tolist() == [False, False, False, True, True, True]
    assert counts == {"groups": 2, "kept_groups": 1, "kept_rows": 3}
    with pytest.raises(ValueError, match="exactly one of index"):
        filter_groups([0.0, 1.0])
    with pytest.raises(ValueError, match="exactly one of index"):
        filter_groups([0.0, 1.0], index=[0, 0], group_size=2)
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        filter_groups([0.0] * 6, group_size=4)


def test_filter_groups_judges_what_trains():
    """Rows that leave their group (`counted` False: a failed search) are out of its statistics; rows that stay but
    do not train (`trainable` False: overlong-filtered) count in them but cannot carry the gradient."""
    # group 0: [1, 0 failed search]: the 1 is alone -> advantage 0 -> not informative (main: kept)
    # group 1: four right + one overlong-filtered 0: the right ones move -> informative
    # group 2: [0 trainable, 1 filtered, 1 filtered]... the trainable 0 moves (mean 2/3) -> informative
    # group 3: [0.5 filtered, 0.5 trainable, 0.5 trainable, 0.5 filtered] -> equal -> not informative
    scores = [1.0, 0.0] + [1.0] * 4 + [0.0] + [0.0, 1.0, 1.0] + [0.5] * 4
    index = [0, 0] + [1] * 5 + [2] * 3 + [3] * 4
    counted = [True, False] + [True] * 12
    trainable = [True] * 6 + [False] + [True, False, False] + [False, True, True, False]
    keep, counts = filter_groups(scores, index=index, trainable=trainable, counted=counted)
    assert keep.tolist() == [False] * 2 + [True] * 8 + [False] * 4
    assert counts == {"groups": 4, "kept_groups": 2, "kept_rows": 8}
    # a group whose only mover cannot train: [1 filtered, 0, 0] -> the trainable zeros move (mean 1/3): kept;
    # [1 filtered, 0 filtered] -> nothing trains: dropped
    keep, _ = filter_groups([1.0, 0.0, 0.0, 1.0, 0.0], index=[0, 0, 0, 1, 1], trainable=[False, True, True, False,
                                                                                              False])
    assert keep.tolist() == [True, True, True, False, False]
