"""How a rank of a disaggregated run ends when it does not end cleanly (trainer/async_rl.py): one line that names what
is gone, the rank's bridge threads stopped and joined, its exit code; and a watchdog and a SIGTERM handler that end it
the same way when another rank failed or died.

    exit = Exit(bridge, heartbeat); exit.watch()       # run_disaggregated, once the role world is joined
    exit.leave(1, stopping_line(bridge, heartbeat, e))  # a failure: one line, threads joined, os._exit(1)
    exit.done()                                         # a clean end: the watchdog stops
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Optional

from megatron_searchr1 import interrupt
from megatron_searchr1.cli import stderr_line
from megatron_searchr1.rollout.remote_sync import Bridge, Heartbeat, name_ranks


WATCH_SILENT_SECONDS = 60.0
"""A rank whose heartbeat stood still this long (and which did not say done or fail) is gone for Exit's watchdog.
Generous on purpose: a main thread may hold the GIL for seconds (a big unpickle, a compile), starving its heartbeat;
a dead peer is usually found sooner by the collective or channel that fails."""

WATCH_GRACE_SECONDS = 5.0
"""How long the watchdog leaves the ordinary path (a channel that fails, a STOP) to end this rank after a peer said
it failed, before it ends the rank itself."""

JOIN_SECONDS = 10.0
"""How long a leaving rank waits for its bridge threads to end, all together (within torchrun's 30 s grace)."""


class Exit:
    """How a rank of a disaggregated run ends when it does not end cleanly: one line on stderr, its reason left in
    torchrun's store for the other ranks (Heartbeat.fail), its threads stopped and joined, then `os._exit(code)`.

    Why os._exit and not the interpreter's own exit: a thread still inside a blocking C++ call when the interpreter
    finalises (a gloo receive whose peer answers late, a library's worker) is torn down by a forced unwind, and the
    process dies with SIGABRT ("terminate called without an active exception") instead of its exit code; after the
    rank's own threads are joined nothing left needs the interpreter's teardown (logs are closed by then).

    Two more ways in, each ending with the same one line: a watchdog thread (`watch`) that ends this rank when
    another rank left its reason in the store (after WATCH_GRACE_SECONDS, if nothing else ended it) or stopped
    beating for WATCH_SILENT_SECONDS, which bounds what a dead rank on another node costs (a collective would wait
    `parallel.timeout_minutes`, 30 by default); and SIGTERM, which torchrun sends every rank of a node once one of them
    died: the rank names the ranks that are gone (heartbeats) and exits 143."""

    def __init__(self, bridge: Bridge, heartbeat: Heartbeat):
        self.bridge, self.heartbeat = bridge, heartbeat
        self.me = f"rank {bridge.rank} ({bridge.role})"
        self._leaving = threading.Lock()
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def leave(self, code: int, line: str):
        """Print `line`, tell the other ranks, stop and join this rank's bridge threads, exit with `code` (class
        doc). Whoever comes second (main thread, watchdog, SIGTERM) waits here until the process is gone."""
        if not self._leaving.acquire(blocking=False):
            while True:
                time.sleep(1)
        try:
            stderr_line(line)
            self.heartbeat.fail(line)
            self.heartbeat.stop()
            self.bridge.stop_threads(JOIN_SECONDS)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def done(self) -> None:
        """The rank ends cleanly: the watchdog stops and is joined (it may be in a store call: a thread left there
        when the interpreter finalises aborts the process, class doc)."""
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=JOIN_SECONDS)

    def watch(self) -> None:
        """Start the watchdog thread and, from the main thread, the SIGTERM handler (class doc)."""
        self._thread = threading.Thread(target=self._watch, name="peer-watchdog", daemon=True)
        self._thread.start()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        if interrupt.exiting() or self._done.is_set():
            return
        gone = self.heartbeat.gone(range(self.bridge.plan.world), wait=2.5)
        what = f"{name_ranks(self.bridge.plan, gone)} {'is' if len(gone) == 1 else 'are'} gone" if gone else \
            "no other rank is gone"
        self.leave(128 + signal.SIGTERM, f"{self.me}: {what}; stopping (torchrun ended the job: SIGTERM)")

    def _watch(self) -> None:
        plan, ranks = self.bridge.plan, range(self.bridge.plan.world)
        seen: dict[int, tuple[int, float]] = {}  # rank -> (its counter, when it last moved)
        failed_at: Optional[float] = None
        while not self._done.wait(1.0):
            try:
                failures = self.heartbeat.failures(ranks)
                counts = self.heartbeat.counts([r for r in ranks if r != self.bridge.rank])
            except Exception:  # noqa: BLE001 (the store is gone: torchrun's agent ended; nothing to name)
                return
            now = time.monotonic()
            if failures:
                failed_at = failed_at or now
                if now - failed_at >= WATCH_GRACE_SECONDS:
                    r = min(failures)
                    self.leave(1, f"{self.me}: {name_ranks(plan, [r])} failed; stopping ({failures[r]})")
                continue
            silent = []
            for r, (beat, done) in counts.items():
                if beat != seen.get(r, (None, 0.0))[0]:
                    seen[r] = (beat, now)
                elif beat > 0 and not done and now - seen[r][1] >= WATCH_SILENT_SECONDS:
                    silent.append(r)
            if silent:
                self.leave(1, f"{self.me}: {name_ranks(plan, silent)} {'is' if len(silent) == 1 else 'are'} gone "
                              f"(no heartbeat for {WATCH_SILENT_SECONDS:.0f} s); stopping")


def stopping_line(bridge: Bridge, heartbeat: Heartbeat, error: BaseException) -> str:
    """One line for the failure `error` on this rank, naming the ranks that are gone when there are any
    (heartbeats; found once, kept on the error)."""
    if getattr(error, "stopping_line", None):
        return error.stopping_line
    me = f"rank {bridge.rank} ({bridge.role})"
    text = str(error).splitlines()[0] if str(error) else ""
    gone = heartbeat.gone(range(bridge.plan.world))
    line = (f"{me}: {name_ranks(bridge.plan, gone)} {'is' if len(gone) == 1 else 'are'} gone; stopping "
            f"({type(error).__name__}: {text})" if gone else f"{me}: stopping on {type(error).__name__}: {text}")
    try:
        error.stopping_line = line
    except AttributeError:
        pass
    return line
