"""The CPU demo end to end at its CI size: every stage runs for real (world, tokenizer + model, server, Megatron SFT
at DP=2, no-search baseline, GRPO at TP=2 on vLLM, validation, HF export) and leaves what the README promises."""
import json
import os
import subprocess
import sys

import pytest

from tests.dist_utils import REPO

# The CI-sized demo takes ~5 minutes on a free 2-core machine and ~8 on a loaded one; its subprocess gets this
# long, and pytest-timeout (CI passes --timeout=900 to every test) gets a few minutes more for the checks after it.
DEMO_LIMIT_S = 1800


def test_bad_arguments_are_one_error_line():
    proc = subprocess.run([sys.executable, "-m", "megatron_searchr1.demo", "--sft-steps", "0"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: --sft-steps must be >= 1"]
    proc = subprocess.run([sys.executable, "-m", "megatron_searchr1.demo", "--seed", "100000"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: --seed must be in [0, 100000), got 100000"]


def test_rl_overrides_are_checked_before_any_stage(tmp_path):
    """--rl reaches the GRPO stage's config; a mistake in it is one error line before any stage runs (the demo's
    own sizes count: LLDS needs a second update per step, which the demo's one mini-batch per step does not give)."""
    from megatron_searchr1.cli import UsageError
    from megatron_searchr1.demo import SIZES, check_rl_overrides

    check_rl_overrides(SIZES["full"], ["algo.llds.coef=0.1", "algo.ppo_mini_batch_size=4"])  # valid: no raise
    with pytest.raises(UsageError, match="algo.llds acts from a step's second update on"):
        check_rl_overrides(SIZES["full"], ["algo.llds.coef=0.1"])
    proc = subprocess.run([sys.executable, "-m", "megatron_searchr1.demo", "--rl", "algo.lds.coef=0.1",
                           "--work-dir", str(tmp_path / "w")], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --rl: unknown field algo.lds (did you mean algo.llds?)")
    assert not (tmp_path / "w").exists()


def test_a_work_dir_keeps_its_seed(tmp_path):
    """Continuing a work dir under another --seed would mix two seeds' stages: one error line, nothing run."""
    (tmp_path / "seed.json").write_text('{"seed": 1}')
    proc = subprocess.run([sys.executable, "-m", "megatron_searchr1.demo", "--seed", "2", "--work-dir",
                           str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {tmp_path} holds a run of seed 1: pass --seed 1 to continue it, --fresh to start over, or another "
        "--work-dir"]
    assert sorted(os.listdir(tmp_path)) == ["seed.json"]


def test_world_seeds_keep_the_warm_up_off_every_rl_world():
    from megatron_searchr1.demo import SFT_SEED_OFFSET, world_seeds

    for seed in (0, 3, SFT_SEED_OFFSET - 1):
        sft, val = world_seeds(seed, 4)
        assert len(set(sft) | {val}) == 5 and min(sft + [val]) >= SFT_SEED_OFFSET  # never an RL world's seed


@pytest.mark.slow
@pytest.mark.timeout(DEMO_LIMIT_S + 300)  # a mark overrides the command line's --timeout for this test
def test_ci_sized_demo_runs_every_stage(tmp_path):
    pytest.importorskip("vllm")
    work = tmp_path / "demo"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-m", "megatron_searchr1.demo", "--size", "ci", "--work-dir", str(work)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=DEMO_LIMIT_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "exact match (EM)" in proc.stdout and "Exported model" in proc.stdout

    report = json.loads((work / "report.json").read_text())
    for phase in ("no_search", "before_rl", "after_rl"):
        assert report[phase]["split:validation"]["n"] > 0 and report[phase]["split:test"]["n"] > 0
    assert report["rl_steps"] == 3 and len(report["samples"]) == 3
    assert report["seed"] == 0 and report["sft_steps"]["steps"] == 40 and "val_exact" in report["sft_steps"]
    assert [os.path.basename(p) for p in report["pictures"]] == [
        "training_loss.png", "training_reward.png", "validation_em.png"]
    assert all(os.path.getsize(p) > 1000 and p in proc.stdout for p in report["pictures"])  # named in the printout
    assert all(f"stage {i}/6 " in proc.stdout for i in range(1, 7))
    assert [step for step, _ in report["em_by_rl_step"]] == [0, 2, 3]  # before, every test_freq steps, after
    assert "EM (all questions) by GRPO step: 0: " in proc.stdout

    from megatron_searchr1.metrics import read_scalars

    grpo = read_scalars(str(work / "grpo" / "tensorboard"))
    assert len(grpo["reward/mean"]) == 3 and "val/all/em" in grpo
    sft = read_scalars(str(work / "sft" / "tensorboard"))
    losses = [v for _, v in sft["sft/loss"]]
    assert losses[-1] < losses[0]  # the warm-up learned something
    val_losses = [v for _, v in sft["val/loss"]]
    assert len(val_losses) == 2 and val_losses[-1] < val_losses[0]  # validated at step 20 and at the end

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(report["hf_model"])
    tok = AutoTokenizer.from_pretrained(report["hf_model"])
    out = model(**tok("<search> who", return_tensors="pt"))
    assert out.logits.shape[-1] == len(tok)


def test_per_test_timeout_outlasts_the_demos_own_limit():
    """pytest-timeout's limit for the demo test must exceed the limit the test gives its subprocess, else a slow
    machine sees a pytest-timeout kill (no output) instead of the demo's own log tail. The subprocess limit is read
    from the test's own `subprocess.run(..., timeout=...)` call, so editing either number alone is caught."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(test_ci_sized_demo_runs_every_stage)))
    limits = [kw.value for node in ast.walk(tree) if isinstance(node, ast.Call)
              and ast.unparse(node.func) == "subprocess.run" for kw in node.keywords if kw.arg == "timeout"]
    assert len(limits) == 1, "the CI demo test must launch the demo with exactly one subprocess.run(timeout=...)"
    subprocess_limit = eval(compile(ast.Expression(limits[0]), "<timeout>", "eval"), globals())
    marks = [m for m in getattr(test_ci_sized_demo_runs_every_stage, "pytestmark", []) if m.name == "timeout"]
    assert marks, "the CI demo test needs a @pytest.mark.timeout"
    assert marks[0].args[0] > subprocess_limit
