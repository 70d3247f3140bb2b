"""Ctrl-C ends a run within a second or two: one line per rank, exit code 130, no child process left behind.

    interrupt.enable()                                   # cli.parse does it for the trainers' command lines
    interrupt.note(f"in step {k} of {total}")            # where the run is, for the line
    interrupt.note_checkpoint("runs/x/checkpoints/step_000004")

Ctrl-C in a terminal sends SIGINT to every process of the foreground job: torchrun, each rank, and the ranks'
children (vLLM engine processes, a launched retrieval server). Python's default turns it into a KeyboardInterrupt
in each rank's main thread, which unwinds through the trainer's `finally` blocks (closing engines, joining
threads), prints a long traceback, and waits until the main thread is back in Python at all: a rank blocked in
a collective whose peer already left waits for the collective's timeout, and torchrun's 30 s grace then ends in
SIGKILL. Here each rank instead prints

    rank 1: interrupted (Ctrl-C) in step 3 of 200; last checkpoint: runs/x/checkpoints/step_000002

on stderr, ends its child processes (SIGTERM, then SIGKILL after half a second) and leaves with `os._exit(130)`
(128 + SIGINT, the shell's code for a Ctrl-C), running no further Python code. Nothing is lost that a resume
needs: checkpoints are written to a temporary directory and renamed when complete (checkpoint/), so a save cut
short is discarded at the next start, which resumes from the last complete one.

Two paths reach that exit, whichever comes first: the SIGINT handler (main thread, as soon as it runs Python
again), and a watchdog thread woken by the signal itself through `signal.set_wakeup_fd` (the interpreter's C
handler writes the signal number to a pipe at once), which exits for the main thread when it is stuck in a C call
or a collective. The watchdog needs a C call that releases the GIL, as torch's collectives and kernels do.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Optional

EXIT_CODE = 128 + signal.SIGINT
"""Exit code of an interrupted rank (130, what a shell reports for a process ended by Ctrl-C)."""

HANDLER_GRACE = 1.0
"""Seconds the watchdog leaves the main thread's handler to exit before it exits itself."""

CHILD_GRACE = 0.5
"""Seconds child processes get between SIGTERM and SIGKILL."""

_where = "during start-up"
_checkpoint: Optional[str] = None
_exiting = threading.Lock()
_enabled = False


def note(where: str) -> None:
    """Where the run is now, as the interrupt line says it: "in step 3 of 200", "in validation"."""
    global _where
    _where = where


def note_checkpoint(path: Optional[str]) -> None:
    """The last complete checkpoint (a resume starts there), named by the interrupt line."""
    global _checkpoint
    _checkpoint = path


def message() -> str:
    """The line an interrupted rank prints."""
    rank = os.environ.get("RANK", "0")
    return (f"rank {rank}: interrupted (Ctrl-C) {_where}; last checkpoint: "
            f"{_checkpoint or 'none saved yet'}")


def exiting() -> bool:
    """Whether this process is leaving through the interrupt exit (another exit path then stays out of its way)."""
    return _exiting.locked()


def enable() -> bool:
    """Handle SIGINT as the module docstring says, in this process from now on; idempotent (a second call
    re-installs the handler if a library replaced it). Only the main thread can install signal handlers: called
    from another thread it does nothing and returns False."""
    global _enabled
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGINT, _on_sigint)
    if _enabled:
        return True
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    if previous != -1:  # someone else's wakeup pipe (an event loop): keep theirs, rely on the handler alone
        signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
    else:
        threading.Thread(target=_watch, args=(read_fd,), name="ctrl-c-watchdog", daemon=True).start()
    _enabled = True
    return True


def reassert() -> None:
    """Install the handler again if `enable()` ran before (a library built since may have replaced it)."""
    if _enabled:
        enable()


def _on_sigint(signum, frame) -> None:
    exit_now()


def _watch(read_fd: int) -> None:
    """The watchdog: wait for a SIGINT byte on the wakeup pipe, give the main thread's handler HANDLER_GRACE
    seconds, then exit for it."""
    while True:
        try:
            data = os.read(read_fd, 512)
        except InterruptedError:
            continue
        if not data:
            return
        if signal.SIGINT in data:
            time.sleep(HANDLER_GRACE)
            exit_now()


def exit_now() -> None:
    """Print the interrupt line, end every child process, `os._exit(EXIT_CODE)`. Whoever comes second (handler or
    watchdog) waits here until the process is gone."""
    if not _exiting.acquire(blocking=False):
        while True:  # the other path is exiting; os._exit ends this thread too
            time.sleep(1)
    try:
        sys.stderr.write(message() + "\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - a closed stderr must not keep the process alive
        pass
    try:
        end_children()
    finally:
        os._exit(EXIT_CODE)


def descendants(pid: Optional[int] = None) -> list[int]:
    """Pids of every process below `pid` (default: this one), children first, read from /proc (Linux; elsewhere
    an empty list)."""
    pid = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])  # the name field may hold spaces and parentheses
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(0), ()):
            out.append(child)
            todo.append(child)
    return out


def end_children(grace: float = CHILD_GRACE) -> None:
    """SIGTERM every descendant of this process, SIGKILL those still there after `grace` seconds."""
    pids = descendants()
    for pid in pids:
        _kill(pid, signal.SIGTERM)
    deadline = time.time() + grace
    while time.time() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    for pid in pids + descendants():  # and any process started meanwhile
        _kill(pid, signal.SIGKILL)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def _alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie our dead rank would never reap counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2:][:1] != b"Z"
