"""Run the retrieval server as a child process and know its URL: what the CPU demo, tests and benchmarks use.

    with ServerProcess(["--index-dir", "data/synthetic/index_bm25"]) as server:
        client = RetrievalClient(server.url)

The child is `python -m megatron_searchr1.search.server --port 0 ...`: it picks a free port and prints
"Retrieval server listening on http://HOST:PORT ..." once its batcher runs, so the URL we return is ready to serve.
Stopping sends SIGINT (uvicorn shuts down gracefully) and kills it if it does not exit in time.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

_READY = "listening on http://"


class ServerProcess:
    """A retrieval server child process; `url` is its base URL once `start()` (or `with`) returns."""

    def __init__(self, args: list[str], env: dict | None = None, start_timeout: float = 180.0):
        self.args = list(args)
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.output: list[str] = []  # what the child printed up to the ready line, then on stop

    def start(self) -> "ServerProcess":
        cmd = [sys.executable, "-m", "megatron_searchr1.search.server", "--port", "0", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env)
        deadline = time.time() + self.start_timeout
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:  # the child exited before it was ready
                break
            self.output.append(line)
            if _READY in line:
                self.url = line.split("listening on ")[1].split()[0]
                return self
        self.proc.kill()
        rest, _ = self.proc.communicate()
        raise RuntimeError(f"retrieval server did not start ({' '.join(cmd)}):\n{''.join(self.output)}{rest or ''}")

    def stop(self, timeout: float = 30.0) -> int:
        """SIGINT, wait, kill if needed; returns the exit code (0 for a clean shutdown)."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGINT)
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        self.output.append(out or "")
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
