"""Run the retrieval server as a child process and know its URL: what the CPU demo, tests and benchmarks use.

    with ServerProcess(["--index-dir", "data/synthetic/index_bm25"]) as server:
        client = RetrievalClient(server.url)

The child is `python -m megatron_searchr1.search.server --port 0 ...`: it picks a free port and prints
"Retrieval server listening on http://HOST:PORT ..." once its batcher runs, so the URL we return is ready to serve.
Stopping sends SIGINT (uvicorn shuts down gracefully) and kills it if it does not exit in time.
A reader thread drains the child's output for its whole life: a pipe nobody reads fills after ~64 KB of log
lines and then blocks the server on its next write. The last lines are kept in `output` for error messages.
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


class ServerProcess:
    """A retrieval server child process; `url` is its base URL once `start()` (or `with`) returns."""

    def __init__(self, args: list[str], env: dict | None = None, start_timeout: float = 180.0):
        self.args = list(args)
        # One OpenMP thread unless the caller's environment says otherwise: the server shares cores with training.
        self.env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.output: collections.deque[str] = collections.deque(maxlen=2000)  # the child's last output lines
        self._lines: queue.Queue[str | None] = queue.Queue()  # lines until the ready one (None: output closed)
        self._ready = False
        self._reader: threading.Thread | None = None

    def start(self) -> "ServerProcess":
        cmd = [sys.executable, "-m", "megatron_searchr1.search.server", "--port", "0", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env)
        self._reader = threading.Thread(target=self._drain, name="retrieval-server-output", daemon=True)
        self._reader.start()
        deadline = time.time() + self.start_timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.time()))
            except queue.Empty:
                break  # start_timeout passed
            if line is None:  # the child exited before it was ready
                break
            if _READY in line:
                self.url = line.split("listening on ")[1].split()[0]
                return self
        self.proc.kill()
        self.proc.wait()
        raise RuntimeError(f"retrieval server did not start within {self.start_timeout:.0f}s "
                           f"({' '.join(cmd)}):\n{''.join(self.output)}")

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
