"""trainer/roles.py RolloutWorker: training and validation rollouts split over the engines by one rule
(rollout/engine_groups.py EngineLayout.shard), on 8 simulated ranks (threads; all_gather_object by a barrier), with
the rollout loop and the scorer replaced by recorders. The real multi-process runs are test_layout_sweep.py and
test_two_nodes.py; this pins which engine runs which item and the order the results come back in."""
import threading
from types import SimpleNamespace

import pytest

import megatron_searchr1.trainer.roles as roles
from megatron_searchr1.config import load_config
from megatron_searchr1.rollout import loop
from megatron_searchr1.config.layout import replicas
from megatron_searchr1.rollout.engine_groups import EngineLayout
from megatron_searchr1.rollout.loop import RolloutStats
from megatron_searchr1.search.client import RetrievalDown, SearchFailure, is_search_failure

WORLD, TP, PP = 8, 2, 2  # replicas [0, 1, 4, 5] and [2, 3, 6, 7]: not contiguous, the case that needs the rule


class FakeDist:
    """all_gather_object over a group (None: every rank, else a tuple of ranks) among threads, one per rank."""

    def __init__(self):
        self.local = threading.local()
        self.lock = threading.Lock()
        self.rounds: dict = {}

    def ranks(self, group):
        return tuple(range(WORLD)) if group is None else group

    def get_world_size(self, group=None):
        return len(self.ranks(group))

    def is_initialized(self):
        return True

    def new_group(self, ranks, backend=None):
        return tuple(ranks)

    def broadcast_object_list(self, box, src, group=None):
        parts = [None] * len(self.ranks(group))
        self.all_gather_object(parts, box[0] if self.local.rank == src else None, group)
        box[0] = parts[self.ranks(group).index(src)]

    def all_gather_object(self, parts, obj, group=None):
        ranks, me = self.ranks(group), self.local.rank
        n = self.local.calls.get(ranks, 0)
        self.local.calls[ranks] = n + 1
        with self.lock:
            box, barrier = self.rounds.setdefault((ranks, n), ({}, threading.Barrier(len(ranks))))
            box[me] = obj
        barrier.wait(timeout=30)
        parts[:] = [box[r] for r in ranks]


def _run_ranks(engine_tp, monkeypatch, body, search=None, expect_errors=False):
    """body(worker) on each of the WORLD ranks at once; returns {rank: result} (with `expect_errors`: the errors
    too). `search(rank)`: that rank's client.search (default: none, the rollout is faked and never searches)."""
    fake = FakeDist()
    monkeypatch.setattr(roles, "dist", fake)
    replica = {r: tuple(g) for g in replicas(WORLD, TP, PP) for r in g}
    monkeypatch.setattr(roles, "mpu", SimpleNamespace(get_model_parallel_group=lambda: replica[fake.local.rank]))

    def run_rollout(engine, tokenizer, searcher, trajs, settings):
        if search is not None:  # one search round per rollout: every trajectory asks its uid
            for t, obs in zip(trajs, searcher([t.uid for t in trajs])):
                t.meta["obs"] = obs
        for t in trajs:
            t.meta["engine"] = engine.group  # which engine ran it (every rank of that engine does)
            t.finish("answer")
        return RolloutStats()

    monkeypatch.setattr(loop, "run_rollout", run_rollout)
    monkeypatch.setattr(roles.losses, "score_trajectories",
                        lambda trajs, tok, cfg: [{"score": 1.0, "em": 1.0, "subem": 1.0, "f1": 1.0} for _ in trajs])
    cfg = load_config(None, [f"parallel.tp={TP}", f"parallel.pp={PP}", f"rollout.engine_tp={engine_tp}"])
    out, errors = {}, []

    def rank_main(rank):
        fake.local.rank, fake.local.calls = rank, {}
        try:
            worker = roles.RolloutWorker(cfg, SimpleNamespace(group=rank // engine_tp), None,
                                         SimpleNamespace(search=search and search(rank), base_url="http://srv"), (),
                                         rank=rank, world=WORLD)
            out[rank] = body(worker)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append((rank, e))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank hangs"
    if expect_errors:
        return out, dict(errors)
    assert not errors, errors
    return out


def _rows(n):
    return [SimpleNamespace(prompt_ids=[1, 2], uid=f"q{i}", data_source="nq", ground_truth={"target": ["x"]},
                            question=f"question {i}", extra={}) for i in range(n)]


@pytest.mark.parametrize("engine_tp", [1, 2])
def test_training_rollouts_run_round_robin_over_the_replicas_engines_and_come_back_in_order(engine_tp, monkeypatch):
    layout = EngineLayout(WORLD, TP, PP, engine_tp)
    rows = _rows(7)
    out = _run_ranks(engine_tp, monkeypatch,
                     lambda w: w.generate(w.make_trajectories(rows, 2), seed=5)[0])
    for rank, trajs in out.items():
        assert [(t.uid, t.sample) for t in trajs] == [(r.uid, k) for r in rows for k in range(2)]  # list order
        engines = layout.replica_groups(layout.replica_of[rank])
        assert len(engines) == 4 // engine_tp
        assert [t.meta["engine"] for t in trajs] == [engines[i % len(engines)] for i in range(len(trajs))]


@pytest.mark.parametrize("engine_tp", [1, 2])
def test_validation_rows_run_round_robin_over_all_engines_and_the_records_come_back_in_row_order(engine_tp,
                                                                                                monkeypatch):
    rows = _rows(11)
    n_engines = WORLD // engine_tp
    monkeypatch.setattr(roles.reports, "eval_record", lambda tr, sc: {"uid": tr.uid, "engine": tr.meta["engine"]})
    out = _run_ranks(engine_tp, monkeypatch, lambda w: w.validate(rows, batch_size=2, n_samples=0)[0])
    for rank, records in out.items():
        # each row once, in row order, on every rank; row i ran on engine i % engines (validation's rule all along:
        # rows[k::engines] on engine k)
        assert records == [{"uid": r.uid, "engine": i % n_engines} for i, r in enumerate(rows)]


def _counting_searchers(fails):
    """search(rank) -> that rank's client.search, failing where fails(rank, query); calls[rank] = queries it
    sent."""
    calls: dict = {}

    def search(rank):
        def fn(queries):
            calls.setdefault(rank, []).extend(queries)
            return [SearchFailure("injected") if fails(rank, q) else f"Doc 1(Title: x) {q}\n" for q in queries]
        return fn

    return search, calls


@pytest.mark.parametrize("failing", ["leader", "follower"])
def test_one_rank_per_engine_searches_and_the_engines_ranks_see_its_observations(failing, monkeypatch):
    # engine_tp=2: engines [0,1], [2,3], ...; the engine of ranks 2 and 3 has one rank whose client fails
    bad = 2 if failing == "leader" else 3
    search, calls = _counting_searchers(lambda rank, q: rank == bad)
    rows = _rows(4)
    out, errors = _run_ranks(2, monkeypatch, lambda w: w.generate(w.make_trajectories(rows, 1), seed=5),
                             search=search, expect_errors=True)
    assert sorted(calls) == [0, 2, 4, 6]  # only the engines' first ranks asked the server
    assert sum(len(q) for q in calls.values()) == 2 * len(rows)  # one query per search: two replicas of 4 rows
    if failing == "follower":  # its client was never used: the step completes, nothing failed
        assert not errors
        for rank, (trajs, metrics) in out.items():
            assert all(t.meta["obs"].startswith("Doc 1") for t in trajs)
            assert metrics["rollout/search_error_rate"] == 0.0
    else:  # the engine's 2 of the step's 8 searches failed: 0.25 > 0.2, every rank stops together, none hangs
        assert sorted(errors) == list(range(WORLD)) and not out
        assert all(isinstance(e, RetrievalDown) for e in errors.values())
        msg = str(errors[0])
        assert "http://srv" in msg and "failed 2 of 8 searches" in msg and "injected" in msg, msg


def test_a_step_below_the_error_rate_reports_it_and_goes_on(monkeypatch):
    # engine [2, 3] runs q0, q2, q4, q6 of its replica's 8: q0 and q2 fail there, 2 of the step's 16 (< 0.2)
    search, _ = _counting_searchers(lambda rank, q: rank == 2 and q in ("q0", "q2"))
    out = _run_ranks(2, monkeypatch, lambda w: w.generate(w.make_trajectories(_rows(8), 1), seed=5)[1],
                     search=search)
    assert {m["rollout/search_error_rate"] for m in out.values()} == {2 / 16}


def test_validation_above_the_error_rate_stops_every_rank_and_prints_no_em(monkeypatch, capsys):
    search, _ = _counting_searchers(lambda rank, q: rank in (0, 2))  # half of the searches fail
    monkeypatch.setattr(roles.reports, "eval_record", lambda tr, sc: {
        "data_source": "nq", "em": 1.0, "subem": 1.0, "f1": 1.0, "searches": 1, "turns": 1, "length": 3,
        "finish": "search_error" if is_search_failure(tr.meta["obs"]) else "answer"})
    out, errors = _run_ranks(2, monkeypatch, lambda w: w.validate(_rows(8), batch_size=2, n_samples=0),
                             search=search, expect_errors=True)
    assert sorted(errors) == list(range(WORLD)) and all(isinstance(e, RetrievalDown) for e in errors.values())
    printed = capsys.readouterr().out
    assert "INVALID, 4 of 8 searches failed" in printed and "EM" not in printed, printed


def test_validation_stopped_by_the_circuit_breaker_below_the_rate_prints_no_em(monkeypatch, capsys):
    # engine [2, 3] runs rows q1, q5, ..., q37, one per batch (one search round each); its last three rounds fail:
    # max_failed_rounds=3 opens the circuit, though 3 of the 40 searches is below the 0.2 rate
    search, calls = _counting_searchers(lambda rank, q: rank == 2 and q in ("q29", "q33", "q37"))
    monkeypatch.setattr(roles.reports, "eval_record", lambda tr, sc: {
        "data_source": "nq", "em": 1.0, "subem": 1.0, "f1": 1.0, "searches": 1, "turns": 1, "length": 3,
        "finish": "search_error" if is_search_failure(tr.meta["obs"]) else "answer"})
    out, errors = _run_ranks(2, monkeypatch, lambda w: w.validate(_rows(40), batch_size=1, n_samples=0),
                             search=search, expect_errors=True)
    assert sorted(errors) == list(range(WORLD)), errors
    assert "max_failed_rounds=3" in str(errors[0]) and "failed 3 of 40" in str(errors[0]), errors[0]
    printed = capsys.readouterr().out
    assert "INVALID, 3 of 40 searches failed, retrieval.max_failed_rounds=3" in printed and "EM" not in printed, printed
