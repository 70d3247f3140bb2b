"""Disaggregated, asynchronous RL: the last `parallel.rollout_ranks` ranks only generate, the others only train, at once.

    torchrun --nproc_per_node 3 -m megatron_searchr1.train examples/grpo_tiny_cpu.yaml parallel.tp=2 \\
        parallel.rollout_placement=disaggregated parallel.rollout_ranks=1 rollout.max_staleness=1

    run_disaggregated(cfg)      # train.py: each rank takes its role (rollout/remote_sync.py RolePlan)

The trainer ranks run the ordinary Trainer (trainer/rl.py) with one change: its generate step takes a finished batch
from the rollout ranks (RemoteRollout) instead of running an engine, and its weight sync sends the weights to them
(remote_sync.WeightSender) instead of loading a local engine. So a step is:
  1. send the weights (version t-1) to the rollout ranks: gathered here, sent by a thread on trainer rank 0;
  2. take batch t-1 from the buffer (rollout/async_buffer.py: the staleness bound), waiting only when the rollout
     ranks are behind; rank 0 receives it (a thread), every trainer rank gets it, each DP rank its share of groups;
  3-7. as in the synchronous trainer: old / reference log-probs, advantages, updates (the engine's per-token
     log-probs are the behaviour policy, so algo.rollout_correction applies to the off-policy gap), metrics.
Meanwhile each rollout rank loops in `serve_rollouts`: wait until it holds a version recent enough for its next
batch (async_buffer.required_version), load the newest weights it has, generate the batch with its vLLM engine and
the retrieval client (the multi-turn search loop, rollout/loop.py), score it, send it to trainer rank 0. Batch b
goes to rollout rank b mod K; every rollout rank draws the same prompt order (same seed), so the data cursor is the
batch index: a run resumed at step t has its rollout ranks start at batch t, no prompt trained twice.

Metrics per step (`async/*`): the generating version, the lag (async_buffer's definition), batches dropped as too
old, the wait for the batch, and the wall-clock intervals of the batch's generation and of the step's training
(seconds since trainer rank 0 started), from which overlap can be read; `sync/remote_*` for the weights, and
`sync/remote_check_max_diff`, the largest difference between the weights a rollout rank's engine holds after
loading a version and the weights sent (a few tensors, read back from the engine).

Validation runs on the rollout ranks between two of their batches (`validate` marks the version it sends): each
validates its contiguous share of the validation rows (`val_share`), the others send their records to the first
rollout rank, which sends the whole report back on the batches channel, and trainer rank 0 logs it under that step
when it arrives. (The parts meet on the first rollout rank, not on trainer rank 0, whose receiver reads batches from
one rollout rank at a time: a part from another would wait behind that rank's batches, and at the end behind its
DONE, which only follows the report.) Each trajectory carries the version of every token (loop.Trajectory.versions)
and counts as its oldest generated token's (async_buffer.sample_version), which the staleness histogram
(`async/staleness`) and the bound read.

Partial rollouts (`rollout.partial`): a rollout rank also loads newer weights between two turns of a batch's
multi-turn loop (the hook `run_rollout(weights=...)`), so a trajectory still generating when a version arrives
continues under it rather than finishing on the old one; its tokens then span versions, `async/multi_version_share`
and `async/versions_per_sample_mean` say how many. The behaviour log-probs stay the engine's, token by token, so
the rollout correction sees each token's own policy gap; the bound holds since it reads the oldest token.

The end of a run and failures (remote_sync's module doc): trainer rank 0 sends STOP with a reason and drains the
batches channel until every rollout rank said DONE, so an early stop (trainer.stop_on_collapse) is a clean exit on
every rank. A rank whose collective, send or receive fails names the ranks that are gone (heartbeats in torchrun's
store) in one line; trainer rank 0 passes its line to the rollout ranks with STOP; a dead rollout rank is named by
the trainer's receiving thread ("rollout rank 2 is gone"), a dead trainer rank 0 by the rollout ranks' weight
receivers ("trainer rank 0 is gone").
"""
from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from typing import Optional

import torch.distributed as dist

from megatron_searchr1 import interrupt
from megatron_searchr1.data.rl_data import dp_shard
from megatron_searchr1.rollout.async_buffer import (AsyncBuffer, BufferClosed, GeneratedBatch, lag,
                                                    required_version, sample_version, version_metrics)
from megatron_searchr1.rollout.remote_sync import (BATCHES_TAG, DONE, ROLLOUT, VAL_TAG, Bridge, Heartbeat,
                                                   RolePlan, WeightReceiver, WeightSender, init_role_world,
                                                   name_ranks, recv_object, send_object)
from megatron_searchr1.search.client import RetrievalDown
from megatron_searchr1.trainer.rl import Trainer

CHECKED_TENSORS = 4
"""How many received tensors a rollout rank reads back from its engine after each load (sync/remote_check_*)."""


def run_disaggregated(cfg) -> int:
    """The whole job on this rank: join its role world, then train (AsyncTrainer) or generate (serve_rollouts).
    A failure here is reported with the ranks that are gone, when a peer's death caused it (`stopping_line`)."""
    from megatron_searchr1.megatron.initialize import resolve_device

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    plan = RolePlan(world, cfg.parallel.rollout_ranks)
    bridge = init_role_world(plan, rank, resolve_device(), cfg.parallel.timeout_minutes)
    heartbeat = Heartbeat(bridge.store, rank)
    try:
        if bridge.role == ROLLOUT:
            serve_rollouts(cfg, bridge)
        else:
            trainer = AsyncTrainer(cfg, bridge)
            try:
                trainer.fit()
            except BaseException as e:
                trainer.close(reason=stopping_line(bridge, heartbeat, e) or type(e).__name__)  # rollout ranks stop
                raise
            trainer.close()
    except Exception as e:
        line = stopping_line(bridge, heartbeat, e)
        if line is None:
            raise
        print(line, file=sys.stderr, flush=True)
        raise RuntimeError(line) from e
    heartbeat.done()
    return 0


def stopping_line(bridge: Bridge, heartbeat: Heartbeat, error: BaseException) -> Optional[str]:
    """One line for the failure `error` on this rank, naming the ranks that are gone when there are any
    (heartbeats; found once, kept on the error); None for Ctrl-C, a lost retrieval server and a user mistake,
    which have lines of their own (interrupt.py, cli.run_main)."""
    from megatron_searchr1.cli import UsageError

    if isinstance(error, (KeyboardInterrupt, RetrievalDown, UsageError)):
        return None
    if getattr(error, "stopping_line", None):
        return error.stopping_line
    me = f"rank {bridge.rank} ({bridge.role})"
    text = str(error).splitlines()[0] if str(error) else ""
    gone = heartbeat.gone(range(bridge.plan.world))
    line = (f"{me}: {name_ranks(bridge.plan, gone)} is gone; stopping ({type(error).__name__}: {text})" if gone
            else f"{me}: stopping on {type(error).__name__}: {text}")
    try:
        error.stopping_line = line
    except AttributeError:
        pass
    return line


def val_share(n: int, part: int, parts: int) -> range:
    """The validation rows rollout rank `part` (0-based) of `parts` validates: contiguous shares in order, sizes
    differing by at most one, so the first rollout rank's concatenation of the parts is the rows' order.

    >>> [val_share(5, p, 2) for p in range(2)], val_share(1, 1, 2)
    ([range(0, 2), range(2, 5)], range(0, 1))
    """
    return range(n * part // parts, n * (part + 1) // parts)


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
class RemoteRollout:
    """The trainer ranks' stand-in for a RolloutWorker: `sync` sends the weights, `take(step)` returns this DP
    rank's share of the step's batch; `sleep` / `mark_stale` have nothing to do (no local engine)."""

    def __init__(self, cfg, bridge: Bridge, dp_rank: int, dp_size: int, t0: float):
        from megatron_searchr1.models.convert import DTYPES

        r = cfg.rollout
        self.cfg, self.bridge, self.dp_rank, self.dp_size, self.t0 = cfg, bridge, dp_rank, dp_size, t0
        self.leader = bridge.bridge_rank == 0
        self.sender = WeightSender(bridge, bucket_bytes=r.sync_bucket_mb << 20,
                                   dtype=DTYPES[cfg.model.dtype if r.dtype == "auto" else r.dtype])
        self.buffer = AsyncBuffer(capacity=r.max_staleness + 1, max_staleness=r.max_staleness)
        self._receiver: Optional[threading.Thread] = None
        self._closed = False
        self.version = 0
        self._sent: Optional[tuple[int, dict]] = None  # (version, its sync stats): a version is gathered once
        self._reports: list[dict] = []  # validation reports received (rank 0), not yet logged
        self._requested: list[int] = []  # versions whose validation was asked for (rank 0)
        self._reports_cond = threading.Condition()
        self._receiving = False
        self._failed: Optional[str] = None  # why the receiver stopped early (a rollout rank failed or is gone)

    def start(self, first_batch: int, first_version: int) -> None:
        """Tell the rollout ranks where the run starts (after a resume: batch = version = the step reached) and
        start receiving batches."""
        self.version = first_version
        if not self.leader:
            return
        plan = self.bridge.plan
        for dst in range(1, plan.rollout_ranks + 1):
            send_object(self.bridge.batches, {"first_batch": first_batch, "first_version": first_version,
                                              "t0": self.t0}, dst, BATCHES_TAG)
        self._receiving = True
        self._receiver = threading.Thread(target=self._receive, args=(first_batch,), name="batch-receiver",
                                          daemon=True)
        self._receiver.start()

    def _recv(self, src: int):
        """The next message from bridge rank `src` that is not a validation report (those are kept for `reports`)."""
        while True:
            msg = recv_object(self.bridge.batches, src, BATCHES_TAG)
            if not (isinstance(msg, dict) and "val" in msg):
                return msg
            with self._reports_cond:
                self._reports.append(msg)
                self._reports_cond.notify_all()

    def _receive(self, first_batch: int) -> None:
        """Batches in order into the buffer; once the buffer is closed (the run's end, or an error), drain
        (`_drain`)."""
        try:
            self._receive_batches(first_batch)
        finally:
            with self._reports_cond:
                self._receiving = False
                self._reports_cond.notify_all()

    def _fail(self, message: str) -> None:
        """The run cannot go on: the trainer's thread hears it from the buffer, a wait for reports from here."""
        self.buffer.fail(message)
        with self._reports_cond:
            self._failed = self._failed or message
            self._reports_cond.notify_all()

    def _receive_batches(self, first_batch: int) -> None:
        plan, total = self.bridge.plan, self.cfg.trainer.total_steps
        finished: set[int] = set()  # rollout ranks that said DONE or failed: nothing more comes from them
        for b in range(first_batch, total):
            src = 1 + b % plan.rollout_ranks
            try:
                msg = self._recv(src)
            except BaseException as e:  # noqa: BLE001 (handed to the trainer's thread through the buffer)
                self._fail(f"rollout rank {plan.global_rank(src)} is gone while the trainer waited for batch "
                           f"{b} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
                finished.add(src)
                break
            if msg == DONE:  # it stopped early: only after the trainer said STOP, so the run is closing
                finished.add(src)
                break
            if isinstance(msg, dict) and "error" in msg:
                self._fail(f"rollout rank {plan.global_rank(src)} failed: {msg['error']}")
                finished.add(src)
                break
            if not self.buffer.put(msg):
                break
        self._drain(finished)

    def _drain(self, finished: set) -> None:
        """Receive from every rollout rank until it says DONE, keeping validation reports and discarding batches: a
        rollout rank that was sending a batch when the trainer stopped completes its send and exits instead of
        failing (remote_sync's end of a run)."""
        plan = self.bridge.plan
        for src in range(1, plan.rollout_ranks + 1):
            while src not in finished:
                try:
                    msg = self._recv(src)
                except BaseException as e:  # noqa: BLE001 (gone without a word: nothing more to drain)
                    self._fail(f"rollout rank {plan.global_rank(src)} is gone ({type(e).__name__})")
                    break
                if isinstance(msg, dict) and "error" in msg:
                    self._fail(f"rollout rank {plan.global_rank(src)} failed: {msg['error']}")
                    break
                if msg == DONE:
                    break

    # -- what Trainer.step calls ----------------------------------------------------------------------------------
    def sync(self, policy) -> dict:
        """Send the current weights (version = updates so far) to the rollout ranks; every trainer rank gathers.
        A version already sent (for a validation) is not gathered again."""
        if self._sent is None or self._sent[0] != self.version:
            self._sent = (self.version, self.sender.send(policy, self.version))
        return self._sent[1]

    def request_validation(self, policy) -> None:
        """Send the current weights marked for validation: the rollout ranks validate this version between two of
        their batches and the first one sends the report back (`reports`); nobody waits for it here."""
        self._sent = (self.version, self.sender.send(policy, self.version, validate=True))
        if self.leader:
            with self._reports_cond:
                self._requested.append(self.version)

    def reports(self, wait: bool = False) -> list[dict]:
        """The validation reports received so far (rank 0; [] elsewhere); with `wait`, first wait until every
        requested one arrived, or the receiver stopped (an error: the run is ending anyway)."""
        with self._reports_cond:
            if wait:
                self._reports_cond.wait_for(lambda: len(self._reports) >= len(self._requested)
                                            or not self._receiving or self._failed)
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
        waited, batches dropped so far)."""
        start = time.perf_counter()
        box: list = [None]
        if self.leader:
            try:
                batch = self.buffer.take(step, check=self.sender.raise_if_failed)
                box[0] = (batch, self.buffer.dropped)
            except (BufferClosed, RuntimeError) as e:
                box[0] = ("error", str(e))
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        if box[0][0] == "error":
            raise RuntimeError(f"step {step}: {box[0][1]}")
        batch, dropped = box[0]
        return batch, time.perf_counter() - start, dropped

    def close(self, reason: Optional[str] = None) -> None:
        """Stop the rollout ranks (STOP with `reason`, an error line or None) and wait until each said DONE."""
        if self._closed:
            return
        self._closed = True
        self.buffer.close()
        self.sender.close(reason=reason)
        if self._receiver is not None:
            self._receiver.join(timeout=self.bridge.timeout.total_seconds())


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
        lags = [lag(self.step_no, tr.meta.get("policy_version", batch.version)) for tr in p["trajs"]]
        partial = version_metrics([tr.versions for tr in p["trajs"]]) if self.cfg.rollout.partial else {}
        self.roles.logger.histogram(self.step_no, "async/staleness", lags)  # the whole batch: rank 0 logs
        metrics = {**p["metrics"],
                   "async/version": float(batch.version), "async/lag": float(lag(self.step_no, batch.version)),
                   "async/batch": float(batch.index), "async/dropped": float(dropped), "async/wait_s": waited,
                   "async/gen_start_s": batch.gen_start - t0, "async/gen_end_s": batch.gen_end - t0,
                   **staleness_metrics(lags, self.cfg.rollout.max_staleness), **partial,
                   **{f"sync/{k}": v for k, v in p.get("sync", {}).items()}}
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
        self.remote.buffer.close()  # no batch is trained any more: the receiver only drains (and keeps reports)
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


# ----------------------------------------------------------------------------------------------------------------
# The rollout side
# ----------------------------------------------------------------------------------------------------------------
def _engine_tensors(worker, names: list[str]) -> dict:
    """Inside the vLLM worker (this process): copies of the model's parameters of these HF names, where vLLM keeps
    them under the same name (norms, o_proj, down_proj; not the stacked qkv / gate_up)."""
    params = dict(worker.model_runner.model.named_parameters())
    return {n: params[n].detach().float().clone() for n in names if n in params}


def check_engine_weights(engine, pairs: list) -> tuple[float, int]:
    """(largest |engine - sent| over up to CHECKED_TENSORS sent tensors the engine keeps under their HF names,
    how many were compared). Only for the vLLM engine (nan, 0 otherwise)."""
    llm = getattr(engine, "llm", None)
    if llm is None:
        return float("nan"), 0
    sent = {n: t for n, t in pairs}
    got = llm.collective_rpc(_engine_tensors, args=(list(sent),))[0]
    names = [n for n in sent if n in got and tuple(got[n].shape) == tuple(sent[n].shape)][:CHECKED_TENSORS]
    if not names:
        return float("nan"), 0
    return max(float((got[n] - sent[n].float()).abs().max()) for n in names), len(names)


def serve_rollouts(cfg, bridge: Bridge) -> None:
    """A rollout rank's whole run (module doc): its batches, each with the newest weights it has, within the bound."""
    from megatron_searchr1.data.rl_data import PromptSampler
    from megatron_searchr1.models.convert import load_hf_config
    from megatron_searchr1.rollout import loop
    from megatron_searchr1.rollout.engine_groups import SHARE_SEED_STRIDE
    from megatron_searchr1.rollout.engines import make_engine
    from megatron_searchr1.rollout.loop import settings_from_config
    from megatron_searchr1.search.client import RetrievalClient, SearchGuard
    from megatron_searchr1.trainer import losses, reports
    from megatron_searchr1.trainer.build import engine_kwargs, launch_server, load_data, load_tokenizer
    from megatron_searchr1.trainer.roles import RolloutWorker
    from megatron_searchr1.trainer.sources import stop_token_ids

    r, q, t = cfg.rollout, cfg.retrieval, cfg.trainer
    plan, me = bridge.plan, bridge.bridge_rank - 1  # me: 0..K-1
    hf_config = load_hf_config(cfg.model.path)
    tokenizer = load_tokenizer(cfg.model.path, hf_config, cfg.data.chat_template)
    data = load_data(cfg, tokenizer, log=False)
    receiver = WeightReceiver(bridge)
    server, url = None, q.url
    if q.launch:  # the rollout ranks are the only clients: the first of them on each node starts its server
        server, url = launch_server(cfg)
        if server is not None:
            print(f"rank {bridge.rank} (rollout): started the retrieval server {url} for this node's rollout ranks",
                  flush=True)
    engine = make_engine(r.engine, cfg.model.path, **engine_kwargs(cfg, dist.get_rank()))
    client = RetrievalClient(url, topk=q.topk, timeout=q.timeout)
    guard = SearchGuard(client.search, url, q.max_error_rate, q.max_failed_rounds)
    settings, val_settings = settings_from_config(r, stop_token_ids(tokenizer, cfg.model.path), t.seed)

    def validate_due() -> None:
        """Validate this rank's share of the rows with each version the trainer marked; the first rollout rank
        gathers the others' records (module doc) and sends the report."""
        while (due := receiver.take_due()) is not None:
            validate(*due)

    def validate(version: int, buckets: list) -> None:
        interrupt.note(f"validating version {version}")
        if receiver.applied_version != version:
            receiver.load(engine, version, buckets)
        rows = [data.val[i] for i in val_share(len(data.val), me, plan.rollout_ranks)]
        records, samples = [], []
        for start in range(0, len(rows), cfg.data.val_batch_size):
            trajs = RolloutWorker.make_trajectories(rows[start:start + cfg.data.val_batch_size], 1)
            loop.run_rollout(engine, tokenizer, guard, trajs, val_settings)
            for tr, sc in zip(trajs, losses.score_trajectories(trajs, tokenizer, cfg.algo)):
                if len(samples) < cfg.logging.trajectories_per_step:
                    samples.append(reports.eval_sample(tokenizer, tr, sc))
                records.append(reports.eval_record(tr, sc))
        guard.take()  # validation's searches are in the report's records, not in the next batch's error rate
        if me > 0:
            send_object(bridge.batches, {"val": version, "records": records, "samples": samples}, 1, VAL_TAG)
            return
        for src in range(2, plan.rollout_ranks + 1):  # every rollout rank validates every marked version, in order
            part = recv_object(bridge.batches, src, VAL_TAG)
            if part["val"] != version:
                raise RuntimeError(f"rollout rank {plan.global_rank(src)} validated version {part['val']}, "
                                   f"expected {version}")
            records += part["records"]
            samples += part["samples"][:cfg.logging.trajectories_per_step - len(samples)]
        send_object(bridge.batches, {"val": version, "records": records, "samples": samples}, 0, BATCHES_TAG)

    start = recv_object(bridge.batches, 0, BATCHES_TAG)
    first_batch, first_version = start["first_batch"], start["first_version"]
    interrupt.reassert()  # Ctrl-C: our one-line exit, whatever vLLM installed while the engine was built
    sampler = PromptSampler(len(data.train), cfg.data.train_batch_size, t.seed, cfg.data.shuffle)
    for _ in range(first_batch):  # the data cursor: batch b is the b-th draw, whichever run drew the earlier ones
        sampler.next_batch()
    check = (float("nan"), 0)

    def weights() -> int:
        """Load the newest weights received, if newer than the engine's (before a batch; with rollout.partial also
        between the turns of one), and check them; the version the engine holds."""
        nonlocal check
        loaded = receiver.apply(engine)
        if loaded is not None:
            check = check_engine_weights(engine, loaded[1])
        return receiver.applied_version

    try:
        for b in range(first_batch, t.total_steps):
            rows = [data.train[i] for i in sampler.next_batch()]
            if b % plan.rollout_ranks != me:
                continue
            interrupt.note(f"generating batch {b} of {t.total_steps}")
            if (receiver.stopped or not receiver.wait_for(required_version(b, r.max_staleness, first_version))
                    or receiver.stopped):
                break  # the trainer stopped early (trainer.stop_on_collapse, or an error: stop_reason)
            validate_due()
            version = weights()  # the oldest version of this batch's tokens
            gen_start = time.time()
            trajs = RolloutWorker.make_trajectories(rows, r.n)
            seed = t.seed * 1_000_003 + (b + 1) * 7919 + me * SHARE_SEED_STRIDE  # Trainer.step_seed of step b+1
            stats = loop.run_rollout(engine, tokenizer, guard, trajs, dataclasses.replace(settings, seed=seed),
                                     weights=weights if r.partial else lambda: version)
            for tr in trajs:  # per sample, its oldest token's version: the staleness histogram reads it
                tr.meta["policy_version"] = sample_version(tr.versions, tr.loss_mask, default=version)
            scores = losses.score_trajectories(trajs, tokenizer, cfg.algo)
            failed, searched, opened, last = guard.take()
            guard.down(failed, searched, opened, last, f"batch {b} on rollout rank {bridge.rank}")  # raises to stop
            metrics = {**stats.as_metrics(trajs), "rollout/search_error_rate": failed / max(searched, 1)}
            payload = {"trajs": trajs, "scores": scores, "metrics": metrics,
                       "sync": {"remote_check_max_diff": check[0], "remote_check_tensors": float(check[1]),
                                "remote_applied_version": float(version)}}
            send_object(bridge.batches, GeneratedBatch(index=b, version=version, payload=payload,
                                                       gen_start=gen_start, gen_end=time.time(), rank=bridge.rank),
                        0, BATCHES_TAG)
        interrupt.note("waiting for the trainer's stop")
        while True:  # a validation asked for after the last batch (the final one) comes before STOP
            validate_due()
            if receiver.stopped:
                break
            receiver.wait_due_or_stop()
    except BaseException as e:
        # tell the trainer why, if it still listens; then fail this rank (torchrun stops the job)
        try:
            send_object(bridge.batches, {"error": f"{type(e).__name__}: {e}"}, 0, BATCHES_TAG)
        except Exception:  # noqa: BLE001 (the trainer may be gone too)
            pass
        raise
    send_object(bridge.batches, DONE, 0, BATCHES_TAG)  # trainer rank 0 drains until it hears this
    if hasattr(engine, "close"):
        engine.close()
    client.close()
    if server is not None:
        server.stop()
    if receiver.stop_reason:
        err = RuntimeError(f"rank {bridge.rank} (rollout): trainer rank 0 stopped the run: {receiver.stop_reason}")
        err.stopping_line = str(err)  # run_disaggregated prints it as it is
        raise err
