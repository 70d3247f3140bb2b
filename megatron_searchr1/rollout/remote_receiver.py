"""The rollout side of the weight bridge (rollout/remote_sync.py's module doc): a thread on each rollout rank receives
every version trainer rank 0 sends, into one of two reused host buffers (rollout/host_slots.py), and the rank's main
thread loads the newest into its engine between generate calls.

    receiver = WeightReceiver(bridge)                    # starts the receiving thread
    receiver.wait_for(version=2, serve=validate_due)     # blocks; validations due meanwhile are served
    receiver.apply(engine, inspect=check)                # the newest version, if newer than the engine's
    due = receiver.take_due(); receiver.load_due(engine, due)   # a version the trainer asked to validate
    receiver.close(timeout=60)                           # every exit path: the thread ends and is joined

A rollout rank must not leave this thread running when it exits: a daemon thread that comes back from a blocking
C++ call (a gloo receive) while the interpreter finalises is ended with a forced unwind through C++ frames, and the
process dies with SIGABRT ("terminate called without an active exception") instead of its exit code.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

from megatron_searchr1.rollout import remote_nccl
from megatron_searchr1.rollout import remote_sync as rs
from megatron_searchr1.rollout.host_slots import HostSlots, Version
from megatron_searchr1.rollout.weight_sync import unpack_bucket


class WeightReceiver:
    """The rollout side of the weights: a thread receives every version trainer rank 0 sends and keeps the newest
    in one of two reused host buffers (pinned on GPUs: rollout/host_slots.py); the main thread loads it into its
    engine between generate calls (`apply`), so the engine is never touched from two threads. `close()` ends and
    joins the thread (every exit path of a rollout rank calls it)."""

    def __init__(self, bridge: "rs.Bridge"):
        self.bridge = bridge
        self._cond = threading.Condition()
        self.slots = HostSlots(bridge.device, alloc=lambda n, device: rs.host_buffer(n, device))
        self._latest: Optional[Version] = None
        self._newest = -1  # the newest version received whole (kept when its slot is reused)
        self._error: Optional[str] = None
        self._closing = False
        self.stopped = False
        self.stop_reason: Optional[str] = None
        """Why the trainer stopped, when an error stopped it (STOP's reason)."""
        self.applied_version = -1
        self.due: list[Version] = []
        """Versions the trainer asked this rank to validate, oldest first (their slots are not reused until each is
        taken and loaded: the trainer waits for every report it asked for)."""
        self.received_bytes = 0
        self.engine_ready = threading.Event()
        """Set once the engine is built: the NCCL path makes its communicator and staging buffer after that, not
        while vLLM measures the GPU memory it may take."""
        self._beat = (-1, time.monotonic())  # trainer rank 0's heartbeat counter, and when it last moved
        self._thread = bridge.own(threading.Thread(target=self._run, name="weight-receiver", daemon=True),
                                  lambda: self.close(timeout=0.0))
        self._thread.start()

    def _stop(self, reason: Optional[str]) -> None:
        with self._cond:
            self.stop_reason = reason
            self.stopped = True
            self._cond.notify_all()

    def _check_trainer(self) -> None:
        """While in an NCCL broadcast: raise when trainer rank 0 said STOP (in the store) or its heartbeat stood
        still for GONE_SECONDS, or this rank is closing."""
        if self._closing:
            raise remote_nccl.StoppedInBroadcast(None)
        store = self.bridge.store
        if store is None:
            return
        if store.check([rs.STOP_KEY]):
            raise remote_nccl.StoppedInBroadcast(store.get(rs.STOP_KEY).decode() or None)
        (beat, done), now = rs.heartbeat_counts(rs.heartbeat_store(store), [0])[0], time.monotonic()
        if beat != self._beat[0]:
            self._beat = (beat, now)
        elif now - self._beat[1] > rs.GONE_SECONDS and not done:
            raise remote_nccl.TrainerSilent(f"its heartbeat stood still for {rs.GONE_SECONDS:.0f} s during a weight "
                                            "broadcast")

    def _slot_for(self, layouts) -> Optional[tuple[int, list]]:
        """A slot to receive the next version into, and its bucket views; waits while both slots are needed (host
        slots' rule). None when the receiver is closing."""
        with self._cond:
            self._cond.wait_for(lambda: self._closing or self.slots.pick(self._slot_of_latest()) is not None)
            if self._closing:
                return None
            slot = self.slots.pick(self._slot_of_latest())
            if self._latest is not None and self._latest.slot == slot:
                self._latest = None  # superseded by the version arriving; its slot is about to be overwritten
            self.slots.holds[slot] += 1  # the receiving thread's own hold while it writes
        return slot, self.slots.fill(slot, layouts)

    def _slot_of_latest(self) -> Optional[int]:
        return None if self._latest is None else self._latest.slot

    def _run(self) -> None:
        pg, nccl = self.bridge.weights, self.bridge.weights_data
        staging = remote_nccl.Staging(self.bridge.device)
        try:
            remote_nccl.use_device(self.bridge.device)
            while True:
                header = rs.recv_object(pg, 0, rs.WEIGHTS_TAG)
                if rs.is_stop(header):
                    return self._stop(header[rs.STOP])
                got = self._slot_for(header["layouts"])
                if got is None:
                    return
                slot, buckets = got
                try:
                    for _, flat in buckets:
                        if nccl is None:
                            pg.recv([flat], 0, rs.WEIGHTS_TAG).wait()
                        else:  # the broadcast trainer rank 0 issues for this bucket, then to host memory
                            self.engine_ready.wait()
                            remote_nccl.receive_bucket(nccl, staging, flat, self._check_trainer)
                finally:
                    with self._cond:
                        self.slots.holds[slot] -= 1
                with self._cond:
                    self._latest = Version(int(header["version"]), buckets, slot)
                    self._newest = max(self._newest, self._latest.version)
                    if header.get("validate"):
                        self.due.append(self._latest)
                        self.slots.due[slot] += 1
                    self.received_bytes += sum(lay.nbytes for lay, _ in buckets)
                    self._cond.notify_all()
        except remote_nccl.StoppedInBroadcast as e:  # the version in flight is dropped; the run is over
            self._stop(e.reason)
        except BaseException as e:  # noqa: BLE001 (the main thread raises it)
            with self._cond:
                self._error = str(e) if isinstance(e, remote_nccl.LocalFailure) else \
                    f"trainer rank 0 is gone ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                self._cond.notify_all()

    @property
    def latest_version(self) -> int:
        with self._cond:
            return self._newest

    def wait_for(self, version: int, timeout: Optional[float] = None,
                 serve: Optional[Callable[[], None]] = None) -> bool:
        """Block until a version >= `version` has arrived (True) or the trainer said STOP (False); raises
        RuntimeError when the trainer's side is gone, TimeoutError after `timeout` seconds. `serve` (the rank's
        validate_due) is called whenever a validation is due meanwhile: a due version holds its slot, so the next
        version may be waiting for it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                ok = self._cond.wait_for(lambda: self._newest >= version or self.stopped or self._error
                                         or (serve is not None and bool(self.due)), timeout=left)
                if self._error:
                    raise RuntimeError(self._error)
                if self._newest >= version or self.stopped:
                    return not (self.stopped and self._newest < version)
                if not ok:
                    raise TimeoutError(f"no policy version >= {version} from the trainer within {timeout} s")
            serve()

    def apply(self, engine, inspect: Optional[Callable[[list], Any]] = None) -> Optional[tuple[int, Any]]:
        """Load the newest received version into `engine` if it is newer than the one applied: one load_weights
        call per bucket, then finish_weight_sync. Returns (version, inspect(pairs)) (pairs: the (name, tensor) pairs
        loaded, views into the slot, valid only during `inspect`), None when there was nothing new."""
        with self._cond:
            latest = self._latest
            if latest is None or latest.version <= self.applied_version:
                return None
            self.slots.holds[latest.slot] += 1
        try:
            pairs = self.load(engine, latest.version, latest.buckets)
            return latest.version, (inspect(pairs) if inspect is not None else None)
        finally:
            self._release(latest.slot)

    def _release(self, slot: int) -> None:
        with self._cond:
            self.slots.holds[slot] -= 1
            self._cond.notify_all()

    def take_due(self) -> Optional[Version]:
        """The oldest version to validate, if one is due; its slot stays held until `load_due` (or `release_due`)."""
        with self._cond:
            if not self.due:
                return None
            due = self.due.pop(0)
            self.slots.due[due.slot] -= 1
            self.slots.holds[due.slot] += 1
            return due

    def load_due(self, engine, due: Version) -> None:
        """Load a version taken with take_due into `engine` (unless the engine holds it already); frees its slot."""
        try:
            if self.applied_version != due.version:
                self.load(engine, due.version, due.buckets)
        finally:
            self._release(due.slot)

    def release_due(self, due: Version) -> None:
        """Free the slot of a version taken with take_due without loading it."""
        self._release(due.slot)

    def wait_due_or_stop(self) -> None:
        """Block until a validation is due or the trainer says STOP; raises when the trainer's side is gone."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self.due) or self.stopped or self._error)
            if self._error and not self.stopped:
                raise RuntimeError(self._error)

    def load(self, engine, version: int, buckets: list) -> list:
        """Load `buckets` (of `version`) into `engine`: one load_weights call per bucket, then finish_weight_sync.
        Returns the (name, tensor) pairs loaded (views into the buckets). The caller holds their slot."""
        pairs = []
        for layout, flat in buckets:
            bucket = unpack_bucket(flat, layout)
            engine.load_weights(iter(bucket))
            pairs.extend(bucket)
        engine.finish_weight_sync()
        self.applied_version = version
        return pairs

    def wait_stop(self, timeout: Optional[float] = None) -> None:
        """Block until the trainer says STOP (the run's end); raises when the trainer's side is gone."""
        with self._cond:
            self._cond.wait_for(lambda: self.stopped or self._error, timeout=timeout)
            if self._error and not self.stopped:
                raise RuntimeError(self._error)

    def close(self, timeout: float) -> bool:
        """End the receiving thread and join it (up to `timeout` seconds); True when it ended. A thread waiting for
        a slot or in an NCCL broadcast ends at once; one in a gloo receive ends when trainer rank 0 sends STOP (it
        does once it hears this rank's error or DONE) or its connection closes."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout=timeout)
        return not self._thread.is_alive()
