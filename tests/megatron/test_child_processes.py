"""A SIGKILLed rank leaves no helper process behind: Megatron's checkpoint writer starts a multiprocessing manager
at the first save, and nothing would end it when its rank is killed."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.dist_utils import REPO

PROBE = '''
import sys, time
if __name__ == "__main__":
    tie = sys.argv[1] == "tie"
    from megatron_searchr1.megatron import child_processes
    if tie:
        assert child_processes.tie_checkpoint_writer_to_rank()
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa
    q = fsa._get_write_results_queue()  # what FileSystemWriterAsync calls at a save
    q.put("ok"); assert q.get() == "ok"
    print("ready", flush=True)
    time.sleep(600)
'''


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _manager_after_kill(tmp_path, mode: str) -> tuple[int, bool]:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    proc = subprocess.Popen([sys.executable, str(script), mode], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        assert proc.stdout.readline().strip() == "ready"
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            children = [int(c) for c in f.read().split()]
        # the manager's server process; the spawn context's resource tracker is the other child (it leaves by
        # itself when its pipe closes)
        children = [c for c in children if b"resource_tracker" not in open(f"/proc/{c}/cmdline", "rb").read()]
        assert len(children) == 1, children
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 10
    while _alive(children[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return children[0], _alive(children[0])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_the_checkpoint_writers_manager_dies_with_a_killed_rank(tmp_path):
    pid, alive = _manager_after_kill(tmp_path, "tie")
    assert not alive, f"manager {pid} outlived its SIGKILLed rank"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_megatrons_own_manager_outlives_a_killed_rank(tmp_path):
    """The control: untied, the same probe leaves the manager running (so the test above can see an orphan)."""
    pid, alive = _manager_after_kill(tmp_path, "plain")
    try:
        assert alive
    finally:
        if alive:
            os.kill(pid, signal.SIGKILL)


def test_initialize_megatron_ties_the_writer(tmp_path):
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa

    from megatron_searchr1.megatron import child_processes
    from megatron_searchr1.megatron.initialize import destroy_megatron, initialize_megatron

    original = fsa._get_write_results_queue
    try:
        initialize_megatron(tp=1, pp=1)
        assert fsa._get_write_results_queue is child_processes._write_results_queue
    finally:
        destroy_megatron()
        fsa._get_write_results_queue = original
