"""rollout/batch_parts.py: every rollout rank's share of a batch, and the batch trainer rank 0 assembles from the
parts (order, version = the oldest part's, merged metrics), without processes."""
from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from megatron_searchr1.rollout.async_buffer import GeneratedBatch
from megatron_searchr1.rollout.batch_parts import (PartAssembler, assemble, assemble_report, contributors,
                                                   merge_sync, share)
from megatron_searchr1.rollout.loop import RolloutStats, Trajectory


def test_share_splits_every_list_in_order_over_any_number_of_ranks():
    for n in range(0, 11):
        for parts in range(1, 14):
            shares = [share(n, p, parts) for p in range(parts)]
            assert [i for s in shares for i in s] == list(range(n))  # contiguous, in order, each item once
            assert max(map(len, shares)) - min(map(len, shares)) <= 1
            assert contributors(n, parts) == [p for p in range(parts) if len(shares[p])]
            assert len(contributors(n, parts)) == min(n, parts)  # more ranks than prompts: some get none


def _traj(uid: str, sample: int, gen: int, searches: int, invalid: int, turns: int, finish: str,
          version: int) -> Trajectory:
    tr = Trajectory(prompt_ids=[1, 2, 3], uid=uid, sample=sample)
    tr.extend(list(range(gen)), 1, [0.0] * gen, version=version)
    tr.turns, tr.n_searches, tr.n_invalid, tr.finish_reason = turns, searches, invalid, finish
    return tr


def _part(index: int, j: int, rank: int, version: int, trajs: list, stats: RolloutStats, search: tuple,
          start: float, end: float, check=(0.0, 4.0)) -> GeneratedBatch:
    return GeneratedBatch(index=index, version=version, gen_start=start, gen_end=end, rank=rank, extra={"part": j},
                          payload={"trajs": trajs, "scores": [{"score": float(len(tr.response_ids))} for tr in trajs],
                                   "stats": stats, "search": search,
                                   "sync": {"remote_check_max_diff": check[0], "remote_check_tensors": check[1],
                                            "remote_applied_version": float(version)}})


def _two_parts(index: int = 5):
    """Batch `index` over two rollout ranks (global ranks 3 and 4): 1 prompt x 2 samples each, hand-made numbers."""
    a = [_traj("p0", 0, 4, 1, 0, 2, "answer", 7), _traj("p0", 1, 6, 2, 1, 3, "max_turns", 7)]
    b = [_traj("p1", 0, 10, 0, 0, 1, "answer", 6), _traj("p1", 1, 2, 1, 0, 2, "answer", 6)]
    pa = _part(index, 0, 3, 7, a, RolloutStats(Counter(answer=1, max_turns=1), turns=3, generated_tokens=10,
                                               prefill_tokens=20, gen_seconds=4.0, search_seconds=1.0),
               (1, 3), start=10.0, end=14.0, check=(float("nan"), 0.0))
    pb = _part(index, 1, 4, 6, b, RolloutStats(Counter(answer=2), turns=2, generated_tokens=12, prefill_tokens=6,
                                               gen_seconds=9.0, search_seconds=0.5),
               (0, 1), start=11.0, end=20.0, check=(1e-3, 2.0))
    return pa, pb


def test_assemble_orders_by_rank_stamps_the_oldest_version_and_merges_the_metrics():
    pa, pb = _two_parts()
    for arrival in ([pa, pb], [pb, pa]):  # the same batch whichever part arrived first
        batch = assemble(arrival)
        assert batch.index == 5 and batch.version == 6  # the oldest part's: the bound holds for every sample
        assert [(tr.uid, tr.sample) for tr in batch.payload["trajs"]] == [("p0", 0), ("p0", 1), ("p1", 0), ("p1", 1)]
        assert [s["score"] for s in batch.payload["scores"]] == [4.0, 6.0, 10.0, 2.0]
        assert (batch.gen_start, batch.gen_end) == (10.0, 20.0)
        assert batch.extra["parts"] == [(3, 7, 2, 10.0, 14.0), (4, 6, 2, 11.0, 20.0)]
        m = batch.payload["metrics"]
        # shares and means over the whole batch's 4 trajectories, not a mean of the parts' means
        assert m["rollout/finish_answer"] == 3 / 4 and m["rollout/finish_max_turns"] == 1 / 4
        assert m["rollout/generated_tokens_mean"] == (4 + 6 + 10 + 2) / 4
        assert m["rollout/response_length_max"] == 10
        assert m["rollout/searches_mean"] == 4 / 4 and m["rollout/turns_mean"] == 8 / 4
        assert m["rollout/valid_action_ratio"] == 1 - 1 / 8
        assert m["rollout/computed_tokens"] == 10 + 20 + 12 + 6  # totals add up
        assert m["time/generate"] == 9.0 and m["time/search"] == 1.0  # the parts ran at once: the longest
        assert m["rollout/search_error_rate"] == 1 / 4  # summed failures over summed searches, not (1/3 + 0) / 2
        assert batch.payload["sync"] == {"remote_check_max_diff": 1e-3, "remote_check_tensors": 0.0,
                                         "remote_applied_version": 6.0}
    with pytest.raises(ValueError):
        assemble([pa, _two_parts(index=6)[1]])  # parts of two batches


def test_merge_sync_ignores_parts_without_a_check():
    out = merge_sync([{"remote_check_max_diff": float("nan"), "remote_check_tensors": 0.0,
                       "remote_applied_version": 1.0}])
    assert math.isnan(out["remote_check_max_diff"])


def test_part_assembler_gives_whole_batches_in_index_order_whatever_the_arrival_order():
    # 3 rollout ranks, 2 prompts per batch: share 0 is empty, shares 1 and 2 contribute; each rank sends its parts
    # in index order, the ranks interleave at random (share 2 runs ahead of share 1 by up to 3 batches)
    parts = contributors(2, 3)
    assert parts == [1, 2]
    asm = PartAssembler(first_batch=4, parts=parts)
    per_rank = {j: [_part(b, j, 10 + j, b - 1 - j % 2, [_traj(f"q{b}", 0, 1, 0, 0, 1, "answer", 0)],
                          RolloutStats(), (0, 0), 0.0, 1.0) for b in range(4, 10)] for j in parts}
    rng, out = random.Random(0), []
    while any(per_rank.values()):
        j = rng.choice([j for j in parts if per_rank[j]])
        asm.add(per_rank[j].pop(0))
        out += asm.pop_ready()
        assert not asm.ready()
    assert [b.index for b in out] == list(range(4, 10)) and asm.next == 10
    assert all(b.version == b.index - 2 for b in out)  # share 1 is the older one
    assert all([p[0] for p in b.extra["parts"]] == [11, 12] for b in out)
    with pytest.raises(ValueError, match="already assembled"):
        asm.add(_part(5, 1, 11, 0, [], RolloutStats(), (0, 0), 0.0, 0.0))
    with pytest.raises(ValueError, match="share 0"):
        asm.add(_part(10, 0, 10, 0, [], RolloutStats(), (0, 0), 0.0, 0.0))
    asm.add(_part(10, 1, 11, 0, [], RolloutStats(), (0, 0), 0.0, 0.0))
    with pytest.raises(ValueError, match="twice"):
        asm.add(_part(10, 1, 11, 0, [], RolloutStats(), (0, 0), 0.0, 0.0))
    assert asm.pop_ready() == []  # share 2's part of batch 10 is still missing


def test_assemble_report_keeps_the_rows_order_and_the_first_samples():
    parts = [{"val": 3, "part": j, "records": [f"row{i}" for i in share(5, j, 3)],
              "samples": [f"s{i}" for i in share(5, j, 3)]} for j in (2, 0, 1)]
    report = assemble_report(parts, n_samples=3)
    assert report == {"val": 3, "records": [f"row{i}" for i in range(5)], "samples": ["s0", "s1", "s2"]}
    with pytest.raises(ValueError):
        assemble_report([{**parts[0], "val": 4}, parts[1]], n_samples=3)
