"""checkpoints_convert/hf_to_megatron.py as users run it: bad inputs exit non-zero with a message saying why."""
import json
import shutil

import pytest

from tests.checkpoints_convert.cli_utils import HF_TO_MEGATRON, run_cli, tiny


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return tiny(tmp_path_factory.mktemp("h2m") / "qwen2")


def _fails_with(args, *needles):
    rc, out = run_cli(HF_TO_MEGATRON, *args)
    assert rc != 0, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("error: "), out[-3000:]
    for needle in needles:
        assert needle in last, last
    return last


def test_missing_dir(tmp_path):
    _fails_with(["--hf-dir", tmp_path / "nope", "--out-dir", tmp_path / "out"], "does not exist")


def test_wrong_architecture(hf_dir, tmp_path):
    bad = tmp_path / "gemma"  # a family we do not map (Mistral and Qwen3 are supported now)
    shutil.copytree(hf_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(architectures=["GemmaForCausalLM"], model_type="gemma")
    (bad / "config.json").write_text(json.dumps(cfg))
    _fails_with(["--hf-dir", bad, "--out-dir", tmp_path / "out"], "GemmaForCausalLM", "Qwen2ForCausalLM",
                "LlamaForCausalLM")


def test_tp_not_dividing_heads(hf_dir, tmp_path):
    _fails_with(["--hf-dir", hf_dir, "--out-dir", tmp_path / "out", "--tp", "3"],
                "TP=3 does not divide num_attention_heads=4")


def test_tp_needs_torchrun(hf_dir, tmp_path):
    _fails_with(["--hf-dir", hf_dir, "--out-dir", tmp_path / "out", "--tp", "2"], "torchrun --nproc_per_node 2")


def test_config_disagrees_with_tensors(hf_dir, tmp_path):
    bad = tmp_path / "wrong-ffn"
    shutil.copytree(hf_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (bad / "config.json").write_text(json.dumps(cfg))
    _fails_with(["--hf-dir", bad, "--out-dir", tmp_path / "out"], "gate_proj.weight", "disagree")


def test_refuses_non_empty_output(hf_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "something").write_text("x")
    _fails_with(["--hf-dir", hf_dir, "--out-dir", out], "not empty", "--overwrite")
    _fails_with(["--hf-dir", hf_dir, "--out-dir", hf_dir, "--overwrite"], "is the input directory")
