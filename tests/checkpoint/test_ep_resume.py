"""A checkpoint saved at one expert-parallel size resumes at another (tests/checkpoint/ep_resume_script.py under
torchrun, gloo): Megatron keeps expert parameters in a separate sub-optimizer only at EP > 1, so the optimizer's
saved param groups do not nest like the live ones (checkpoint.optimizer.load_optimizer)."""
import os

import pytest

from tests.dist_utils import rank_results, run_torchrun
from tests.models.test_moe import write_odd_moe_models

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ep_resume_script.py")


def _grad_norms(nproc, *args):
    out = run_torchrun(SCRIPT, nproc, *args, timeout=900)
    r = rank_results(out)[0]
    return {int(k): v for k, v in r["grad_norms"].items()}


@pytest.mark.slow
# EP=2 -> EP=1 is tested end to end by tests/test_train_moe.py (a GRPO run resumed at the other EP)
@pytest.mark.parametrize("saved_ep,resumed_ep", [(1, 2)])
def test_adam_state_resumes_at_another_ep(tmp_path, saved_ep, resumed_ep):
    """Three Adam steps at `saved_ep` (checkpoint after step 1) against steps 2-3 resumed at `resumed_ep` (world =
    EP, so DP changes with it). Step 3's gradient depends on step 2's update, i.e. on the Adam moments and step
    count saved after step 1.

    Not bit-exact: the DP size changes with the world, so the gradients are summed in another order (the script turns
    the load-balancing loss off: Megatron computes it on each rank's own tokens, so it differs between the layouts
    by ~1e-4 and Adam amplifies that). The resumed run must track the uninterrupted one far closer than a resume
    without the optimizer state does."""
    hf_dir = write_odd_moe_models(tmp_path)["qwen3_moe"]
    ckpt = str(tmp_path / "ckpt")
    full = _grad_norms(saved_ep, "--hf-dir", hf_dir, "--ep", str(saved_ep), "--ckpt", ckpt, "--save")
    resumed = _grad_norms(resumed_ep, "--hf-dir", hf_dir, "--ep", str(resumed_ep), "--ckpt", ckpt, "--resume")
    fresh = _grad_norms(resumed_ep, "--hf-dir", hf_dir, "--ep", str(resumed_ep), "--ckpt", ckpt, "--resume",
                        "--fresh-optimizer")
    assert sorted(resumed) == [2, 3], (full, resumed, fresh)
    assert resumed[2] == pytest.approx(full[2], rel=1e-3), (full, resumed, fresh)  # the loaded weights
    assert resumed[3] == pytest.approx(full[3], rel=1e-3), (full, resumed, fresh)  # the loaded Adam state
    assert abs(fresh[3] - full[3]) > 10 * abs(resumed[3] - full[3]), (full, resumed, fresh)
