"""Streamed groups: which rank owns which group (every prompt of every batch exactly once, also from a resumed batch),
when a rank may start its next group (the staleness bound), and loop.advance on trajectories at different turns (a
refilled pool)."""
import pytest

from megatron_searchr1.rollout import loop
from megatron_searchr1.rollout.async_buffer import required_version, within_bound
from megatron_searchr1.rollout.loop import LoopSettings, RolloutStats, Trajectory
from megatron_searchr1.rollout.stream_groups import in_flight_capacity, may_start, owner, stream_of
from tests.rollout.scripted import ScriptedEngine
from tests.rollout.test_loop import Searcher, tok  # noqa: F401 (fixture)


@pytest.mark.parametrize("parts", [1, 2, 3, 5])
@pytest.mark.parametrize("batch_size", [1, 2, 4, 7])
def test_the_streams_cover_every_prompt_once_in_order_from_any_batch(parts, batch_size):
    for first in range(4):
        streams = [list(stream_of(p, parts, batch_size, first, 6)) for p in range(parts)]
        every = sorted(x for s in streams for x in s)
        assert every == [(b, j) for b in range(first, 6) for j in range(batch_size)]  # none skipped, none twice
        for p, s in enumerate(streams):
            assert s == sorted(s)  # each rank works through its groups in draw order, batch after batch
            assert all(owner(b * batch_size + j, parts) == p for b, j in s)
            # a resume at batch `first` continues exactly the stream a run from batch 0 would have had
            assert s == [x for x in stream_of(p, parts, batch_size, 0, 6) if x[0] >= first]


def test_groups_alternate_between_ranks_so_a_small_batch_still_uses_every_rank():
    # 1 prompt per batch, 2 rollout ranks: the share mode leaves rank 0 without work; streamed, they alternate
    assert [list(stream_of(p, 2, 1, 0, 4)) for p in range(2)] == [[(0, 0), (2, 0)], [(1, 0), (3, 0)]]
    assert [list(stream_of(p, 2, 4, 1, 3)) for p in range(2)] == [[(1, 0), (1, 2), (2, 0), (2, 2)],
                                                                   [(1, 1), (1, 3), (2, 1), (2, 3)]]


def test_capacity_defaults_to_a_share():
    assert [in_flight_capacity(0, 4, k) for k in (1, 2, 3, 4, 8)] == [4, 2, 2, 1, 1]
    assert in_flight_capacity(6, 4, 2) == 6


@pytest.mark.parametrize("k", [0, 1, 2])
def test_a_group_that_may_start_is_within_the_bound_when_trained(k):
    # a rank holding version `held` starts groups of batch b only if held >= required_version(b): such a group
    # (its oldest token is >= held) is never dropped at the step that trains it (b + 1); one version less would be
    for b in range(8):
        need = required_version(b, k)
        assert may_start(0, 1, need, need, False) and within_bound(b + 1, need, k)
        if need > 0:
            assert not may_start(0, 1, need, need - 1, False) and not within_bound(b + 1, need - 1, k)
    assert not may_start(2, 2, 0, 5, False)  # no free slot
    assert not may_start(0, 2, 0, 5, True)  # draining (for a validation)


def test_advance_turns_a_pool_of_trajectories_at_different_turns(tok):  # noqa: F811 (fixture)
    # an old trajectory at its final turn and a refilled one at its first, in one round: the old one must answer (a
    # search in its final turn ends it max_turns, no search is run), the new one searches; counters go to each
    # trajectory's own stats
    settings = LoopSettings(max_turns=1, max_tokens_per_turn=64)
    search = "<think> x </think>\n<search> who founded acme? </search>"
    p_old, p_new = (tok.encode(f"Question {i}: q\n", add_special_tokens=False) for i in (0, 1))
    engine = ScriptedEngine(tok, {tuple(p_old): [search, search], tuple(p_new): [search]})
    old, new = Trajectory(prompt_ids=list(p_old), uid="old"), Trajectory(prompt_ids=list(p_new), uid="new")
    searcher = Searcher()
    stats = {"old": RolloutStats(), "new": RolloutStats()}
    ids = tok.encode(loop.INVALID_ACTION_FEEDBACK, add_special_tokens=False)
    loop.advance(engine, tok, searcher, [old], settings, lambda t: stats[t.uid], ids, False, version=3, seed=1)
    assert old.active and old.turns == 1 and old.n_searches == 1
    loop.advance(engine, tok, searcher, [old, new], settings, lambda t: stats[t.uid], ids, False, version=4, seed=2)
    assert (old.finish_reason, old.turns, old.n_searches) == ("max_turns", 2, 1)
    assert new.active and (new.turns, new.n_searches) == (1, 1)
    assert searcher.calls == [["who founded acme?"], ["who founded acme?"]]  # the old one's final search not run
    assert set(old.versions) == {3, 4} and set(new.versions) == {4}
    assert stats["old"].turns == 2 and stats["new"].turns == 1 and stats["new"].search_seconds > 0
    assert stats["old"].generated_tokens == 2 * len(tok.encode(search, add_special_tokens=False))


def test_doctests():
    import doctest

    from megatron_searchr1.rollout import stream_groups

    assert doctest.testmod(stream_groups).failed == 0
