"""ServerProcess without a real server: the environment and command its child gets, and what it says when the
child is not ready in time. A recording Popen stands in for the child."""
import os
import threading

import pytest

from megatron_searchr1.config import ConfigError, load_config
from megatron_searchr1.search import launch
from megatron_searchr1.search.encoder import available_cores
from megatron_searchr1.search.launch import ServerProcess


class FakeChild:
    """Popen double: prints `lines`, then (hang=True) blocks like a server still loading, until killed."""

    def __init__(self, lines, hang=False, code=0):
        self.lines, self.hang, self.code = lines, hang, code
        self.killed = threading.Event()
        self.returncode = None
        self.stdout = self._out()

    def _out(self):
        yield from self.lines
        if self.hang:
            self.killed.wait(30)

    def kill(self):
        self.killed.set()
        self.returncode = -9 if self.hang else self.code

    def wait(self, timeout=None):
        if self.returncode is None:
            self.returncode = self.code
        return self.returncode

    def poll(self):
        return self.returncode

    def send_signal(self, sig):
        self.kill()


@pytest.fixture
def popen(monkeypatch):
    """Replaces subprocess.Popen in launch.py; `calls` records (cmd, kwargs); `child` sets what the child does."""
    state = {"calls": [], "child": lambda: FakeChild(["Retrieval server listening on http://127.0.0.1:4321 (POST)\n"])}

    def fake(cmd, **kwargs):
        state["calls"].append((cmd, kwargs))
        return state["child"]()

    monkeypatch.setattr(launch.subprocess, "Popen", fake)
    return state


def test_the_server_does_not_inherit_torchruns_single_openmp_thread(popen, monkeypatch):
    """torchrun exports OMP_NUM_THREADS=1; faiss searches on the server's worker thread, where OpenMP's default is
    that inherited 1 whatever the main thread sets, so the child must get a real thread count."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("SOME_USER_VAR", "kept")
    with ServerProcess(["--index-dir", "IDX"]) as server:
        assert server.url == "http://127.0.0.1:4321"
    cmd, kwargs = popen["calls"][0]
    assert cmd[1:] == ["-m", "megatron_searchr1.search.launch", str(os.getpid()), "--port", "0", "--index-dir", "IDX"]
    env = kwargs["env"]
    assert env["OMP_NUM_THREADS"] == str(available_cores())  # every core, as the server's own default
    assert env["SOME_USER_VAR"] == "kept" and env["PYTHONUNBUFFERED"] == "1"


@pytest.mark.parametrize("args, env, expected", [
    (["--index-dir", "IDX", "--torch-threads", "3"], None, "3"),  # the server's thread budget
    (["--index-dir", "IDX", "--torch-threads=2"], None, "2"),
    (["--index-dir", "IDX", "--torch-threads", "0"], None, None),  # 0 = every core
    (["--index-dir", "IDX", "--torch-threads", "3"], {"OMP_NUM_THREADS": "5"}, "5"),  # an explicit env wins
])
def test_the_servers_openmp_threads_follow_its_thread_budget(popen, monkeypatch, args, env, expected):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ServerProcess(args, env=env).start().stop()
    assert popen["calls"][0][1]["env"]["OMP_NUM_THREADS"] == (expected or str(available_cores()))


def test_a_server_still_loading_at_the_timeout_says_which_setting_to_raise(popen):
    popen["child"] = lambda: FakeChild(["INFO loading e5_Flat.index\n"], hang=True)
    server = ServerProcess(["--index-dir", "IDX"], start_timeout=0.3, timeout_hint="raise retrieval.launch_timeout")
    with pytest.raises(RuntimeError) as err:
        server.start()
    msg = str(err.value)
    assert "did not start: it was still loading after 0.3s" in msg
    assert "raise retrieval.launch_timeout" in msg
    assert "loading e5_Flat.index" in msg  # the child's own output is in ours
    assert server.proc.killed.is_set()


def test_a_server_that_exits_early_says_so_not_timeout(popen):
    popen["child"] = lambda: FakeChild(["error: --index-dir 'IDX' does not exist\n"], code=2)
    with pytest.raises(RuntimeError) as err:
        ServerProcess(["--index-dir", "IDX"], start_timeout=60).start()
    assert "it exited with code 2 before it was ready" in str(err.value)
    assert "does not exist" in str(err.value)


def test_launch_timeout_is_a_validated_config_field():
    assert load_config(None, []).retrieval.launch_timeout == launch.DEFAULT_START_TIMEOUT == 900
    assert load_config(None, ["retrieval.launch_timeout=1500"]).retrieval.launch_timeout == 1500
    with pytest.raises(ConfigError, match="retrieval.launch_timeout must be > 0"):
        load_config(None, ["retrieval.launch_timeout=0"])
    # the other ranks wait for the server's URL in a collective that gives up after parallel.timeout_minutes
    args = ["retrieval.launch=true", "retrieval.server_args=[--index-dir,IDX]"]
    load_config(None, args + ["retrieval.launch_timeout=1500"]).validate(check_files=False)
    with pytest.raises(ConfigError, match="raise parallel.timeout_minutes"):
        load_config(None, args + ["retrieval.launch_timeout=1900"]).validate(check_files=False)
    load_config(None, args + ["retrieval.launch_timeout=1900", "parallel.timeout_minutes=40"]).validate(
        check_files=False)


def test_the_trainer_starts_its_server_with_the_configured_timeout(popen, monkeypatch):
    import torch.distributed as dist

    from megatron_searchr1.trainer import build

    monkeypatch.setattr(dist, "get_world_size", lambda *a: 1)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj, *a: out.__setitem__(0, obj))
    monkeypatch.setenv("LOCAL_RANK", "0")
    seen = {}
    real_init = ServerProcess.__init__

    def spy(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        seen.update(timeout=self.start_timeout, hint=self.timeout_hint)

    monkeypatch.setattr(ServerProcess, "__init__", spy)
    cfg = load_config(None, ["retrieval.launch=true", "retrieval.server_args=[--index-dir,IDX]",
                             "retrieval.launch_timeout=1234"])
    server, url = build.launch_server(cfg)
    server.stop()
    assert url == "http://127.0.0.1:4321"
    assert seen == {"timeout": 1234, "hint": "raise retrieval.launch_timeout"}


def test_faiss_on_a_worker_thread_gets_the_servers_threads_under_torchruns_environment(monkeypatch):
    """Why the env matters: the server calls faiss.omp_set_num_threads on its main thread, but searches on a worker
    thread, whose OpenMP default comes from OMP_NUM_THREADS (libgomp keeps the setting per thread)."""
    import subprocess
    import sys

    pytest.importorskip("faiss")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as torchrun sets it
    probe = ("import threading, faiss; faiss.omp_set_num_threads(2); r = []; "
             "t = threading.Thread(target=lambda: r.append(faiss.omp_get_max_threads())); t.start(); t.join(); "
             "print(r[0])")
    env = launch.server_env(["--index-dir", "IDX", "--torch-threads", "2"])
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "2"
    inherited = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert inherited.strip() == "1"  # what the worker thread got before: one core for every search
