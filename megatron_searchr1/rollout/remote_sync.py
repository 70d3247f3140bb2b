"""The disaggregated placement's plumbing: role worlds, the bridge between trainer rank 0 and the rollout ranks,
and the weights and batches that cross it.

    plan = RolePlan(world=3, rollout_ranks=1)           # ranks 0-1 train, rank 2 generates
    bridge = init_role_world(plan, rank, device="cpu", timeout_minutes=30)
    dist.get_world_size()                               # 2 on a trainer rank, 1 on the rollout rank
    sender = WeightSender(bridge, bucket_bytes=64 << 20, dtype=torch.float32)   # trainer ranks
    sender.send(policy, version=3)                      # every trainer rank: the gather; rank 0 queues the send
    receiver = WeightReceiver(bridge)                    # a rollout rank (rollout/remote_receiver.py): a thread
                                                        # keeps the newest version
    receiver.wait_for(version=2); receiver.apply(engine) # between generate calls
    send_object(bridge.batches, msg, dst=0); recv_object(bridge.batches, src)   # batches, rollout -> trainer

Role worlds. Every process of the torchrun job meets at torchrun's store, then joins the default process group of
its role only: the trainer ranks (the first world - rollout_ranks) form a world of their own, in which Megatron
builds its TP / PP / DP groups exactly as in a colocated run of that size; the rollout ranks form another, which
vLLM's `external_launcher` takes as its world (it builds groups over the whole default world, so it could not share
one with Megatron's ranks). Both are made from prefixes of the same store, so no rank creates a group the others
must join, and nothing depends on the order in which the roles start.

The bridge: two gloo process groups over the same store between trainer rank 0 (bridge rank 0) and the rollout
ranks (bridge ranks 1..K): `weights` (trainer -> rollout) and `batches` (rollout -> trainer), driven by threads of
their own, so a send in one direction never waits behind the other; on trainer rank 0 the batches channel has one
receiving thread per rollout rank, so a rollout rank's send never waits behind another rank's. A dead peer shows as a
failed send or receive on the surviving side ("Connection closed by peer"), which the threads turn into an error
that names the rank.

The weight bytes over NCCL (`parallel.bridge_backend: nccl`, opt-in: auto means gloo everywhere until a GPU run of
the NCCL path passes): a third bridge group, `weights_data`. Headers and STOP stay on gloo; each bucket is one NCCL
broadcast from bridge rank 0 to all K rollout ranks, staged through a device buffer and kept in pinned host memory on
both sides (rollout/remote_nccl.py). NCCL does not
notice a dead peer, so both threads poll their broadcast and give up when the run stops: the sender when close() is
given an error, a receiver when trainer rank 0 wrote STOP into torchrun's store (before the gloo STOPs) or its
heartbeat stood still; either side that gives up a broadcast aborts the communicator, so no NCCL kernel is left
waiting for the watchdog. Otherwise (auto, gloo) each rank gets its buckets over gloo after its header.

Weights travel as WeightSync's buckets (rollout/weight_sync.py: TP gather, HF names, the converter's mapping):
every trainer rank runs the gather, rank 0 keeps each bucket as one flat byte buffer and a thread sends them
(header, then one message per bucket) to every rollout rank. Only the newest unsent version is kept: a rollout
rank wants the newest weights, never a queue of old ones. `sync/remote_*` metrics count bytes and seconds.

The end of a run, clean or not. Trainer rank 0 ends the weights channel with a STOP message that carries why (None:
the run is over, or the trainer stopped early; a string: the error that stopped it); each rollout rank finishes or
abandons its batch and answers on the batches channel with DONE, and trainer rank 0 drains the batches channel of
every rollout rank until that rank said DONE, so a rollout rank in the middle of sending a batch is never left
blocked (its send completes, into the drain). A peer that dies without a word is found by the heartbeats
(`Heartbeat`): every rank bumps a counter in torchrun's store once a second, and a rank whose collective or send
failed names the ranks whose counter stood still ("rank 1 (trainer) is gone") instead of reporting a socket error.
"""
from __future__ import annotations

import datetime
import os
import pickle
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_searchr1.rollout import remote_nccl, weight_sync
from megatron_searchr1.rollout.host_slots import HOST_SLOTS
from megatron_searchr1.rollout.weight_sync import BucketLayout, layout_bucket, pack_bucket

TRAINER, ROLLOUT = "trainer", "rollout"
STORE_PREFIX = "searchr1"
WEIGHTS_TAG, BATCHES_TAG = 11, 12
"""Message tags: weights (trainer -> rollout), batches (rollout -> trainer: batch parts, validation parts, DONE)."""


@dataclass(frozen=True)
class RolePlan:
    """Which global rank plays which role: the last `rollout_ranks` ranks generate, the others train.

    >>> p = RolePlan(world=4, rollout_ranks=1)
    >>> [p.role(r) for r in range(4)], p.role_rank(3), p.bridge_rank(0), p.bridge_rank(1), p.bridge_rank(3)
    (['trainer', 'trainer', 'trainer', 'rollout'], 0, 0, None, 1)
    """

    world: int
    rollout_ranks: int

    def __post_init__(self):
        if not 1 <= self.rollout_ranks < self.world:
            raise ValueError(f"rollout_ranks must be in [1, world) = [1, {self.world}), got {self.rollout_ranks}")

    @property
    def trainers(self) -> int:
        return self.world - self.rollout_ranks

    def role(self, rank: int) -> str:
        return TRAINER if rank < self.trainers else ROLLOUT

    def role_rank(self, rank: int) -> int:
        """The rank inside its role's world."""
        return rank if rank < self.trainers else rank - self.trainers

    def bridge_rank(self, rank: int) -> Optional[int]:
        """The rank in the bridge groups: trainer rank 0 -> 0, rollout ranks -> 1..K, other trainers None."""
        if rank == 0:
            return 0
        return None if rank < self.trainers else 1 + rank - self.trainers

    def global_rank(self, bridge_rank: int) -> int:
        """The global rank of a bridge rank (the inverse of bridge_rank)."""
        return 0 if bridge_rank == 0 else self.trainers + bridge_rank - 1


def bridge_backend(choice: str, device: str) -> str:
    """The backend of the weight buckets between the roles: `parallel.bridge_backend` (auto | gloo | nccl, checked
    by the config) resolved for this run's device. auto is the tested transport, gloo, on every device: the NCCL path
    has run on fake process groups only (tests/rollout/test_remote_nccl.py), never on a GPU, so it stays opt-in
    (`nccl`) until a GPU run passes. nccl without CUDA is a UsageError naming the field (one `error:` line, exit 2).

    >>> bridge_backend("auto", "cuda"), bridge_backend("auto", "cpu"), bridge_backend("nccl", "cuda")
    ('gloo', 'gloo', 'nccl')
    """
    from megatron_searchr1.cli import UsageError

    if choice == "nccl" and device != "cuda":
        raise UsageError(f"parallel.bridge_backend=nccl needs CUDA, but this run's device is {device}: set "
                         "parallel.bridge_backend=auto or gloo")
    return "nccl" if choice == "nccl" else "gloo"


@dataclass
class Bridge:
    """This process's place in the disaggregated job: its role, and on trainer rank 0 / rollout ranks the two
    bridge groups (None on the other trainer ranks)."""

    plan: RolePlan
    rank: int
    """Global rank (torchrun's RANK)."""
    weights: Any = None
    batches: Any = None
    timeout: datetime.timedelta = datetime.timedelta(minutes=30)
    store: Any = None
    """torchrun's store (the heartbeats live under their own prefix in it)."""
    weights_data: Any = None
    """The NCCL group that carries the weight buckets (bridge_backend nccl), None when they go over `weights`."""
    device: torch.device = torch.device("cpu")
    """This rank's device: where the staging buffer of the NCCL path lives."""
    threads: list = field(default_factory=list)
    """[(thread, stop)]: every thread started for this bridge and how to ask it to end without waiting (`own`), so
    a rank that leaves can stop and join them all (trainer/async_rl.py Exit)."""

    def own(self, thread: threading.Thread, stop) -> threading.Thread:
        """Record a thread of the bridge and its stop function (module doc); returns the thread."""
        self.threads.append((thread, stop))
        return thread

    def stop_threads(self, timeout: float) -> list[str]:
        """Ask every recorded thread to end, then join them all within `timeout` seconds together; the names of
        those still alive."""
        for _, stop in self.threads:
            try:
                stop()
            except Exception:  # noqa: BLE001 (best effort: the rank is leaving)
                pass
        deadline = time.monotonic() + timeout
        for thread, _ in self.threads:
            if thread is not threading.current_thread():
                thread.join(timeout=max(deadline - time.monotonic(), 0.0))
        return [t.name for t, _ in self.threads if t.is_alive() and t is not threading.current_thread()]

    @property
    def role(self) -> str:
        return self.plan.role(self.rank)

    @property
    def bridge_rank(self) -> Optional[int]:
        return self.plan.bridge_rank(self.rank)


def init_role_world(plan: RolePlan, rank: int, device: str, timeout_minutes: int, backend: str = "gloo") -> Bridge:
    """Join this rank's role world as the default process group (module doc) and, on trainer rank 0 and the
    rollout ranks, the bridge groups (with `backend` "nccl" (bridge_backend) also the NCCL group of the weight
    buckets). Every rank of the job calls it once, before anything else uses torch.distributed."""
    from megatron_searchr1.megatron.initialize import process_group_kwargs

    if dist.is_initialized():
        raise RuntimeError("init_role_world: torch.distributed is already initialised; call it first")
    timeout = datetime.timedelta(minutes=timeout_minutes)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    role = plan.role(rank)
    size = plan.trainers if role == TRAINER else plan.rollout_ranks
    dist.init_process_group(**process_group_kwargs(device, local_rank, timeout_minutes),
                            store=dist.PrefixStore(f"{STORE_PREFIX}/{role}", store),
                            rank=plan.role_rank(rank), world_size=size)
    bridge = Bridge(plan, rank, timeout=timeout, store=store,
                    device=torch.device("cuda", local_rank) if device == "cuda" else torch.device("cpu"))
    b = plan.bridge_rank(rank)
    if b is not None:
        n = plan.rollout_ranks + 1
        bridge.weights = dist.ProcessGroupGloo(dist.PrefixStore(f"{STORE_PREFIX}/bridge/weights", store), b, n,
                                               timeout)
        bridge.batches = dist.ProcessGroupGloo(dist.PrefixStore(f"{STORE_PREFIX}/bridge/batches", store), b, n,
                                               timeout)
        if backend == "nccl":  # communicator made at the first broadcast, on the device the sending thread set
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            bridge.weights_data = dist.ProcessGroupNCCL(
                dist.PrefixStore(f"{STORE_PREFIX}/bridge/weights-nccl", store), b, n, opts)
    return bridge


# ----------------------------------------------------------------------------------------------------------------
# Messages: pickled objects and flat byte buckets over one bridge group
# ----------------------------------------------------------------------------------------------------------------
def send_tensor(pg, t: torch.Tensor, dst: int, tag: int) -> None:
    pg.send([t.contiguous()], dst, tag).wait()


def send_object(pg, obj: Any, dst: int, tag: int = BATCHES_TAG) -> int:
    """Pickle `obj` and send it to bridge rank `dst` (a length, then the bytes); returns the bytes sent. Blocks
    until the receiver takes it."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    send_tensor(pg, torch.tensor([len(data)], dtype=torch.int64), dst, tag)
    send_tensor(pg, torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, tag)
    return len(data)


def recv_object(pg, src: int, tag: int = BATCHES_TAG) -> Any:
    """What send_object sent from bridge rank `src`."""
    n = torch.zeros(1, dtype=torch.int64)
    pg.recv([n], src, tag).wait()
    buf = torch.empty(int(n.item()), dtype=torch.uint8)
    pg.recv([buf], src, tag).wait()
    return pickle.loads(buf.numpy().tobytes())


def host_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A flat byte buffer in host memory, pinned when `device` is a GPU (fast copies to and from it)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


STOP_KEY = f"{STORE_PREFIX}/bridge/stop"
"""The store key where trainer rank 0 writes STOP's reason ("" for a clean end) before the gloo STOPs: a rollout rank
waiting in an NCCL broadcast that will never come reads it there."""


class _BucketCollector:
    """Stands in for an engine in WeightSync.sync on trainer rank 0: keeps each bucket as one flat byte buffer
    in host memory (the sync's views are valid during its call only). With `reuse` (one of the sender's two slots:
    a list of buffers by bucket index) a bucket goes into the slot's buffer when it fits, else a new buffer replaces
    it there; `allocated` counts the new ones."""

    def __init__(self, device: torch.device = torch.device("cpu"), reuse: Optional[list] = None):
        self.buckets: list[tuple[BucketLayout, torch.Tensor]] = []
        self.device, self.reuse, self.allocated = device, reuse, 0

    def load_weights(self, pairs) -> None:
        pairs = list(pairs)
        layout = layout_bucket([(n, tuple(t.shape), t.dtype) for n, t in pairs])
        i, reuse = len(self.buckets), self.reuse
        if reuse is not None and i < len(reuse) and reuse[i].numel() >= layout.nbytes:
            flat = reuse[i][:layout.nbytes]
        else:
            flat = host_buffer(layout.nbytes, self.device)
            self.allocated += 1
            if reuse is not None:
                reuse[i:i + 1] = [flat]
        pack_bucket([t.detach().cpu() for _, t in pairs], layout, out=flat)
        self.buckets.append((layout, flat))

    def finish_weight_sync(self) -> None:
        pass


STOP = "stop"
"""The key of the weights channel's last message, {STOP: None | error text} (the reason the run ended)."""
DONE = "done"
"""A rollout rank's last message on the batches channel, its answer to STOP."""


def is_stop(msg) -> bool:
    return isinstance(msg, dict) and STOP in msg


def heartbeat_store(store):
    """The part of torchrun's `store` that holds the heartbeats: `beat/N` (rank N's counter) and `done/N`."""
    return dist.PrefixStore(f"{STORE_PREFIX}/heartbeat", store)


def heartbeat_counts(beats, ranks) -> dict[int, tuple[int, int]]:
    """(beats, done) of each of `ranks`, read from `beats` (a `heartbeat_store`) without moving them."""
    return {r: (beats.add(f"beat/{r}", 0), beats.add(f"done/{r}", 0)) for r in ranks}


class Heartbeat:
    """Liveness of every rank of the job, through torchrun's store (which the agent holds, so it outlives any
    worker): a daemon thread adds 1 to this rank's counter every `interval` seconds; `gone(ranks)` reads the
    counters twice, `wait` seconds apart, and returns the ranks whose counter did not move and which did not say
    `done()` (a clean exit). Counters, not clocks: nodes need not agree on the time."""

    def __init__(self, store, rank: int, interval: float = 1.0):
        self.store = heartbeat_store(store)
        self.rank, self.interval = rank, interval
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self.store.add(f"beat/{self.rank}", 1)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 (the store is gone: the job is ending; nothing to report here)
                return

    def gone(self, ranks, wait: Optional[float] = None) -> list[int]:
        """Which of `ranks` stopped beating without saying done (blocks `wait` seconds, default 3 intervals);
        [] when the store itself cannot be read."""
        ranks = [r for r in ranks if r != self.rank]
        try:
            before = heartbeat_counts(self.store, ranks)
            time.sleep(3 * self.interval if wait is None else wait)
            after = heartbeat_counts(self.store, ranks)
        except Exception:  # noqa: BLE001
            return []
        return [r for r in ranks if after[r][0] == before[r][0] and not after[r][1]]

    def done(self) -> None:
        """This rank leaves cleanly: it stops beating (the thread joined) and is not reported as gone."""
        self.stop()
        try:
            self.store.add(f"done/{self.rank}", 1)
        except Exception:  # noqa: BLE001
            pass

    def stop(self, timeout: float = 5.0) -> None:
        """Stop beating and join the thread (a rank that fails: the others will call it gone)."""
        self._stop.set()
        self._thread.join(timeout=timeout)

    def fail(self, line: str) -> None:
        """Leave this rank's one-line reason where the other ranks' watchdogs read it (`failures`), so they stop at
        once naming it instead of waiting for a collective or a heartbeat to time out."""
        try:
            self.store.set(f"failed/{self.rank}", line)
        except Exception:  # noqa: BLE001 (the store is gone: the job is ending anyway)
            pass

    def failures(self, ranks) -> dict[int, str]:
        """{rank: its line} for those of `ranks` (not this one) that said `fail`."""
        out = {}
        for r in ranks:
            if r != self.rank and self.store.check([f"failed/{r}"]):
                out[r] = self.store.get(f"failed/{r}").decode()
        return out

    def counts(self, ranks) -> dict[int, tuple[int, int]]:
        """(beats, done) of each of `ranks`, now."""
        return heartbeat_counts(self.store, ranks)


def name_ranks(plan: RolePlan, ranks: list[int]) -> str:
    """"trainer rank 1", "trainer rank 1 and rollout rank 2" (the names the rest of the bridge's lines use).

    >>> name_ranks(RolePlan(world=4, rollout_ranks=2), [1, 2, 3])
    'trainer rank 1, rollout rank 2 and rollout rank 3'
    """
    parts = [f"{plan.role(r)} rank {r}" for r in ranks]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def queue_version(pending: list, item: tuple) -> list:
    """The sender's queue of unsent versions after `item` = (version, buckets, validate) arrives: it replaces every
    unsent version (newest wins) except those marked for validation, which stay ahead of it in order; a version
    queued twice keeps its mark.

    >>> def show(q): return [(v, val) for v, _, val in q]
    >>> show(queue_version([(1, None, False)], (2, None, False)))
    [(2, False)]
    >>> show(queue_version([(1, None, True), (2, None, False)], (3, None, False)))
    [(1, True), (3, False)]
    >>> show(queue_version([(2, None, True)], (2, None, False)))
    [(2, True)]
    """
    version, buckets, validate = item
    validate = validate or any(v == version and val for v, _, val in pending)
    return [it for it in pending if it[2] and it[0] != version] + [(version, buckets, validate)]


class WeightSender:
    """The trainer side of the weights: `send(policy, version)` on every trainer rank gathers the weights
    (WeightSync) and, on rank 0, hands the buckets to a thread that sends them to every rollout rank. Only the
    newest unsent version waits (module doc). `close()` sends STOP to every rollout rank and joins the thread."""

    def __init__(self, bridge: Bridge, bucket_bytes: int, dtype: Optional[torch.dtype]):
        self.bridge, self.bucket_bytes, self.dtype = bridge, bucket_bytes, dtype
        self.leader = bridge.bridge_rank == 0
        self._cond = threading.Condition()
        self._error: Optional[BaseException] = None
        self._closing = False
        self._pending: Optional[list] = None  # [(version, buckets, validate)]: at most the validated one + newest
        self._reason: Optional[str] = None
        self._abandon: Optional[str] = None  # close()'s error: a broadcast in flight is given up
        self.last_send_seconds = 0.0
        self.sent_versions: list[int] = []
        self.sent_bytes = 0
        """Bucket bytes sent per rollout rank (what each rank receives), over every version sent."""
        # trainer rank 0 gathers each version into one of two reused host slots (pinned on GPUs), as the rollout ranks
        # receive into two (rollout/host_slots.py): one being sent, one queued; a version marked for validation keeps
        # its slot until it is sent, and a gather waits for a free slot rather than allocating a third
        self._slots: list[list[torch.Tensor]] = [[] for _ in range(HOST_SLOTS)]
        self._slot_of: dict[int, int] = {}  # id(a queued version's buckets) -> its slot
        self._in_flight: set = set()  # slots the thread is sending
        self.host_allocations = 0
        """Host buffers allocated for buckets so far (2 x the buckets of a version, in a run whose layout holds)."""
        self._thread = None
        if self.leader:
            self._thread = bridge.own(threading.Thread(target=self._run, name="weight-sender", daemon=True),
                                      lambda: self.close(reason="this rank is leaving", wait=False))
            self._thread.start()

    def send(self, policy, version: int, validate: bool = False) -> dict:
        """Every trainer rank: gather `policy`'s weights; rank 0 queues them as `version`, marked for validation
        on the rollout ranks when `validate` (that mark survives a newer version queued behind it: the
        validated version is then sent first). Returns the `sync/remote_*` metrics (without the prefix), the same
        on every trainer rank."""
        self.raise_if_failed()
        collector = None
        if self.leader:
            slot = self._take_slot()
            collector = _BucketCollector(self.bridge.device, reuse=self._slots[slot])
        stats = weight_sync.sync_weights(policy.model, collector, policy.mapping, bucket_bytes=self.bucket_bytes,
                                         dtype=self.dtype, transport="auto")
        if self.leader:
            with self._cond:
                self.host_allocations += collector.allocated
                self._pending = queue_version(self._pending or [], (version, collector.buckets, validate))
                self._slot_of[id(collector.buckets)] = slot
                self._cond.notify_all()
        return {"remote_bytes": float(stats.bytes), "remote_buckets": float(stats.buckets),
                "remote_gather_seconds": stats.seconds, "remote_version": float(version)}

    def _free_slot(self) -> Optional[int]:
        """(Under the condition.) A slot the next gather may write: not being sent and not holding a version queued
        for validation; one holding an unmarked queued version only if no slot is idle (that version is superseded)."""
        pending = self._pending or []
        held = {self._slot_of.get(id(b)) for _, b, val in pending if val} | self._in_flight
        queued = {self._slot_of.get(id(b)) for _, b, val in pending if not val}
        free = [s for s in range(HOST_SLOTS) if s not in held]
        free.sort(key=lambda s: s in queued)
        return free[0] if free else None

    def _take_slot(self) -> int:
        """Wait for a free slot (the thread frees one as it finishes a version) and clear it of a superseded one."""
        with self._cond:
            self._cond.wait_for(lambda: self._free_slot() is not None or self._error is not None)
            self.raise_if_failed()
            slot = self._free_slot()
            if self._pending:
                self._pending = [it for it in self._pending if self._slot_of.get(id(it[1])) != slot] or None
            return slot

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"sending weights to the rollout ranks failed: {self._error}") from self._error

    def _send_version(self, version: int, buckets: list, validate: bool, gone: set) -> None:
        """One version to every rollout rank: over gloo, per rank its header then its buckets; with the NCCL group,
        the header to every rank (gloo), then one broadcast per bucket (module doc)."""
        pg, plan, nccl = self.bridge.weights, self.bridge.plan, self.bridge.weights_data
        header = {"version": version, "layouts": [lay for lay, _ in buckets], "validate": validate}
        for dst in range(1, plan.rollout_ranks + 1):
            try:
                send_object(pg, header, dst, WEIGHTS_TAG)
                for _, flat in buckets if nccl is None else ():
                    send_tensor(pg, flat, dst, WEIGHTS_TAG)
            except RuntimeError as e:
                gone.add(dst)
                raise RuntimeError(f"rollout rank {plan.global_rank(dst)} is gone ({e})") from e
        for _, flat in buckets if nccl is not None else ():
            remote_nccl.send_bucket(nccl, self._staging, flat, self._check_abandon)
        self.sent_bytes += sum(flat.numel() for _, flat in buckets)

    def _check_abandon(self) -> None:
        if self._abandon is not None:
            raise RuntimeError(f"a weight broadcast was abandoned: {self._abandon}")

    def _run(self) -> None:
        pg, plan = self.bridge.weights, self.bridge.plan
        gone: set[int] = set()
        self._staging = remote_nccl.Staging(self.bridge.device)
        try:
            remote_nccl.use_device(self.bridge.device)
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._pending is not None or self._closing)
                    items, self._pending = self._pending, None
                    self._in_flight = {self._slot_of.get(id(b)) for _, b, _ in items or []}
                if items is None:  # closing, nothing left to send
                    break
                for version, buckets, validate in items:
                    start = time.perf_counter()
                    self._send_version(version, buckets, validate, gone)
                    self.last_send_seconds = time.perf_counter() - start
                    self.sent_versions.append(version)
                    with self._cond:  # its slot may take the next gather
                        self._in_flight.discard(self._slot_of.pop(id(buckets), None))
                        self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 (reported to the trainer's thread by raise_if_failed)
            with self._cond:
                self._error = e
                self._cond.notify_all()  # a gather waiting for a slot
        finally:
            # every rollout rank still there hears STOP, also when sending to another one failed: a rollout rank
            # that waits for weights would otherwise wait for ever (on other nodes nothing else ends it); one in an
            # NCCL broadcast reads it from the store
            reason = self._reason if self._error is None else (self._reason or str(self._error))
            if self.bridge.weights_data is not None and self.bridge.store is not None:
                try:
                    self.bridge.store.set(STOP_KEY, reason or "")
                except Exception as e:  # noqa: BLE001 (the store is gone: the job is ending)
                    self._error = self._error or e
            for dst in range(1, plan.rollout_ranks + 1):
                if dst not in gone:
                    try:
                        send_object(pg, {STOP: reason}, dst, WEIGHTS_TAG)
                    except BaseException as e:  # noqa: BLE001 (that rank is gone too; the others still hear it)
                        if self._error is None:
                            self._error = e

    def close(self, reason: Optional[str] = None, timeout: float = 60.0, wait: bool = True) -> None:
        """Send what is pending (nothing when `reason`, an error, is given), then STOP with `reason` to every
        rollout rank (they finish or abandon their batch and exit); with `wait`, join the sending thread (up to
        `timeout` seconds). A second call only waits (the first reason stays)."""
        if self._thread is None:
            return
        with self._cond:
            if not self._closing:
                self._reason = reason
                if reason is not None:
                    self._pending = None
                    self._abandon = f"the trainer stopped: {reason}"
                self._closing = True
                self._cond.notify_all()
        if wait:
            self._thread.join(timeout=timeout)

    @property
    def thread(self) -> Optional[threading.Thread]:
        return self._thread


GONE_SECONDS = 10.0
"""A rollout rank in an NCCL broadcast calls trainer rank 0 gone when its heartbeat stood still this long."""


