"""The weight sync of a LoRA actor (rollout/weight_sync.py): merged weights (base + scale * B A) to the engine,
no adapter tensors, the base unchanged. Runs tests/rollout/lora_sync_script.py under torchrun (gloo): a tiny Qwen2
(head_dim 32, GQA) with random adapters on every projection, into a `transformers` engine at TP=2: the
engine's log-probs equal the trainer's with adapters on, the received tensors are the merged export's exactly, and a
second sync follows new adapters. The sync into vLLM at TP=2 runs end to end in tests/trainer/test_lora_rl.py (the
engine's log-probs equal the trainer's after every step's sync of moved adapters).
"""

import pytest

from megatron_searchr1.models.tiny import TinyModelConfig, make_tiny_model
from tests.dist_utils import rank_results, run_torchrun
from tests.rollout.test_weight_sync import SCRIPT as WEIGHT_SYNC_SCRIPT

SCRIPT = WEIGHT_SYNC_SCRIPT.with_name("lora_sync_script.py")
CHECKS = ["names", "exact", "logprobs", "resync", "base"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("lora_sync") / "qwen2")
    make_tiny_model(TinyModelConfig(output_dir=d, arch="qwen2", hidden_size=128, num_heads=4, num_kv_heads=2,
                                    intermediate_size=128, num_layers=2, tie_embeddings=True, init_std=0.1, seed=0,
                                    vocab_size=500))
    return d


def _check(out, checks, ranks):
    results = rank_results(out)
    for check in checks:
        rows = [r for r in results if r["check"] == check]
        assert {r["rank"] for r in rows} == set(ranks) and all(r["ok"] for r in rows), (check, rows)


@pytest.mark.slow
def test_lora_sync_tp2(hf_dir):
    """One launch at TP=2: each rank merges its own shard of base + scale * B A before the gather. A TP=1 launch of
    the same checks was dropped: it only skips the gather, which test_weight_sync.py's world of one covers."""
    _check(run_torchrun(SCRIPT, 2, "--hf-dir", hf_dir, "--tp", "2", timeout=600), CHECKS, [0, 1])
