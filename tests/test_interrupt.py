"""megatron_searchr1/interrupt.py: Ctrl-C (SIGINT) ends the process in about a second with exactly one line and exit
code 130, and takes its child processes (and theirs) with it, whether the main thread is in Python (the handler
exits) or stuck in a C call (the watchdog thread exits for it)."""
import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_searchr1.interrupt import _alive, descendants
from tests.dist_utils import REPO

SCRIPT = """
import ctypes, signal, subprocess, sys, time
from megatron_searchr1 import interrupt
interrupt.enable()
interrupt.note("in step 3 of 10")
interrupt.note_checkpoint("/runs/x/checkpoints/step_000002")
child = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60"])  # a child with a grandchild
time.sleep(0.3)
print("READY", flush=True)
if sys.argv[1] == "python":
    time.sleep(60)                                # the handler runs as soon as the signal arrives
else:
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])  # the main thread never sees it: only the watchdog
    ctypes.CDLL(None).sleep(60)                   # a C call that does not return, GIL released
print("NOT INTERRUPTED", flush=True)
"""


@pytest.mark.parametrize("main_thread", ["python", "stuck_in_c"])
def test_ctrl_c_is_one_line_exit_130_and_no_children_left(main_thread):
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, main_thread], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO), "RANK": "1"})
    try:
        assert proc.stdout.readline() == "READY\n"
        below = descendants(proc.pid)
        assert len(below) >= 2, below  # sh and its sleeps
        t0 = time.time()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=10)
        seconds = time.time() - t0
    finally:
        proc.kill()
    assert proc.returncode == 130, (out, err)
    assert err == ("rank 1: interrupted (Ctrl-C) in step 3 of 10; last checkpoint: /runs/x/checkpoints/step_000002"
                   "\n"), err
    assert "NOT INTERRUPTED" not in out
    # the handler: at once, children's SIGTERM grace included; the watchdog: after its 1 s grace for the handler
    assert seconds < (1.5 if main_thread == "python" else 2.5) + 1.0, seconds
    time.sleep(0.2)
    assert not [p for p in below if _alive(p)], "children outlived the interrupted process"


def test_without_a_note_the_line_says_start_up():
    code = ("import os, signal, time\nfrom megatron_searchr1 import interrupt\ninterrupt.enable()\n"
            "os.kill(os.getpid(), signal.SIGINT)\ntime.sleep(30)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30,
                          env={**{k: v for k, v in os.environ.items() if k != "RANK"}, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 130
    assert proc.stderr == "rank 0: interrupted (Ctrl-C) during start-up; last checkpoint: none saved yet\n"
