"""Shared pieces for trainer tests: one synthetic world, one tiny model and one retrieval server per session.

    from tests.rl_fixtures import world, tiny_model, server, run_module   # pytest picks up the fixtures

The world is the CPU demo's (megatron_searchr1.data.synthetic, short prompt template, BM25 oracle, seed 0); the
model is a random tiny Qwen2 with a BPE tokenizer trained on the world's text (head_dim 32 for vLLM's CPU
attention); the server is the real retrieval server over the world's BM25 index, started once and stopped at the
end of the session. Everything lives under one session temp dir so several test files can share it.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from tests.dist_utils import REPO

TINY_MODEL_ARGS = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=2,
                       vocab_size=1000, tie_embeddings=True)
"""Smaller than the demo's model (head_dim still 32); 2 layers so PP=2 splits it, 2 heads so TP=2 splits them."""


def child_env(**extra: str) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}")
    env.update(extra)
    return env


def run_module(module: str, args: list[str], nproc: int = 1, timeout: float = 600, check: bool = True
               ) -> subprocess.CompletedProcess:
    """`python -m module args` (nproc=1 and no torchrun) or `torchrun --standalone --nproc_per_node N -m module`."""
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
               module, *args]
    else:
        cmd = [sys.executable, "-m", module, *args]
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"rc={proc.returncode}: {' '.join(cmd)}\n{(proc.stdout + proc.stderr)[-8000:]}")
    return proc


_BUILT: dict = {}
"""What the fixtures below built, once per pytest process. Test modules import these fixtures, and pytest keeps one
instance of a session fixture per module it is found in: without this cache every module that imports them would
build its own world, tiny model and server. Output directory names under rl_root are therefore unique across test
modules."""


def _once(key: str, build):
    if key not in _BUILT:
        _BUILT[key] = build()
    return _BUILT[key]


@pytest.fixture(scope="session")
def rl_root(tmp_path_factory) -> str:
    return _once("rl_root", lambda: str(tmp_path_factory.mktemp("rl")))


@pytest.fixture(scope="session")
def world(rl_root) -> str:
    """The synthetic world dir: {train,validation,test}.parquet, index_bm25/, sft/dataset_info.json."""
    def build():
        out = os.path.join(rl_root, "world")
        run_module("megatron_searchr1.data.make_world", ["--out-dir", out, "--template", "short", "--oracle", "bm25",
                                                        "--seed", "0"], timeout=300)
        return out

    return _once("world", build)


def world_text_file(world: str, rl_root: str) -> str:
    """The world's text (what the tiny models' BPE tokenizers are trained on), written once per session. A plain
    function, not a fixture: a fixture's dependencies must be imported into every module that uses it."""
    def build():
        from megatron_searchr1.demo import world_text

        out = os.path.join(rl_root, "world_text.txt")
        world_text(world, out)
        return out

    return _once("world_text", build)


@pytest.fixture(scope="session")
def tiny_model(world, rl_root) -> str:
    """HF dir of a random tiny Qwen2 whose tokenizer knows the world's words."""
    def build():
        from megatron_searchr1.models.tiny import TinyModelConfig, make_tiny_model

        out = os.path.join(rl_root, "tiny_model")
        make_tiny_model(TinyModelConfig(output_dir=out, text_files=[world_text_file(world, rl_root)],
                                        **TINY_MODEL_ARGS))
        return out

    return _once("tiny_model", build)


@pytest.fixture(scope="session")
def server(world):
    """A live retrieval server over the world's BM25 index; yields its URL. The first module to ask starts it; it
    stops when that instance is torn down, at the end of the session."""
    from megatron_searchr1.search.launch import ServerProcess

    if "server" in _BUILT:
        yield _BUILT["server"]
        return
    with ServerProcess(["--index-dir", os.path.join(world, "index_bm25")]) as proc:
        _BUILT["server"] = proc.url
        try:
            yield proc.url
        finally:
            _BUILT.pop("server", None)


@pytest.fixture(scope="session")
def grpo_run(world, tiny_model, server, rl_root) -> tuple[str, str]:
    """(output dir, console log) of tests/test_train.py's tiny GRPO run at TP=2: 3 steps with vLLM rollouts, a
    checkpoint per step, the HF export and plots. Built once; other tests compare their runs' steps with its."""
    def build():
        from tests.test_train import rl_args

        out = os.path.join(rl_root, "grpo")
        proc = run_module("megatron_searchr1.train", rl_args(world, tiny_model, server, out, "trainer.total_steps=3",
                                                             "logging.plot=true"), nproc=2)
        return out, proc.stdout + proc.stderr

    return _once("grpo_run", build)


def ctrl_c_after_step(cmd: list[str], step: int, min_processes: int) -> tuple[str, str, float, list, int]:
    """Ctrl-C in a terminal, for a torchrun job: start `cmd` in a session of its own, read its output until the line
    of `step` (a checkpoint exists by then with save_freq=1), SIGINT the whole process group and wait for it.
    Returns (output before the signal, output after it, seconds to exit, processes of the job's tree still alive
    half a second later, return code); whatever is left is SIGKILLed. At least `min_processes` must be below
    torchrun (each rank starts a session of its own, so the tree is followed, not the group)."""
    import signal

    from megatron_searchr1.interrupt import _alive, descendants

    proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines, below = [], []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(f"step {step}/"):
                break
        assert lines and lines[-1].startswith(f"step {step}/"), "".join(lines)[-6000:]
        below = descendants(proc.pid)
        assert len(below) >= min_processes, below
        t0 = time.time()
        os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        seconds = time.time() - t0
        time.sleep(0.5)
        left = [p for p in below if _alive(p)]
    finally:
        for pid in [proc.pid, *below]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return "".join(lines), rest, seconds, left, proc.returncode


def wait_for(predicate, timeout: float, every: float = 0.2) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return True
        time.sleep(every)
    return predicate()


def with_keys(text: str, extra: dict) -> str:
    """`text` with each top-level key of `extra` set: an existing line replaced (a key given twice is refused), a
    new one appended."""
    for k, v in extra.items():
        line = f"{k}: {v}"
        text, n = re.subn(rf"(?m)^{re.escape(k)}:.*$", line.replace("\\", "\\\\"), text)
        if not n:
            text += f"\n{line}\n"
    return text
