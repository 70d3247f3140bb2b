"""Disaggregated, asynchronous RL: the last `parallel.rollout_ranks` ranks only generate, the others only train, at once.

    torchrun --nproc_per_node 4 -m megatron_searchr1.train examples/grpo_tiny_cpu.yaml parallel.tp=2 \\
        parallel.rollout_placement=disaggregated parallel.rollout_ranks=2 rollout.max_staleness=1

    run_disaggregated(cfg)      # train.py: each rank takes its role (rollout/remote_sync.py RolePlan)

The trainer ranks run the ordinary Trainer (trainer/rl.py) with one change: its generate step takes a finished batch
from the rollout ranks (RemoteRollout) instead of running an engine, and its weight sync sends the weights to them
(remote_sync.WeightSender) instead of loading a local engine. So a step is:
  1. send the weights (version t-1) to the rollout ranks: gathered here, sent by a thread on trainer rank 0;
  2. take batch t-1 from the buffer (rollout/async_buffer.py: the staleness bound), waiting only when the rollout
     ranks are behind; every trainer rank gets it from rank 0, each DP rank its share of groups;
  3-7. as in the synchronous trainer: old / reference log-probs, advantages, updates (the engine's per-token
     log-probs are the behaviour policy, so algo.rollout_correction applies to the off-policy gap), metrics.
Meanwhile every rollout rank generates its contiguous share of every batch (trainer/rollout_rank.py), each at its
own pace within the bound, and sends it to trainer rank 0 as a part. Rank 0 has one receiving thread per rollout
rank, so no rank waits for another to be heard, and an assembling thread that puts batch b into the buffer once
every rank's part of b is in (rollout/batch_parts.py: parts in rank order, the batch's version its oldest part's,
the rollout metrics merged). The data cursor is the batch index: every rollout rank draws the same prompt order, so
a run resumed at step t has its rollout ranks start at batch t, no prompt trained twice.
With `rollout.async_granularity: group` the rollout ranks stream GRPO groups instead (trainer/rollout_stream.py):
each owns a fixed stream of groups across batches, keeps several in flight and sends each as it finishes; the parts
of a batch are then its train_batch_size groups, assembled by position in the draw, so the cursor stays the batch
index and the bound the oldest group's version.

Metrics per step (`async/*`): the batch's version (its oldest part's), the lag (async_buffer's definition), batches
dropped as too old, the wait for the batch, the wall-clock interval of the batch's generation (first part's start,
last part's end) and of the step's training (seconds since trainer rank 0 started), from which overlap can be read,
the number of parts and `async/parts_end_spread_s` (how long the first part to finish waited for the last);
with streamed groups (above) also `async/groups_in_flight_mean` (the groups its rank had in flight as each of the
batch's groups finished) and `async/producer_wait_s` (the seconds the rollout ranks waited for weights, summed over
the batch's groups);
`sync/remote_*` for the weights, and `sync/remote_check_max_diff`, the largest difference between the weights a
rollout rank's engine holds after loading a version and the weights sent (a few tensors, read back from the engine;
the worst part's). The TensorBoard histogram `async/rollout_rank` shows which rank generated each sample.

Validation runs on the rollout ranks between two of their batches (`validate` marks the version it sends): each
validates its contiguous share of the validation rows and sends it to trainer rank 0 on the batches channel, where
the receiving thread of that rank keeps it apart from the batch parts; once every rank's part of a version is in,
the report is assembled in rank order (the rows' order) and logged under the step of its version. Since every rank
validates every marked version in order, and its receiving thread reads its messages in order, reports complete in
the order they were asked for. Each trajectory carries the version of every token (loop.Trajectory.versions) and
counts as its oldest generated token's (async_buffer.sample_version), which the staleness histogram
(`async/staleness`) and the bound read.

Partial rollouts (`rollout.partial`): a rollout rank also loads newer weights between two turns of a share's
multi-turn loop, so a trajectory still generating when a version arrives continues under it rather than finishing
on the old one; its tokens then span versions, `async/multi_version_share` and `async/versions_per_sample_mean` say
how many. The behaviour log-probs stay the engine's, token by token, so the rollout correction sees each token's own
policy gap; the bound holds since it reads the oldest token.

The end of a run and failures (remote_sync's module doc): trainer rank 0 sends STOP with a reason and each of its
receiving threads drains its rollout rank until that rank said DONE, so an early stop (trainer.stop_on_collapse) is a
clean exit on every rank. A rank whose collective, send or receive fails names the ranks that are gone (heartbeats in
torchrun's store) in one line; trainer rank 0 passes its line to the rollout ranks with STOP; a dead rollout rank is
named by its receiving thread ("rollout rank 2 is gone"), an error on one by the line it sent ("rollout rank 2
failed: ...", after which trainer rank 0 STOPs the other rollout ranks at once), a dead trainer rank 0 by the rollout
ranks ("trainer rank 0 is gone"). Every such end is one line per rank, no traceback, the rank's threads joined and
its exit code (trainer/async_exit.py: also the watchdog and SIGTERM paths).
"""
from __future__ import annotations

import os
import threading
import time
from typing import Optional

import torch.distributed as dist

from megatron_searchr1 import interrupt
from megatron_searchr1.data.rl_data import dp_shard
from megatron_searchr1.rollout.async_buffer import AsyncBuffer, BufferClosed, GeneratedBatch, lag, version_metrics
from megatron_searchr1.rollout.batch_parts import PartAssembler, assemble_report, contributors
from megatron_searchr1.rollout.remote_sync import (BATCHES_TAG, DONE, ROLLOUT, Bridge, Heartbeat, RolePlan,
                                                   WeightSender, bridge_backend, heartbeat_counts, heartbeat_store,
                                                   init_role_world, recv_object, send_object)
from megatron_searchr1.search.client import RetrievalDown
from megatron_searchr1.trainer.async_exit import Exit, stopping_line
from megatron_searchr1.trainer.rl import Trainer
from megatron_searchr1.trainer.rollout_rank import serve_rollouts


def run_disaggregated(cfg) -> int:
    """The whole job on this rank: join its role world, then train (AsyncTrainer) or generate (serve_rollouts).
    Returns 0 after a clean run; any other end is one line on stderr and an exit code (`leave`)."""
    from megatron_searchr1.cli import RETRIEVAL_DOWN_EXIT, UsageError
    from megatron_searchr1.megatron.initialize import resolve_device

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    plan, device = RolePlan(world, cfg.parallel.rollout_ranks), resolve_device()
    backend = bridge_backend(cfg.parallel.bridge_backend, device)  # nccl without CUDA: one error line, exit 2
    bridge = join_role_world(cfg, plan, rank, device, backend)
    heartbeat = Heartbeat(bridge.store, rank)
    exit = Exit(bridge, heartbeat)
    exit.watch()
    try:
        if bridge.role == ROLLOUT:
            serve_rollouts(cfg, bridge)
        else:
            trainer = AsyncTrainer(cfg, bridge)
            try:
                trainer.fit()
            except BaseException as e:
                if not isinstance(e, KeyboardInterrupt):
                    trainer.close(reason=stopping_line(bridge, heartbeat, e) or type(e).__name__)  # rollout ranks stop
                raise
            trainer.close()
    except UsageError as e:
        exit.leave(2, "error: " + " ".join(str(e).split()))
    except RetrievalDown as e:
        exit.leave(RETRIEVAL_DOWN_EXIT, "error: " + " ".join(str(e).split()))
    except Exception as e:  # noqa: BLE001 (one line naming the dead rank, or the error: no traceback)
        exit.leave(1, stopping_line(bridge, heartbeat, e))
    exit.done()
    heartbeat.done()
    return 0


def join_role_world(cfg, plan: RolePlan, rank: int, device: str, backend: str) -> Bridge:
    """The CUDA environment Megatron needs (trainer ranks: CUDA_DEVICE_MAX_CONNECTIONS=1 at TP > 1), then the role
    world (remote_sync.init_role_world, whose first CUDA call is torch.cuda.set_device). The order matters: the
    driver reads CUDA_DEVICE_MAX_CONNECTIONS once, when the context is made, so set after set_device it is ignored
    and Megatron's TP communication may overlap the wrong way (megatron/initialize.py cuda_env)."""
    from megatron_searchr1.megatron.initialize import apply_cuda_env, cuda_env

    if plan.role(rank) != ROLLOUT:  # vLLM on the rollout ranks sets up its own
        p = cfg.parallel
        apply_cuda_env(cuda_env(device, p.tp, p.sequence_parallel))
    return init_role_world(plan, rank, device, cfg.parallel.timeout_minutes, backend)


def staleness_metrics(lags: list[int], max_staleness: int) -> dict[str, float]:
    """The staleness histogram of one batch as scalars: the share of its samples at each lag 0..k+1 (the bound:
    the same keys at every step), their mean and max.

    >>> staleness_metrics([1, 1, 0, 1], max_staleness=0)
    {'async/staleness_mean': 0.75, 'async/staleness_max': 1.0, 'async/staleness_share_lag0': 0.25, \
'async/staleness_share_lag1': 0.75}
    """
    n = max(len(lags), 1)
    out = {"async/staleness_mean": sum(lags) / n, "async/staleness_max": float(max(lags, default=0))}
    for j in range(max_staleness + 2):
        out[f"async/staleness_share_lag{j}"] = sum(1 for x in lags if x == j) / n
    return out


# ----------------------------------------------------------------------------------------------------------------
# The trainer side
# ----------------------------------------------------------------------------------------------------------------
WAIT_ROUND_SECONDS = 30.0
"""Trainer rank 0 waits for a batch in rounds this long, each ending in a broadcast to the other trainer ranks."""

WAIT_NOTE_SECONDS = 60.0
"""How often trainer rank 0 says it is still waiting for a batch."""

CLOSE_SECONDS = 600.0
"""How long trainer rank 0's close() waits for every rollout rank's DONE (each finishes or abandons its share first)."""


class RemoteRollout:
    """The trainer ranks' stand-in for a RolloutWorker: `sync` sends the weights, `take(step)` returns this DP
    rank's share of the step's batch; `sleep` / `mark_stale` have nothing to do (no local engine). On trainer rank 0
    it receives (module doc): one thread per rollout rank reads that rank's messages in order (batch parts,
    validation parts, an error, DONE), and one thread assembles whole batches into the buffer in index order."""

    def __init__(self, cfg, bridge: Bridge, dp_rank: int, dp_size: int, t0: float):
        from megatron_searchr1.models.convert import DTYPES

        r = cfg.rollout
        self.cfg, self.bridge, self.dp_rank, self.dp_size, self.t0 = cfg, bridge, dp_rank, dp_size, t0
        self.leader = bridge.bridge_rank == 0
        self.sender = WeightSender(bridge, bucket_bytes=r.sync_bucket_mb << 20,
                                   dtype=DTYPES[cfg.model.dtype if r.dtype == "auto" else r.dtype])
        self.buffer = AsyncBuffer(capacity=r.max_staleness + 1, max_staleness=r.max_staleness)
        self.version = 0
        self._sent: Optional[tuple[int, dict]] = None  # (version, its sync stats): a version is gathered once
        self._threads: list[threading.Thread] = []
        self._closed = False
        # rank 0's receiving state, under one condition: the receiving threads, the assembling thread and the
        # trainer's thread (reports) meet here
        self._cond = threading.Condition()
        self._assembler: Optional[PartAssembler] = None
        self._live: set[int] = set()  # bridge ranks whose receiving thread still runs (no DONE, no failure yet)
        self._batches_done = False  # no batch is trained any more: parts are discarded
        self._val_parts: dict[int, list[dict]] = {}  # version -> the validation parts received so far
        self._reports: list[dict] = []  # validation reports assembled (rank 0), not yet logged
        self._requested: list[int] = []  # versions whose validation was asked for (rank 0)
        self._failed: Optional[str] = None  # why receiving stopped early (a rollout rank failed or is gone)

    def start(self, first_batch: int, first_version: int) -> None:
        """Tell the rollout ranks where the run starts (after a resume: batch = version = the step reached) and
        start receiving their parts."""
        self.version = first_version
        if not self.leader:
            return
        k = self.bridge.plan.rollout_ranks
        n = self.cfg.data.train_batch_size
        streamed = self.cfg.rollout.async_granularity == "group"  # one part per group position, else per share
        self._assembler = PartAssembler(first_batch, range(n) if streamed else contributors(n, k))
        for dst in range(1, k + 1):
            send_object(self.bridge.batches, {"first_batch": first_batch, "first_version": first_version,
                                              "t0": self.t0}, dst, BATCHES_TAG)
        self._live = set(range(1, k + 1))
        self._threads = [threading.Thread(target=self._receive, args=(src,), name=f"parts-from-{src}", daemon=True)
                         for src in range(1, k + 1)]
        self._threads.append(threading.Thread(target=self._assemble, name="batch-assembler", daemon=True))
        for thread in self._threads:  # a receiving thread ends on its rank's DONE or a failed receive
            self.bridge.own(thread, self.finish_batches)
        for thread in self._threads:
            thread.start()

    def _fail(self, message: str) -> None:
        """The run cannot go on: the trainer's thread hears it from the buffer, a wait for reports from here."""
        self.buffer.fail(message)
        with self._cond:
            self._failed = self._failed or message
            self._cond.notify_all()

    def _receive(self, src: int) -> None:
        """Bridge rank `src`'s messages, in its order, until it says DONE or fails: batch parts to the assembler
        (discarded once no batch is trained any more: the drain of remote_sync's end of a run), validation parts to
        their report."""
        name = f"rollout rank {self.bridge.plan.global_rank(src)}"
        try:
            while True:
                try:
                    msg = recv_object(self.bridge.batches, src, BATCHES_TAG)
                except BaseException as e:  # noqa: BLE001 (handed to the trainer's thread through the buffer)
                    with self._cond:
                        where = (f" while the trainer waited for batch {self._assembler.next}"
                                 if not self._batches_done else "")
                    why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    minutes = self.bridge.timeout.total_seconds() / 60
                    if "timed out" in why.lower() and self._beating(src):  # alive, only slow: say which knob
                        self._fail(f"{name} sent nothing for parallel.timeout_minutes={minutes:g}{where}, though it "
                                   "is alive: raise parallel.timeout_minutes if its batches take longer")
                    else:
                        self._fail(f"{name} is gone{where} ({why})")
                    self._stop_rollout_ranks(f"{name} is gone" if "timed out" not in why.lower()
                                             else f"{name} timed out")
                    return
                if msg == DONE:
                    return
                if isinstance(msg, dict) and "error" in msg:
                    self._fail(f"{name} failed: {msg['error']}")
                    self._stop_rollout_ranks(f"{name} failed: {msg['error']}")
                    return
                with self._cond:
                    if isinstance(msg, dict) and "val" in msg:
                        self._add_val_part(msg)
                    elif not self._batches_done:
                        self._assembler.add(msg)
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 (a malformed part: the run cannot go on)
            self._fail(f"{name}: {type(e).__name__}: {e}")
        finally:
            with self._cond:
                self._live.discard(src)
                self._cond.notify_all()

    def _beating(self, src: int) -> bool:
        """Whether bridge rank `src`'s heartbeat moves (over 3 s)."""
        rank = self.bridge.plan.global_rank(src)
        try:
            beats = heartbeat_store(self.bridge.store)
            before = heartbeat_counts(beats, [rank])[rank][0]
            time.sleep(3.0)
            return heartbeat_counts(beats, [rank])[rank][0] != before
        except Exception:  # noqa: BLE001 (no store: nothing to tell)
            return False

    def _stop_rollout_ranks(self, reason: str) -> None:
        """A rollout rank failed or is gone: STOP the others now (with `reason`) rather than after the trainer's
        step ends, and answer a failed rank, whose weight receiver waits for STOP before it exits."""
        with self._cond:
            if self._batches_done:  # the run is ending anyway: close() sends STOP
                return
        self.sender.close(reason=reason, wait=False)

    def _add_val_part(self, msg: dict) -> None:
        """(Under the condition.) Keep a validation part; the report is complete once every rollout rank's is in."""
        parts = self._val_parts.setdefault(int(msg["val"]), [])
        parts.append(msg)
        if len(parts) == self.bridge.plan.rollout_ranks:
            del self._val_parts[int(msg["val"])]
            self._reports.append(assemble_report(parts, self.cfg.logging.trajectories_per_step))

    def _assemble(self) -> None:
        """Whole batches into the buffer, in index order, as their last part arrives; the buffer's `put` blocks
        while k+1 batches wait (the receiving threads go on receiving meanwhile)."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._assembler.ready() or not self._live
                                    or self._batches_done or self._failed)
                if self._batches_done or self._failed:
                    return
                ready = self._assembler.pop_ready()
                if not ready:  # every rollout rank finished: nothing more comes
                    return
            for batch in ready:
                if not self.buffer.put(batch):
                    return

    # -- what Trainer.step calls ----------------------------------------------------------------------------------
    def sync(self, policy) -> dict:
        """Send the current weights (version = updates so far) to the rollout ranks; every trainer rank gathers.
        A version already sent (for a validation) is not gathered again."""
        if self._sent is None or self._sent[0] != self.version:
            self._sent = (self.version, self.sender.send(policy, self.version))
        return self._sent[1]

    def request_validation(self, policy) -> None:
        """Send the current weights marked for validation: the rollout ranks validate this version between two of
        their batches, each its share of the rows, and rank 0 assembles the report (`reports`); nobody waits for it
        here."""
        self._sent = (self.version, self.sender.send(policy, self.version, validate=True))
        if self.leader:
            with self._cond:
                self._requested.append(self.version)

    def reports(self, wait: bool = False) -> list[dict]:
        """The validation reports received so far (rank 0; [] elsewhere); with `wait`, first wait until every
        requested one arrived, or the receiver stopped (an error: the run is ending anyway)."""
        with self._cond:
            if wait:
                self._cond.wait_for(lambda: len(self._reports) >= len(self._requested) or not self._live
                                    or self._failed)
                if self._failed and len(self._reports) < len(self._requested):
                    raise RuntimeError(f"validation of version {self._requested[len(self._reports)]}: "
                                       f"{self._failed}")
            out, self._reports = self._reports, []
            del self._requested[:len(out)]
            return out

    def sleep(self) -> None:
        pass

    def mark_stale(self) -> None:
        """An update happened: the next sync sends the next version."""
        self.version += 1

    def take(self, step: int) -> tuple[GeneratedBatch, float, int]:
        """The batch step `step` trains, the same on every trainer rank: rank 0 takes it from the buffer and
        broadcasts it (or the error that stops the run, so no rank is left waiting). Returns (batch, seconds
        waited, batches dropped so far).

        Rank 0 waits in rounds of WAIT_ROUND_SECONDS and tells the other trainer ranks after each, so no collective
        of theirs waits long enough to time out (parallel.timeout_minutes) while the rollout ranks are slow but
        alive: the first batch waits for their engines to start. Rank 0 says how long it has waited, once a minute;
        what bounds the wait is a rollout rank that fails, dies (its channel, the heartbeats) or sends nothing for
        parallel.timeout_minutes (its channel's timeout, `_receive`)."""
        start = time.perf_counter()
        said = start
        while True:
            box: list = [None]
            if self.leader:
                try:
                    batch = self.buffer.take(step, timeout=WAIT_ROUND_SECONDS, check=self.sender.raise_if_failed)
                    box[0] = (batch, self.buffer.dropped)
                except TimeoutError:
                    box[0] = ("wait", None)
                    if time.perf_counter() - said >= WAIT_NOTE_SECONDS:
                        said = time.perf_counter()
                        first = " (the first: their engines start up, then generate it)" if self.version == 0 else ""
                        print(f"rank 0 (trainer): step {step} has waited {said - start:.0f} s for batch {step - 1}"
                              f" from the rollout ranks{first}", flush=True)
                except (BufferClosed, RuntimeError) as e:
                    box[0] = ("error", str(e))
            if dist.get_world_size() > 1:
                dist.broadcast_object_list(box, src=0)
            if box[0][0] == "wait":
                continue
            if box[0][0] == "error":
                raise RuntimeError(f"step {step}: {box[0][1]}")
            batch, dropped = box[0]
            return batch, time.perf_counter() - start, dropped

    def finish_batches(self) -> None:
        """No batch is trained any more: the buffer closes, the receiving threads discard parts from now on (and
        still keep validation parts) until their rollout rank says DONE."""
        self.buffer.close()
        with self._cond:
            self._batches_done = True
            self._cond.notify_all()

    def close(self, reason: Optional[str] = None) -> None:
        """Stop the rollout ranks (STOP with `reason`, an error line or None) and wait until each said DONE."""
        if self._closed:
            return
        self._closed = True
        self.finish_batches()
        self.sender.close(reason=reason)
        # each rollout rank answers STOP with DONE within a share's generation; a dead one's receive fails at once
        deadline = time.monotonic() + min(self.bridge.timeout.total_seconds(), CLOSE_SECONDS)
        for thread in self._threads:
            thread.join(timeout=max(deadline - time.monotonic(), 0.0))


class AsyncTrainer(Trainer):
    """The Trainer on the trainer ranks of a disaggregated run (module doc): generation is RemoteRollout.take."""

    def __init__(self, cfg, bridge: Bridge):
        from megatron_searchr1.trainer.build import build_roles

        roles = build_roles(cfg)  # the trainer world: Megatron's groups, the models; no engine (build.py)
        t0 = [time.time()]
        dist.broadcast_object_list(t0, src=0)
        roles.worker = RemoteRollout(cfg, bridge, roles.dp_rank, roles.dp_size, t0[0])
        super().__init__(cfg, roles)
        self.remote: RemoteRollout = roles.worker
        self.remote.start(first_batch=self.step_no, first_version=self.step_no)
        self._train_start = 0.0

    def generate_batch(self) -> tuple[list, list[dict], list[str], dict]:
        """This DP rank's groups of batch step_no-1 (generated remotely), their scores, group ids and metrics."""
        batch, waited, dropped = self.remote.take(self.step_no)
        p = batch.payload
        trajs = dp_shard(p["trajs"], self.roles.dp_rank, self.roles.dp_size)
        scores = dp_shard(p["scores"], self.roles.dp_rank, self.roles.dp_size)
        t0 = self.remote.t0
        lags = [lag(self.step_no, tr.meta["policy_version"]) for tr in p["trajs"]]
        partial = version_metrics([tr.versions for tr in p["trajs"]]) if self.cfg.rollout.partial else {}
        self.roles.logger.histogram(self.step_no, "async/staleness", lags)  # the whole batch: rank 0 logs
        self.roles.logger.histogram(self.step_no, "async/rollout_rank",
                                    [tr.meta["rollout_rank"] for tr in p["trajs"]])
        ends = [part[4] for part in batch.extra["parts"]]
        streamed = {"async/groups_in_flight_mean": sum(batch.extra["in_flight"]) / len(batch.extra["in_flight"]),
                    "async/producer_wait_s": batch.extra["wait_s"]} if "in_flight" in batch.extra else {}
        metrics = {**p["metrics"],
                   "async/version": float(batch.version), "async/lag": float(lag(self.step_no, batch.version)),
                   "async/batch": float(batch.index), "async/dropped": float(dropped), "async/wait_s": waited,
                   "async/gen_start_s": batch.gen_start - t0, "async/gen_end_s": batch.gen_end - t0,
                   "async/parts": float(len(batch.extra["parts"])), **streamed,
                   "async/parts_end_spread_s": max(ends) - min(ends),
                   **staleness_metrics(lags, self.cfg.rollout.max_staleness), **partial,
                   **{f"sync/{k}": v for k, v in p["sync"].items()}}
        self._train_start = time.time() - t0
        return trajs, scores, [f"{batch.index}:{tr.uid}" for tr in trajs], metrics

    def step(self) -> dict:
        self.log_reports()
        metrics = super().step()
        metrics["async/train_start_s"] = self._train_start  # generate_batch returned: the training began
        metrics["async/train_end_s"] = time.time() - self.remote.t0
        return metrics

    def fit(self) -> dict:
        out = super().fit()
        self.remote.finish_batches()  # the receiving threads only drain now (and keep validation parts)
        self.log_reports(wait=True)  # the last validation (the final one) before the rollout ranks stop
        return out

    def validate(self) -> dict:
        """Ask for a validation of the current version on the rollout ranks (between their batches); its report is
        logged under this step when it arrives (`log_reports`), so training does not wait for it."""
        interrupt.note(f"asking for validation at step {self.step_no}")
        self.remote.request_validation(self.policy)
        return {}

    def log_reports(self, wait: bool = False) -> None:
        """Log the validation reports that arrived (trainer rank 0 holds them) at the step of their version, as
        Trainer.validate does (`record_validation`)."""
        plan = self.remote.bridge.plan
        where = (f" (rollout rank {plan.global_rank(1)})" if plan.rollout_ranks == 1 else
                 f" (rollout ranks {plan.global_rank(1)}-{plan.global_rank(plan.rollout_ranks)})")
        for msg in self.remote.reports(wait=wait):
            self.record_validation(int(msg["val"]), msg["records"], msg["samples"], where)

    def close(self, reason: Optional[str] = None) -> None:
        try:
            self.remote.close(reason=reason)
        finally:
            super().close()
