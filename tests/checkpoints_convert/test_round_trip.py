"""checkpoints_convert/hf_to_megatron.py and megatron_to_hf.py as users run them, the launches that need torch: HF ->
Megatron -> HF is bit-exact, keeps the dtype and loads in transformers, at TP=1 and from a checkpoint saved at
TP=2 x PP=2 (real torchrun); inputs whose tensors disagree with their config, and partial checkpoints, are refused
with one error line. The checks the files alone decide (no torch) are tests/checkpoints_convert/test_fast_checks.py.

One conversion serves the module: a tied Llama in bf16 (the usual release dtype) converted at TP=1; each test runs
one more launch of its own.
"""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.checkpoints_convert.cli_utils import HF_TO_MEGATRON, MEGATRON_TO_HF, run_cli, tiny
from tests.dist_utils import run_torchrun


def hf_tensors(d):
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.isfile(index):
        files = sorted(set(json.load(open(index))["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for f in files:
        out.update(load_file(os.path.join(d, f)))
    return out


def assert_same_model(src, dst):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a, b = hf_tensors(src), hf_tensors(dst)
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    model = AutoModelForCausalLM.from_pretrained(dst)
    tok = AutoTokenizer.from_pretrained(dst)
    ref = AutoModelForCausalLM.from_pretrained(src)
    ids = torch.tensor([tok.encode("Paris is the capital")])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith("<|im_start|>")


def bf16_model(path, seed=3):
    """A tiny tied Llama whose safetensors and config.json say bf16."""
    from safetensors.torch import save_file

    hf = tiny(path, arch="llama", tie=True, seed=seed)
    tensors = load_file(os.path.join(hf, "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, os.path.join(hf, "model.safetensors"),
              metadata={"format": "pt"})
    cfg = json.loads(open(os.path.join(hf, "config.json")).read())
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = "bfloat16"
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump(cfg, f)
    return hf


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tied bf16 Llama and its TP=1 checkpoint."""
    root = tmp_path_factory.mktemp("round_trip")
    hf = bf16_model(root / "llama")
    rc, out = run_cli(HF_TO_MEGATRON, "--hf-dir", hf, "--out-dir", root / "ckpt")
    assert rc == 0, out
    return hf, root / "ckpt"


def test_round_trip_tp1_bit_exact_in_bf16(converted, tmp_path):
    """bf16 stays bf16 in the metadata, in every tensor of the dist checkpoint (torch norms included) and back in
    HF; tied embeddings stay tied; the tensors and logits come back equal."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    hf, ckpt = converted
    assert json.load(open(ckpt / "searchr1_checkpoint.json"))["dtype"] == "bfloat16"
    saved = {k: m.properties.dtype for k, m in dcp.FileSystemReader(str(ckpt)).read_metadata()
             .state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    assert any("layernorm" in k for k in saved)
    assert set(saved.values()) == {torch.bfloat16}, {k: d for k, d in saved.items() if d != torch.bfloat16}
    rc, out = run_cli(MEGATRON_TO_HF, "--ckpt-dir", ckpt, "--out-dir", tmp_path / "back")
    assert rc == 0, out
    back = hf_tensors(tmp_path / "back")
    assert "lm_head.weight" not in back  # tied stays tied
    assert all(t.dtype == torch.bfloat16 for t in back.values())
    assert json.load(open(tmp_path / "back" / "config.json"))["dtype"] == "bfloat16"
    assert_same_model(hf, tmp_path / "back")


@pytest.mark.slow
def test_round_trip_saved_at_tp2_pp2(tmp_path):
    """Qwen2 (untied, bias) saved by 4 ranks at TP=2 PP=2; read back in one process and at TP=2 PP=2."""
    hf = tiny(tmp_path / "qwen2", arch="qwen2")
    run_torchrun(HF_TO_MEGATRON, 4, "--hf-dir", hf, "--out-dir", tmp_path / "ckpt", "--tp", "2", "--pp", "2")
    meta = json.load(open(tmp_path / "ckpt" / "searchr1_checkpoint.json"))
    assert (meta["saved_tp"], meta["saved_pp"]) == (2, 2)
    rc, out = run_cli(MEGATRON_TO_HF, "--ckpt-dir", tmp_path / "ckpt", "--out-dir", tmp_path / "back1")
    assert rc == 0, out
    assert_same_model(hf, tmp_path / "back1")
    run_torchrun(MEGATRON_TO_HF, 4, "--ckpt-dir", tmp_path / "ckpt", "--out-dir", tmp_path / "back4", "--tp", "2",
                 "--pp", "2")
    assert os.path.isfile(tmp_path / "back4" / "model.safetensors.index.json")  # one file per pipeline stage
    assert_same_model(hf, tmp_path / "back4")


def _fails_with(args, *needles):
    rc, out = run_cli(MEGATRON_TO_HF, *args)
    assert rc != 0, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("error: "), out[-3000:]
    for needle in needles:
        assert needle in last, last


def test_refuses_bad_checkpoints(converted, tmp_path):
    """What needs the tensors or Megatron's index: a missing shard, a config that no longer fits the tensors, a TP
    that does not fit the model. (A missing directory or an HF directory: test_fast_checks.py, test_cli.py.)"""
    _, ckpt = converted
    partial = tmp_path / "partial"
    shutil.copytree(ckpt, partial)
    shard = sorted(f for f in os.listdir(partial) if f.endswith(".distcp"))[-1]
    os.remove(partial / shard)
    _fails_with(["--ckpt-dir", partial, "--out-dir", tmp_path / "o"], "incomplete", shard)
    foreign = tmp_path / "foreign"
    shutil.copytree(ckpt, foreign)
    cfg = json.loads((foreign / "hf" / "config.json").read_text())
    cfg["intermediate_size"] = 32  # the model it would build no longer matches the tensors
    (foreign / "hf" / "config.json").write_text(json.dumps(cfg))
    _fails_with(["--ckpt-dir", foreign, "--out-dir", tmp_path / "o"], "linear_fc1")
    _fails_with(["--ckpt-dir", ckpt, "--out-dir", tmp_path / "o", "--tp", "3"], "TP=3 does not divide")


def test_hf_to_megatron_refuses_tensors_that_disagree_with_the_config(converted, tmp_path):
    hf, _ = converted
    bad = tmp_path / "wrong-ffn"
    shutil.copytree(hf, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (bad / "config.json").write_text(json.dumps(cfg))
    rc, out = run_cli(HF_TO_MEGATRON, "--hf-dir", bad, "--out-dir", tmp_path / "out")
    assert rc != 0, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("error: ") and "gate_proj.weight" in last and "disagree" in last, out[-3000:]
