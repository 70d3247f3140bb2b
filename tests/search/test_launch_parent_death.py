"""A retrieval server started by ServerProcess dies with the process that started it, also when that process is
SIGKILLed (no clean-up of its own runs): the kernel's parent-death signal, set in search/launch.py."""
import os
import signal
import subprocess
import sys
import time

from megatron_searchr1.interrupt import _alive
from tests.dist_utils import REPO

PARENT = """
import sys, time
from megatron_searchr1.search.launch import ServerProcess
server = ServerProcess(["--index-dir", sys.argv[1]]).start()
print("SERVER", server.proc.pid, server.url, flush=True)
time.sleep(600)
"""


def test_a_sigkilled_parent_leaves_no_server(bm25_index):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, bm25_index[0]], cwd=REPO, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        line = parent.stdout.readline()
        assert line.startswith("SERVER "), line
        server_pid = int(line.split()[1])
        assert _alive(server_pid)
        parent.kill()
        parent.wait()
        t0 = time.time()
        while _alive(server_pid) and time.time() - t0 < 5:
            time.sleep(0.05)
        assert not _alive(server_pid), f"the server {server_pid} outlived its parent by 5 s"
    finally:
        parent.kill()
        if "server_pid" in locals() and _alive(server_pid):
            os.kill(server_pid, signal.SIGKILL)


def test_a_server_whose_parent_is_already_gone_does_not_start(bm25_index):
    """PARENT_PID is not our parent (it died between the fork and the parent-death request): exit at once."""
    proc = subprocess.run([sys.executable, "-m", "megatron_searchr1.search.launch", "1", "--index-dir",
                           bm25_index[0], "--port", "0"], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 1 and "parent process 1 is gone" in proc.stderr, proc.stderr
    assert "listening" not in proc.stdout
