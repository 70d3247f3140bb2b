"""A rollout rank's streamed GRPO groups (`rollout.async_granularity: group`), for trainer/rollout_rank.py.

    stream_groups(rank)     # a StreamRank: the engine, the receiver and the data of one rollout rank

The rank owns a fixed stream of groups (rollout/stream_groups.py: group g of the global stream, prompt g mod
train_batch_size of batch g // train_batch_size, belongs to rank g mod K) and keeps up to `capacity` of them in
flight in one pool, turn by turn (loop.advance on every active trajectory of the pool at once, each trajectory at its
own turn). Between two turns it:
  - sends every group whose samples have all finished to trainer rank 0, scored, stamped (each sample with its
    oldest token's version, async_buffer.sample_version; the group with its oldest sample's), as a part of its batch
    whose "part" is the group's position in the batch;
  - refills the freed slots with its next groups, each only once the engine holds a version the group's batch may
    use (stream_groups.may_start); with none in flight and none allowed, it waits for the weights;
  - loads new weights: with rollout.partial between any two turns (a trajectory continues under them, its tokens
    keep their versions), without it only when the pool is empty (a version never changes under a trajectory): the
    rank stops refilling (drains) when its next group needs a newer version than the engine holds;
  - validates a version the trainer marked, once the pool has drained (validation needs the engine to itself).
When the trainer says STOP the groups still in flight are dropped: a resumed run regenerates them (its streams start
at the resumed batch).

Seeds: one base per run (the trainer's seed for the first batch's step, plus the rank's index x SHARE_SEED_STRIDE),
mixed with the number of generate rounds this rank made (engine.derive_seed), so every round draws its own noise.

What it sends with each group besides the share mode's payload: extra["in_flight"], the groups in flight as it
finished (itself included), and extra["wait_s"], the seconds the rank waited for weights since its previous group was sent (the
trainer logs both, async_rl.AsyncTrainer.generate_batch).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from megatron_searchr1 import interrupt
from megatron_searchr1.rollout.async_buffer import GeneratedBatch, required_version, sample_version
from megatron_searchr1.rollout.engines import vllm_routing
from megatron_searchr1.rollout.loop import RolloutStats
from megatron_searchr1.rollout.remote_sync import BATCHES_TAG, send_object
from megatron_searchr1.rollout.stream_groups import in_flight_capacity, may_start, stream_of


@dataclass
class StreamRank:
    """What serve_rollouts built for this rollout rank (see there)."""

    cfg: Any
    bridge: Any
    me: int
    """This rank's index among the rollout ranks (0-based)."""
    engine: Any
    tokenizer: Any
    guard: Any
    """The SearchGuard: its search runs the queries, its counts stop the run on a dead server."""
    data: Any
    sampler: Any
    """The PromptSampler, at the run's first batch."""
    receiver: Any
    settings: Any
    """The training LoopSettings (seed unset)."""
    first_batch: int
    first_version: int
    weights: Callable[[], int]
    """Loads the newest weights received (if newer) and returns the engine's version."""
    validate_due: Callable[[], None]
    sync_check: Callable[[], dict]
    """The last weights check, as sync/remote_* values without the prefix (remote_check_*)."""


@dataclass
class _Group:
    batch: int
    part: int
    trajs: list
    start: float
    stats: RolloutStats = field(default_factory=RolloutStats)


def release_time(group: _Group, finished: float) -> float:
    """When a finished group leaves its slot: at once. (tools/benchmarks/bench_async.py replaces this to model a
    trajectory that takes longer: the group keeps its slot until then.)"""
    return finished


def stream_groups(rk: StreamRank) -> None:
    """Generate and send this rank's stream of groups (module doc) until it ends or the trainer says STOP."""
    from megatron_searchr1.rollout import loop
    from megatron_searchr1.rollout.engine import derive_seed, keeps_sessions
    from megatron_searchr1.rollout.engine_groups import SHARE_SEED_STRIDE
    from megatron_searchr1.data.prompts import INVALID_ACTION_FEEDBACK
    from megatron_searchr1.trainer import losses
    from megatron_searchr1.trainer.rl import step_seed
    from megatron_searchr1.trainer.roles import RolloutWorker

    cfg, r, receiver = rk.cfg, rk.cfg.rollout, rk.receiver
    batch_size, parts, total = cfg.data.train_batch_size, rk.bridge.plan.rollout_ranks, cfg.trainer.total_steps
    capacity = in_flight_capacity(r.groups_in_flight, batch_size, parts)
    todo = list(stream_of(rk.me, parts, batch_size, rk.first_batch, total))
    todo.reverse()  # pop() takes the next group
    last_of_batch = {}  # batch -> this rank's last position in it (where the search counts are taken)
    for b, j in todo:
        last_of_batch[b] = max(j, last_of_batch.get(b, -1))
    drawn: dict[int, list[int]] = {}
    next_draw = rk.first_batch
    pool: list[_Group] = []
    finished: list[tuple[float, _Group]] = []  # done, waiting for their release_time
    invalid_ids = rk.tokenizer.encode(INVALID_ACTION_FEEDBACK, add_special_tokens=False)
    sessions = keeps_sessions(rk.engine)
    seed_base = step_seed(cfg.trainer.seed, rk.first_batch + 1) + rk.me * SHARE_SEED_STRIDE
    rounds, waited = 0, 0.0
    carried = [0, 0]  # search counts taken before a validation (which takes its own), not yet sent

    def validate_due() -> None:
        """Validate what the trainer marked (the pool is empty): the search counts of this batch's groups so far are
        kept apart from validation's."""
        failed, searched, _, _ = rk.guard.take()
        carried[0] += failed
        carried[1] += searched
        rk.validate_due()

    def rows_of(b: int, j: int):
        nonlocal next_draw
        while next_draw <= b:  # the data cursor: batch b is the b-th draw
            drawn[next_draw] = rk.sampler.next_batch()
            next_draw += 1
        row = rk.data.train[drawn[b][j]]
        if last_of_batch[b] == j:  # this rank's last group of batch b: its draw is not needed any more
            del drawn[b]
        return row

    def send(g: _Group, in_flight: int) -> None:
        nonlocal waited
        version = rk.receiver.applied_version
        for tr in g.trajs:
            tr.meta["policy_version"] = sample_version(tr.versions, tr.loss_mask, default=version)
            tr.meta["rollout_rank"] = rk.bridge.rank
        search = (0, 0)
        if last_of_batch[g.batch] == g.part:  # the rank's search counts, once per batch it had groups of
            failed, searched, opened, last = rk.guard.take()
            failed, searched = failed + carried[0], searched + carried[1]
            carried[:] = [0, 0]
            rk.guard.down(failed, searched, opened, last, f"batch {g.batch} on rollout rank {rk.bridge.rank}")
            search = (failed, searched)
        g.stats.finish.update(t.finish_reason for t in g.trajs)
        oldest = min(tr.meta["policy_version"] for tr in g.trajs)
        payload = {"trajs": g.trajs, "scores": losses.score_trajectories(g.trajs, rk.tokenizer, cfg.algo),
                   "stats": g.stats, "search": search,
                   "sync": {**rk.sync_check(), "remote_applied_version": float(oldest)}}  # as a share's: its start
        send_object(rk.bridge.batches, GeneratedBatch(
            index=g.batch, version=oldest, payload=payload,
            gen_start=g.start, gen_end=time.time(), rank=rk.bridge.rank,
            extra={"part": g.part, "in_flight": in_flight, "wait_s": waited}), 0, BATCHES_TAG)
        waited = 0.0

    try:
        while todo or pool or finished:
            if receiver.stopped:
                return
            now, in_flight = time.time(), len(pool) + len(finished)
            for item in [f for f in finished if f[0] <= now]:  # released groups go out, their slots free
                finished.remove(item)
                send(item[1], in_flight)
            occupied = len(pool) + len(finished)
            draining = bool(receiver.due)  # a validation waits for the pool to drain
            if not occupied and draining:
                validate_due()
            if r.partial or not occupied:
                version = rk.weights()
            else:
                version = receiver.applied_version
            while todo and may_start(occupied, capacity, required_version(todo[-1][0], r.max_staleness,
                                                                          rk.first_version), version,
                                     draining and occupied > 0):
                b, j = todo.pop()
                trajs = RolloutWorker.make_trajectories([rows_of(b, j)], r.n)
                pool.append(_Group(b, j, trajs, time.time()))
                occupied += 1
            if not pool:
                if finished:  # only groups waiting for their release: sleep until the first
                    time.sleep(max(min(f[0] for f in finished) - time.time(), 0.0))
                elif todo:  # nothing in flight and the next group needs newer weights: wait for them
                    need = required_version(todo[-1][0], r.max_staleness, rk.first_version)
                    interrupt.note(f"generating batch {todo[-1][0]} of {total}")
                    start = time.time()
                    if not receiver.wait_for(need, serve=validate_due) or receiver.stopped:  # the pool is empty
                        return
                    waited += time.time() - start
                continue
            interrupt.note(f"generating batch {min(g.batch for g in pool)} of {total}")
            of = {id(t): g for g in pool for t in g.trajs}
            active = [t for g in pool for t in g.trajs if t.active]
            settings = dataclasses.replace(rk.settings, seed=derive_seed(seed_base, rounds))
            loop.advance(rk.engine, rk.tokenizer, rk.guard, active, settings, lambda t: of[id(t)].stats,
                         invalid_ids, sessions, version, settings.seed)
            rounds += 1
            now = time.time()
            for g in [g for g in pool if not any(t.active for t in g.trajs)]:
                if rk.cfg.algo.routing_replay:  # before the next weight load drops the engine's records
                    vllm_routing.attach(rk.engine, g.trajs)
                pool.remove(g)
                finished.append((release_time(g, now), g))
    finally:
        if sessions and pool:
            rk.engine.end_sessions([id(t) for g in pool for t in g.trajs])
