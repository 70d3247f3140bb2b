"""Run the retrieval server as a child process and know its URL: what the CPU demo, tests and benchmarks use.

    with ServerProcess(["--index-dir", "data/synthetic/index_bm25"]) as server:
        client = RetrievalClient(server.url)

The child is `python -m megatron_searchr1.search.launch PARENT_PID --port 0 ...`, which runs the server's main:
it picks a free port and prints "Retrieval server listening on http://HOST:PORT ..." once its batcher runs, so the
URL we return is ready to serve. Stopping sends SIGINT (uvicorn shuts down gracefully) and kills it if it does not
exit in time.

The child dies with its parent, however the parent dies: before anything else it asks the kernel for SIGKILL when
its parent goes (Linux PR_SET_PDEATHSIG; a SIGKILLed or OOM-killed trainer rank runs no clean-up of its own, and a
server holding a 65 GB index must not outlive it), then checks that PARENT_PID is still its parent (it may have
died before the request). The kernel sends the signal when the parent *thread* that started the child ends, so
start it from the main thread (the trainer does) or from a thread that lives as long as the server should.
A reader thread drains the child's output for its whole life: a pipe nobody reads fills after ~64 KB of log
lines and then blocks the server on its next write. The last lines are kept in `output` for error messages.

Threads: torchrun sets OMP_NUM_THREADS=1 for its workers, and a server started from a trainer rank would inherit it.
The server sets torch's and faiss's thread counts itself (--torch-threads, default every core), but OpenMP reads
OMP_NUM_THREADS once per thread it did not start: faiss searches on the server's worker thread, whose OpenMP
default stays the inherited 1 whatever the main thread set (libgomp keeps omp_set_num_threads per thread). So the
child gets OMP_NUM_THREADS = its --torch-threads budget when the arguments give one, else every core this process
may use; `env={"OMP_NUM_THREADS": ...}` overrides both.

Start time: reading wiki-18's e5_Flat.index (21M x 768 float32 = 65 GB) into RAM takes minutes (~2 at 500 MB/s from
a local SSD, ~10 at 110 MB/s from network storage), so the default wait is 15 minutes (DEFAULT_START_TIMEOUT).
"""
from __future__ import annotations

import collections
import os
import queue
import signal
import subprocess
import sys
import threading
import time

_READY = "listening on http://"

DEFAULT_START_TIMEOUT = 900.0
"""Seconds to wait for "listening on": wiki-18's 65 GB e5_Flat.index read at >= ~75 MB/s, and well under the
default collective timeout (parallel.timeout_minutes = 30) the other ranks wait in for the server's URL."""


def server_threads(args: list[str]) -> int:
    """The CPU threads the server will use: its --torch-threads value (0 or absent = every core we may use)."""
    from megatron_searchr1.search.encoder import available_cores

    n = 0
    for i, a in enumerate(args):
        if a == "--torch-threads" and i + 1 < len(args):
            n = int(args[i + 1])
        elif a.startswith("--torch-threads="):
            n = int(a.split("=", 1)[1])
    return n if n > 0 else available_cores()


def server_env(args: list[str], env: dict | None = None, base: dict | None = None) -> dict:
    """The child's environment: `base` (default os.environ) with OMP_NUM_THREADS = server_threads(args), never the
    1 torchrun gives its workers; then `env` on top (a caller's explicit OMP_NUM_THREADS wins)."""
    base = dict(os.environ if base is None else base)
    return {**base, "OMP_NUM_THREADS": str(server_threads(args)), "PYTHONUNBUFFERED": "1", **(env or {})}


class ServerProcess:
    """A retrieval server child process; `url` is its base URL once `start()` (or `with`) returns."""

    def __init__(self, args: list[str], env: dict | None = None, start_timeout: float = DEFAULT_START_TIMEOUT,
                 timeout_hint: str = "pass a larger start_timeout"):
        """timeout_hint: what the error says to do when start_timeout passes (the trainer names its config field)."""
        self.args = list(args)
        self.env = server_env(self.args, env)
        self.timeout_hint = timeout_hint
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.output: collections.deque[str] = collections.deque(maxlen=2000)  # the child's last output lines
        self._lines: queue.Queue[str | None] = queue.Queue()  # lines until the ready one (None: output closed)
        self._ready = False
        self._reader: threading.Thread | None = None

    def start(self) -> "ServerProcess":
        cmd = [sys.executable, "-m", "megatron_searchr1.search.launch", str(os.getpid()), "--port", "0", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env)
        self._reader = threading.Thread(target=self._drain, name="retrieval-server-output", daemon=True)
        self._reader.start()
        deadline = time.time() + self.start_timeout
        exited = False
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.time()))
            except queue.Empty:
                break  # start_timeout passed
            if line is None:  # the child exited before it was ready
                exited = True
                break
            if _READY in line:
                self.url = line.split("listening on ")[1].split()[0]
                return self
        self.proc.kill()
        code = self.proc.wait()
        if exited:
            why = f"it exited with code {code} before it was ready"
        else:
            why = (f"it was still loading after {self.start_timeout:g}s (a large index, e.g. wiki-18's 65 GB "
                   f"e5_Flat.index, can take minutes to read): {self.timeout_hint}")
        raise RuntimeError(f"retrieval server did not start: {why} ({' '.join(cmd)}):\n{''.join(self.output)}")

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)
            if not self._ready:
                self._lines.put(line)
                self._ready = _READY in line
        self._lines.put(None)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGINT, wait, kill if needed; returns the exit code (0 for a clean shutdown)."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=5)  # the pipe is closed now: the reader takes the last lines and ends
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _run_tied_to_parent(argv: list[str]) -> int:
    """`python -m megatron_searchr1.search.launch PARENT_PID SERVER_ARGS...`: the server's main, in a process the
    kernel kills when PARENT_PID (its parent) dies."""
    from megatron_searchr1.cli import run_main
    from megatron_searchr1.processes import die_with_parent
    from megatron_searchr1.search.server import main

    die_with_parent(signal.SIGKILL)
    if os.getppid() != int(argv[0]):  # the parent died before the request: nobody would stop this server
        print(f"error: parent process {argv[0]} is gone: not starting the retrieval server", file=sys.stderr)
        return 1
    return run_main(main, argv[1:])


if __name__ == "__main__":
    sys.exit(_run_tied_to_parent(sys.argv[1:]))
