"""checkpoints_convert/hf_to_megatron.py as users run it: bad inputs exit non-zero with a message saying why."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.checkpoints_convert.cli_utils import HF_TO_MEGATRON, run_cli, tiny
from tests.dist_utils import REPO


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


def _fails_before_torch(args, *needles):
    """The CLI's error with torch made unimportable: a check that ran after torch loads would be an ImportError."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "from megatron_searchr1.cli import run_main\n"
            "from megatron_searchr1.models.convert_cli import hf_to_megatron_main\n"
            f"sys.exit(run_main(hf_to_megatron_main, {[str(a) for a in args]!r}))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert out.strip().startswith("error: ") and len(out.strip().splitlines()) == 1, out
    for needle in needles:
        assert needle in out, out


def test_a_directory_without_tokenizer_is_refused_before_torch(hf_dir, tmp_path):
    bare = tmp_path / "no-tokenizer"
    shutil.copytree(hf_dir, bare)
    for f in bare.iterdir():
        if "token" in f.name or f.name in ("vocab.json", "merges.txt"):
            f.unlink()
    _fails_before_torch(["--hf-dir", bare, "--out-dir", tmp_path / "out"], "no tokenizer files", "save_pretrained")


def test_a_truncated_safetensors_file_is_named_before_torch(hf_dir, tmp_path):
    cut = tmp_path / "cut"
    shutil.copytree(hf_dir, cut)
    shard = sorted(cut.glob("*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    _fails_before_torch(["--hf-dir", cut, "--out-dir", tmp_path / "out"], str(shard), "truncated")
    shard.write_bytes(data[:6])
    _fails_before_torch(["--hf-dir", cut, "--out-dir", tmp_path / "out2"], str(shard), "too few")
    (cut / "config.json").write_text("{not json")
    _fails_before_torch(["--hf-dir", cut, "--out-dir", tmp_path / "out3"], "config.json", "not valid JSON")
