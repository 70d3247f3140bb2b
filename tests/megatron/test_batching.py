"""Token-budget micro-batches and mini-batches (megatron_searchr1/megatron/batching.py)."""
import random

import pytest
import torch

from megatron_searchr1.megatron.batching import (
    TrainSequence, make_micro_batches, padding_share, plan_micro_batches, restore_order, split_mini_batches,
)


def random_seqs(n, seed=0, max_prompt=30, max_response=60):
    rng = random.Random(seed)
    seqs = []
    for i in range(n):
        p, r = rng.randint(1, max_prompt), rng.randint(0, max_response)
        seqs.append(TrainSequence(prompt_ids=[rng.randrange(100) for _ in range(p)],
                                  response_ids=[rng.randrange(100) for _ in range(r)], loss_mask=torch.ones(r),
                                  advantages=torch.arange(r, dtype=torch.float32) + i))
    return seqs


@pytest.mark.parametrize("budget", [90, 200, 1000])
def test_budget_respected_and_every_sequence_once(budget):
    seqs = random_seqs(50)
    mbs = make_micro_batches(seqs, budget)
    assert all(mb.num_padded_tokens <= budget for mb in mbs)
    assert sorted(i for mb in mbs for i in mb.indices) == list(range(50))
    for mb in mbs:
        for row, i in enumerate(mb.indices):
            s = seqs[i]
            P, R = len(s.prompt_ids), len(s.response_ids)
            assert mb.input_ids[row, :P + R].tolist() == s.prompt_ids + s.response_ids  # right-padded
            assert mb.response_mask[row].sum() == R
            assert mb["advantages"][row, :R].tolist() == s.advantages.tolist()
            assert mb["advantages"][row, R:].abs().sum() == 0
            assert mb.response_targets()[row, :R].tolist() == s.response_ids
            # the position predicting response token j is P + j - 1
            assert mb.response_positions()[row, :R].tolist() == list(range(P - 1, P + R - 1))
        assert "advantages" in mb and "values" not in mb  # only the fields that are set


def test_order_restored():
    seqs = random_seqs(23, seed=1)
    mbs = make_micro_batches(seqs, 150)
    assert len(mbs) > 3
    per_mb = [[mb["advantages"][row, 0].item() for row in range(mb.num_rows)] for mb in mbs]
    assert restore_order(per_mb, mbs) == [float(i) if seqs[i].response_ids else 0.0 for i in range(23)]


def test_plan_is_deterministic_and_sorted_by_length():
    lengths = [5, 9, 5, 2, 9, 7]
    plan = plan_micro_batches(lengths, 18)
    assert plan == plan_micro_batches(list(lengths), 18)
    flat = [i for mb in plan for i in mb]
    assert flat == [1, 4, 5, 0, 2, 3]  # longest first, ties in input order


def _all_cuts(n):
    """Every way to cut range(n) into consecutive groups."""
    if n == 0:
        yield []
        return
    for first in range(1, n + 1):
        for rest in _all_cuts(n - first):
            yield [first] + rest


@pytest.mark.parametrize("charge", [0, 5, 1000])
def test_plan_is_the_cheapest_cut_of_the_sorted_order(charge):
    rng = random.Random(charge)
    for _ in range(20):
        lengths = [rng.randint(1, 12) for _ in range(rng.randint(1, 9))]
        budget = rng.randint(12, 40)
        L = sorted(lengths, reverse=True)

        def cost(groups):
            total, start = 0, 0
            for size in groups:
                total += size * L[start] + charge
                start += size
            return total

        feasible = [g for g in _all_cuts(len(L))
                    if all(size * L[sum(g[:k])] <= budget for k, size in enumerate(g))]
        plan = plan_micro_batches(lengths, budget, micro_batch_cost_tokens=charge)
        assert cost([len(mb) for mb in plan]) == min(cost(g) for g in feasible)
        if charge == 1000:  # a large charge: the fewest micro-batches
            assert len(plan) == min(len(g) for g in feasible)


def test_padding_share():
    seqs = [TrainSequence([1, 2], [3, 4], torch.ones(2)), TrainSequence([1], [2], torch.ones(1))]
    mbs = make_micro_batches(seqs, 100)  # one micro-batch of 2 rows x 4 tokens, 6 real
    assert padding_share(mbs) == pytest.approx(2 / 8)
    assert padding_share(make_micro_batches(seqs, 4)) == 0.0  # one row per micro-batch


def test_errors_say_what_to_change():
    with pytest.raises(ValueError, match="raise the budget"):
        make_micro_batches(random_seqs(3), 10)
    with pytest.raises(ValueError, match="empty prompt"):
        make_micro_batches([TrainSequence([], [1], torch.ones(1))], 10)
    with pytest.raises(ValueError, match="per-token fields cover the response only"):
        make_micro_batches([TrainSequence([1], [1, 2], torch.ones(3))], 10)
    with pytest.raises(ValueError, match="mini-batches"):
        split_mini_batches(3, 4)


def test_mini_batches_cover_everything_in_equal_counts():
    for seed in (None, 0, 1):
        minis = split_mini_batches(10, 3, seed=seed)
        assert len(minis) == 3 and sorted(len(m) for m in minis) == [3, 3, 4]
        assert sorted(i for m in minis for i in m) == list(range(10))
    assert split_mini_batches(10, 3, seed=0) != split_mini_batches(10, 3, seed=1)


def test_padded_to_a_multiple_of_tp_keeps_every_response_position_and_target():
    """Sequence parallelism needs the sequence length to divide by TP: padded_to adds columns after every row's
    last token; the response tokens' positions, the targets and the masks are unchanged."""
    from megatron_searchr1.megatron.batching import make_micro_batches

    seqs = [TrainSequence([5, 6, 7], [8, 9], torch.ones(2)), TrainSequence([4], [3, 2, 1, 7], torch.ones(4))]
    (mb,) = make_micro_batches(seqs, 100)
    assert mb.input_ids.shape[1] == 5
    assert mb.padded_to(1) is mb and mb.padded_to(5) is mb
    p = mb.padded_to(4)
    assert p.input_ids.shape == (2, 8) and torch.equal(p.input_ids[:, :5], mb.input_ids)
    assert int(p.input_ids[:, 5:].abs().sum()) == 0
    real = mb.response_mask.bool()  # past a row's response the positions are clamped and masked out
    assert torch.equal(p.response_positions()[real], mb.response_positions()[real])
    assert torch.equal(p.response_targets(), mb.response_targets())
    assert p.fields is mb.fields and torch.equal(p.response_mask, mb.response_mask)


def test_a_misspelt_field_fails_where_it_is_written_not_silently():
    """Sequences are records: a typo is an AttributeError, a mapping with an unknown key a TypeError, and
    asking a micro-batch for a field that does not exist a KeyError, where a dict would have taken a new key and the
    loss would have read nothing."""
    s = TrainSequence([1, 2], [3, 4], torch.ones(2))
    with pytest.raises(AttributeError):
        s.old_logprobs = torch.zeros(2)
    with pytest.raises(TypeError, match="old_logprobs"):
        make_micro_batches([{"prompt_ids": [1], "response_ids": [2], "loss_mask": torch.ones(1),
                             "old_logprobs": torch.zeros(1)}], 10)
    (mb,) = make_micro_batches([s, {"prompt_ids": [1], "response_ids": [2], "loss_mask": torch.ones(1)}], 100)
    assert "old_log_probs" not in mb
    with pytest.raises(KeyError, match="old_logprobs"):
        "old_logprobs" in mb  # noqa: B015
    s.old_log_probs = torch.zeros(2)  # set on one row only: refused, not dropped
    with pytest.raises(ValueError, match="'old_log_probs' is set on some sequences"):
        make_micro_batches([s, TrainSequence([1], [2], torch.ones(1))], 100)
