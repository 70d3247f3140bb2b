"""An MoE actor trains at expert parallelism (tests/megatron/moe_train_script.py under torchrun, gloo): the router
aux loss is part of the actor's gradient and train_step logs the load-balancing metrics (megatron/moe_metrics.py);
the reference and the critic run MoE trunks; DP ranks with different micro-batch counts run the same number of
expert all-to-alls, and the padding that equalises them changes no gradient or log-prob."""
import os

import pytest

from tests.dist_utils import rank_results, run_torchrun
from tests.models.test_moe import write_odd_moe_models

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "moe_train_script.py")


@pytest.mark.slow
def test_moe_actor_step_at_ep2_has_aux_loss_gradient_and_metrics(tmp_path):
    hf_dir = write_odd_moe_models(tmp_path)["qwen3_moe"]  # layers 1-3 have experts (mlp_only_layers=[0])
    out = run_torchrun(SCRIPT, 2, "--hf-dir", hf_dir, "--ep", "2", timeout=600)
    results = sorted(rank_results(out), key=lambda r: r["rank"])
    r = results[0]
    once, twice = r["router_grad_norms"]
    # A loss that ignores the outputs leaves only the aux loss to move the routers, linearly in its coefficient.
    assert len(once) == 3 and all(g > 0 for g in once)
    assert all(abs(b - 2 * a) <= 1e-5 * b for a, b in zip(once, twice))
    m = r["metrics"]
    assert sorted(k for k in m if k.startswith("moe/load_balancing_loss/")) == [
        f"moe/load_balancing_loss/layer_{i}" for i in (1, 2, 3)]
    # Megatron's per-layer value E/topk * sum_e f_e P_e is 1 at perfect balance; a random router is near it
    assert all(0.5 <= m[f"moe/load_balancing_loss/layer_{i}"] < 6 for i in (1, 2, 3))
    for i in (1, 2, 3):
        assert m[f"moe/tokens_per_expert/layer_{i}/max"] >= 1.0 >= m[f"moe/tokens_per_expert/layer_{i}/min"] >= 0
    assert r["ref_log_probs_finite"] and r["critic_values"] == 4

    # Uneven packing (rank 0: 3 micro-batches, rank 1: 1). Without equal counts rank 1 stops early and the step
    # hangs (the script's 2-minute collective timeout fails it) or pairs all-to-alls of different micro-batches.
    u0, u1 = (res["uneven"] for res in results)
    assert (u0["micro_batches"], u1["micro_batches"]) == (3, 1)
    assert u0["train_all_to_all"] == u1["train_all_to_all"] > 0
    assert u0["forward_all_to_all"] == u1["forward_all_to_all"] > 0
    for u in (u0, u1):
        # padding micro-batches route in eval mode: no aux loss, not counted; they change no gradient or log-prob
        assert u["train_routed"] == u["real_tokens"]
        assert u["grad_max_diff"] <= 1e-5 * u["grad_max"] and u["grad_max"] > 0
        assert u["log_prob_max_diff"] < 1e-4
        assert u["aux_grad_max_diff"] <= 1e-5 * u["aux_grad_max"] and u["aux_grad_max"] > 0
