"""LoRA / freeze SFT (trainer/sft.py) driven by the study guide's LLaMA-Factory YAML (examples/qwen3_lora_sft.yaml,
local paths swapped in): on a tiny Qwen3 with an alpaca + sharegpt dataset_info.json it trains, saves adapter-only
checkpoints, resumes bit-for-bit, exports a merged HF model and a PEFT adapter whose logits are our model's, plots
its loss; under torchrun at TP=2 it follows the TP=1 run.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from tests.dist_utils import REPO
from tests.models.test_gpt import megatron_tp1  # noqa: F401  (fixture)
from tests.rl_fixtures import run_module, with_keys

pytestmark = pytest.mark.slow
EXAMPLE = os.path.join(REPO, "examples", "qwen3_lora_sft.yaml")


@pytest.fixture(scope="module")
def lf_root(tmp_path_factory):
    """A tiny local Qwen3 (chat-template tokenizer) and a dataset_info.json with an alpaca and a sharegpt set."""
    from megatron_searchr1.models.tiny import TinyModelConfig, make_tiny_model

    root = tmp_path_factory.mktemp("lf")
    make_tiny_model(TinyModelConfig(output_dir=str(root / "Qwen3-tiny"), arch="qwen3", hidden_size=64, num_layers=2,
                                    vocab_size=400, init_std=0.1))
    data = root / "data"
    data.mkdir()
    (data / "alpaca_demo.json").write_text(json.dumps([
        {"instruction": f"Say the number {i} twice.", "input": "" if i % 2 else f"note {i}", "output": f"{i} {i}"}
        for i in range(12)]))
    (data / "identity.json").write_text(json.dumps([
        {"conversations": [{"from": "human", "value": f"Who are you, {i}?"}, {"from": "gpt", "value": f"I am {i}."},
                           {"from": "human", "value": "And?"}, {"from": "gpt", "value": "That is all."}],
         "system": "Be brief."} for i in range(6)]))
    (data / "dataset_info.json").write_text(json.dumps({
        "alpaca_en_demo": {"file_name": "alpaca_demo.json"},
        "identity": {"file_name": "identity.json", "formatting": "sharegpt",
                     "columns": {"messages": "conversations", "system": "system"}}}))
    return root


def seed_yaml(root, name: str, dropout: float = 0.1, **extra) -> str:
    """The example as written, with local paths, checkpoints every 2 steps (kept) and LoRA dropout on (so a resume
    must restore the RNG too); 18 examples / (1 x 8) = 2 steps an epoch, 3 epochs."""
    text = open(EXAMPLE).read()
    for old, new in (("models/Qwen3-4B-Instruct-2507", str(root / "Qwen3-tiny")),
                     ("LLaMA-Factory/data", str(root / "data")), ("saves/qwen3-4b/lora/sft", str(root / name)),
                     ("save_steps: 500", f"save_steps: 2\nsave_total_limit: 10\nlora_dropout: {dropout}"),
                     ("logging_steps: 10", "logging_steps: 1")):
        assert old in text, old
        text = text.replace(old, new)
    text = with_keys(text, extra)
    path = root / f"{name}.yaml"
    path.write_text(text)
    return str(path)


def losses(out_dir) -> dict[int, float]:
    from megatron_searchr1.plots import read_metrics

    return dict(read_metrics(str(out_dir))["sft/loss"])


@pytest.fixture(scope="module")
def lora_run(lf_root):
    """The seed YAML run once, uninterrupted: (output dir, its console output)."""
    proc = run_module("megatron_searchr1.sft", [seed_yaml(lf_root, "run")])
    return lf_root / "run", proc.stdout + proc.stderr


def test_seed_yaml_trains_saves_adapter_checkpoints_exports_and_plots(lora_run):
    from safetensors.torch import load_file

    out, log = lora_run
    assert ("LLaMA-Factory keys with no effect here, ignored: trust_remote_code, preprocessing_num_workers, "
            "dataloader_num_workers, save_only_model, ddp_timeout") in log
    assert "training runs in float32" in log  # bf16: true on a CPU
    assert sorted(losses(out)) == [1, 2, 3, 4, 5, 6]  # 3 epochs of 2 steps
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step_000002", "step_000004", "step_000006"]
    # the checkpoint's model part is the adapters, nothing of the base
    from megatron.core import dist_checkpointing

    keys = set(dist_checkpointing.load_tensors_metadata(str(out / "checkpoints" / "step_000006" / "actor")))
    assert keys and all(".lora.lora_" in k for k in keys), sorted(keys)[:4]
    adapter = load_file(out / "hf_adapter" / "adapter_model.safetensors")
    merged = load_file(out / "hf" / "model.safetensors")
    assert len(adapter) == 2 * 7 * 2 and all(k.startswith("base_model.model.model.layers.") for k in adapter)
    assert sum(t.numel() for t in adapter.values()) < 0.2 * sum(t.numel() for t in merged.values())
    assert json.loads((out / "hf_adapter" / "adapter_config.json").read_text())["r"] == 8
    # training moved the adapters (B starts at zero)
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in adapter.items())

    # plot_loss: a real picture, not an empty canvas
    from PIL import Image

    png = out / "training_loss.png"
    img = np.asarray(Image.open(png).convert("L"), dtype=np.float32)
    assert png.stat().st_size > 10_000 and img.shape[0] >= 300 and img.shape[1] >= 400
    assert img.std() > 5 and (img < 128).mean() > 0.005  # lines and text drawn on white


def test_resume_from_a_checkpoint_equals_the_uninterrupted_run(lora_run, lf_root):
    """Start a new output dir from the run's step-2 checkpoint: steps 3..6 and the final adapter are bit-identical."""
    from safetensors.torch import load_file

    out, _ = lora_run
    step2 = out / "checkpoints" / "step_000002"
    run_module("megatron_searchr1.sft", [seed_yaml(lf_root, "resumed", resume_from_checkpoint=step2)])
    resumed = lf_root / "resumed"
    assert sorted(losses(resumed)) == [3, 4, 5, 6]
    assert all(losses(resumed)[s] == losses(out)[s] for s in (3, 4, 5, 6))
    a = load_file(out / "hf_adapter" / "adapter_model.safetensors")
    b = load_file(resumed / "hf_adapter" / "adapter_model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_torchrun_tp2_follows_the_tp1_run(lf_root):
    """The same YAML on 2 ranks at TP=2 (DP 1: the same batches) gives the TP=1 losses and adapter to fp32 round-off.
    LoRA dropout off: each TP rank draws its dropout mask on its own shard, so masks cannot match TP=1's."""
    from safetensors.torch import load_file

    run_module("megatron_searchr1.sft", [seed_yaml(lf_root, "tp1", dropout=0.0, max_steps=3)])
    run_module("megatron_searchr1.sft", [seed_yaml(lf_root, "tp2", dropout=0.0, max_steps=3), "parallel.tp=2"],
               nproc=2)
    tp1, tp2 = losses(lf_root / "tp1"), losses(lf_root / "tp2")
    assert sorted(tp2) == [1, 2, 3] and all(abs(tp2[s] - tp1[s]) < 1e-5 for s in tp1), (tp1, tp2)
    a = load_file(lf_root / "tp1" / "hf_adapter" / "adapter_model.safetensors")
    b = load_file(lf_root / "tp2" / "hf_adapter" / "adapter_model.safetensors")
    assert sorted(a) == sorted(b) and max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def test_peft_and_merged_exports_give_our_models_logits(lora_run, lf_root, megatron_tp1):
    """Our Megatron model (HF base + LoRA + the run's last adapter checkpoint) == PeftModel.from_pretrained(base,
    adapter dir) == the merged HF export, fp32, within 1e-5. (Last in the module: the in-process Megatron world's
    env vars stay set until the module ends, and a later subprocess would inherit them.)"""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megatron_searchr1.models.convert import SafetensorsReader, bind_mapping, load_hf_config, load_hf_weights
    from megatron_searchr1.models.gpt import build_gpt_model
    from megatron.core import dist_checkpointing

    from megatron_searchr1.models.lora import LoraSettings, adapter_sharded_state_dict, apply_lora

    out, _ = lora_run
    base_dir = str(lf_root / "Qwen3-tiny")
    cfg = load_hf_config(base_dir)
    model = build_gpt_model(cfg, use_te=False)
    load_hf_weights(model, SafetensorsReader(base_dir), bind_mapping(cfg, model))
    apply_lora(model, LoraSettings(rank=8, alpha=16, dropout=0.1, targets=("all",)))
    ckpt = str(out / "checkpoints" / "step_000006" / "actor")
    state = dist_checkpointing.load(adapter_sharded_state_dict(model), ckpt)
    model.load_state_dict(state, strict=False)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.eval()(ids, None, None, runtime_gather_output=True)[..., : cfg.vocab_size]
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        peft_logits = PeftModel.from_pretrained(base, str(out / "hf_adapter")).eval()(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(str(out / "hf"), dtype=torch.float32).eval()(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()(ids).logits
    assert (ours - peft_logits).abs().max() <= 1e-5
    assert (ours - merged).abs().max() <= 1e-5
    assert (ours - plain).abs().max() > 1e-4  # the adapter does something
