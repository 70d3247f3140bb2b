"""Freeze SFT (LLaMA-Factory's `finetuning_type: freeze`, models/freeze.py + trainer/sft.py + checkpoint.py): the
study guide's YAML with `finetuning_type: freeze` trains only LLaMA-Factory's trainable set (frozen weights
bit-identical, trained ones moved), checkpoints the full model plus the trained layers' Adam state, resumes
bit-for-bit, and does the same under torchrun at PP=2 (where the first stage trains nothing); the trainable set
matches LLaMA-Factory's rule for last / first N layers, module subsets and extra modules.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.dist_utils import REPO
from tests.models.test_gpt import megatron_tp1  # noqa: F401  (fixture)
from tests.rl_fixtures import run_module, with_keys

pytestmark = pytest.mark.slow
EXAMPLE = os.path.join(REPO, "examples", "qwen3_lora_sft.yaml")
LAYERS = 4


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A tiny local Qwen3 of 4 layers with tied embeddings (as Qwen3-4B's) and an alpaca + sharegpt dataset."""
    from megatron_searchr1.models.tiny import TinyModelConfig, make_tiny_model

    root = tmp_path_factory.mktemp("freeze")
    make_tiny_model(TinyModelConfig(output_dir=str(root / "Qwen3-tiny"), arch="qwen3", hidden_size=64,
                                    num_layers=LAYERS, vocab_size=400, init_std=0.1, tie_embeddings=True))
    data = root / "data"
    data.mkdir()
    (data / "alpaca_demo.json").write_text(json.dumps([
        {"instruction": f"Say the number {i} twice.", "input": "", "output": f"{i} {i}"} for i in range(12)]))
    (data / "identity.json").write_text(json.dumps([
        {"conversations": [{"from": "human", "value": f"Who are you, {i}?"}, {"from": "gpt", "value": f"I am {i}."}]}
        for i in range(6)]))
    (data / "dataset_info.json").write_text(json.dumps({
        "alpaca_en_demo": {"file_name": "alpaca_demo.json"},
        "identity": {"file_name": "identity.json", "formatting": "sharegpt", "columns": {"messages": "conversations"}}}))
    return root


def freeze_yaml(root, name: str, **extra) -> str:
    """The guide's YAML with `finetuning_type: freeze` (LLaMA-Factory's defaults: the last 2 layers), local paths,
    4 steps of 8 examples, a checkpoint every 2 steps."""
    text = open(EXAMPLE).read()
    for old, new in (("models/Qwen3-4B-Instruct-2507", str(root / "Qwen3-tiny")),
                     ("LLaMA-Factory/data", str(root / "data")), ("saves/qwen3-4b/lora/sft", str(root / name)),
                     ("finetuning_type: lora\nlora_rank: 8\nlora_target: all\n", "finetuning_type: freeze\n"),
                     ("save_steps: 500", "save_steps: 2\nsave_total_limit: 10\nmax_steps: 4"),
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


def weights(hf_dir) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory (a PP=2 export writes one file per stage)."""
    from safetensors.torch import load_file

    return {k: v for f in sorted(os.listdir(hf_dir)) if f.endswith(".safetensors")
            for k, v in load_file(os.path.join(hf_dir, f)).items()}


def trained_layers(base: dict, tuned: dict) -> set[str]:
    """The HF tensors that differ from the base (any element), e.g. {'model.layers.3.mlp.up_proj.weight', ...}."""
    assert sorted(base) == sorted(tuned)
    return {k for k in base if not torch.equal(base[k], tuned[k])}


def layer_names(base: dict, layers) -> set[str]:
    return {k for k in base if any(k.startswith(f"model.layers.{i}.") for i in layers)}


@pytest.fixture(scope="module")
def freeze_run(root):
    """The guide's YAML with finetuning_type: freeze, run once uninterrupted: (output dir, console output)."""
    proc = run_module("megatron_searchr1.sft", [freeze_yaml(root, "run")])
    return root / "run", proc.stdout + proc.stderr


def test_freeze_yaml_trains_only_the_last_two_layers(freeze_run, root):
    from megatron.core import dist_checkpointing

    out, log = freeze_run
    assert "freeze (FreezeSettings(trainable_layers=2" in log
    assert sorted(losses(out)) == [1, 2, 3, 4]
    base, tuned = weights(root / "Qwen3-tiny"), weights(out / "hf")
    # the export is the full model; exactly layers 2 and 3 moved, every tensor of theirs, nothing else
    assert trained_layers(base, tuned) == layer_names(base, (2, 3)) != set()
    ckpt = out / "checkpoints" / "step_000004"
    model_keys = set(dist_checkpointing.load_tensors_metadata(str(ckpt / "actor")))
    assert {"embedding.word_embeddings.weight", "decoder.layers.mlp.linear_fc1.weight"} <= model_keys  # full model
    opt_keys = set(dist_checkpointing.load_tensors_metadata(str(ckpt / "optimizer" / "actor")))
    layers_with_state = {k.split("decoder.layers.")[1].split(".")[0] for k in opt_keys}
    assert layers_with_state == {"2", "3"}, sorted(opt_keys)[:6]  # per-layer keys, the trained layers only
    assert json.loads((ckpt / "checkpoint.json").read_text())["freeze"]["actor"]["trainable_layers"] == 2


def test_resume_equals_the_uninterrupted_run(freeze_run, root):
    out, _ = freeze_run
    run_module("megatron_searchr1.sft", [freeze_yaml(root, "resumed",
                                                     resume_from_checkpoint=out / "checkpoints" / "step_000002")])
    assert losses(root / "resumed") == {s: losses(out)[s] for s in (3, 4)}
    a, b = weights(out / "hf"), weights(root / "resumed" / "hf")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_torchrun_pp2_trains_the_same_set_and_resumes(freeze_run, root):
    """PP=2 on 2 ranks (DP 1: the same batches): stage 0 (layers 0-1, the embedding) trains nothing, stage 1 its
    two layers; the losses follow the PP=1 run, the frozen weights stay the base's, and a resume from step 2 at PP=2
    equals the uninterrupted PP=2 run bit for bit."""
    out, _ = freeze_run
    run_module("megatron_searchr1.sft", [freeze_yaml(root, "pp2"), "parallel.pp=2"], nproc=2)
    pp1, pp2 = losses(out), losses(root / "pp2")
    assert sorted(pp2) == [1, 2, 3, 4] and all(abs(pp2[s] - pp1[s]) < 1e-5 for s in pp1), (pp1, pp2)
    base, a = weights(root / "Qwen3-tiny"), weights(root / "pp2" / "hf")
    assert trained_layers(base, a) == layer_names(base, (2, 3))
    # Adam divides by sqrt(v): fp32 round-off in a gradient can move a weight by up to ~lr per step, not more
    assert max((a[k] - weights(out / "hf")[k]).abs().max().item() for k in a) < 4 * 1e-4

    run_module("megatron_searchr1.sft", [freeze_yaml(root, "pp2_resumed", resume_from_checkpoint=root / "pp2" /
                                                     "checkpoints" / "step_000002"), "parallel.pp=2"], nproc=2)
    assert losses(root / "pp2_resumed") == {s: pp2[s] for s in (3, 4)}
    b = weights(root / "pp2_resumed" / "hf")
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---- in-process (last: the Megatron world's env vars stay set until the module ends) --------------------------
def _trainable(hf_dir: str, settings) -> set[str]:
    """Global Megatron names that train on a TP=1 model after apply_freeze."""
    from megatron_searchr1.models.convert import bind_mapping, global_names, load_hf_config
    from megatron_searchr1.models.freeze import apply_freeze
    from megatron_searchr1.models.gpt import build_gpt_model

    cfg = load_hf_config(hf_dir)
    model = build_gpt_model(cfg, use_te=False)
    names = set(apply_freeze(model, settings, bind_mapping(cfg, model)))
    assert names == {g for _, g, p in global_names(model) if p.requires_grad}
    return names


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    from megatron_searchr1.models.tiny import TinyModelConfig, make_tiny_model

    path = str(tmp_path_factory.mktemp("untied") / "Qwen3-tiny")
    make_tiny_model(TinyModelConfig(output_dir=path, arch="qwen3", hidden_size=64, num_layers=LAYERS,
                                    vocab_size=400))
    return path


def test_trainable_sets_follow_llamafactorys_rule(untied, root, megatron_tp1):
    """By hand from LLaMA-Factory's `_setup_freeze_tuning`: the last / first N layers, `.{i}.{module}` within them,
    extra module names matched as substrings of the HF names (so `norm` also trains every layer's norms)."""
    from megatron_searchr1.models.freeze import FreezeSettings

    attn = {"self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
            "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"}
    mlp = {"mlp.linear_fc1.weight", "mlp.linear_fc2.weight"}
    norms = {"input_layernorm.weight", "pre_mlp_layernorm.weight"}

    def layers(ids, suffixes=attn | mlp | norms):
        return {f"decoder.layers.{i}.{s}" for i in ids for s in suffixes}

    assert _trainable(untied, FreezeSettings()) == layers((2, 3))
    assert _trainable(untied, FreezeSettings(-1)) == layers((0,))
    assert _trainable(untied, FreezeSettings(9)) == layers(range(LAYERS))  # clamped, as there
    assert _trainable(untied, FreezeSettings(1, "mlp,self_attn")) == layers((3,), attn | mlp)
    assert _trainable(untied, FreezeSettings(-2, ("post_attention_layernorm",))) == layers(
        (0, 1), {"pre_mlp_layernorm.weight"})
    assert _trainable(untied, FreezeSettings(1, ("mlp",), ("embed_tokens", "norm", "lm_head"))) == (
        layers((3,), mlp) | layers(range(LAYERS), norms | {"self_attention.q_layernorm.weight",
                                                           "self_attention.k_layernorm.weight"})
        | {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"})
    assert _trainable(untied, FreezeSettings(0, extra_modules=("lm_head",))) == {"output_layer.weight"}
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        _trainable(str(root / "Qwen3-tiny"), FreezeSettings(extra_modules=("lm_head",)))


def test_megatron_refuses_a_stacked_subset_and_resume_needs_the_same_set(freeze_run, root, megatron_tp1, tmp_path):
    """Why checkpoint.py keys a freeze run's Adam state per layer: Megatron's stacked layout (one tensor for a weight
    of all layers) cannot be saved from the trained layers' state alone. And a checkpoint's optimizer state only
    loads into a model with the same trainable set (a clear error otherwise)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

    from megatron_searchr1.checkpoint import OPTIMIZER_METADATA, CheckpointError, load_checkpoint
    from megatron_searchr1.megatron.optimizer import build_optimizer
    from megatron_searchr1.models.convert import bind_mapping, load_hf_config
    from megatron_searchr1.models.forward import unwrap
    from megatron_searchr1.models.freeze import FreezeSettings, apply_freeze
    from megatron_searchr1.trainer.roles import build_actor

    hf_dir = str(root / "Qwen3-tiny")
    cfg = load_hf_config(hf_dir)
    model = build_actor(cfg, use_te=False, load_weights=lambda m: apply_freeze(m, FreezeSettings(1),
                                                                              bind_mapping(cfg, m)))
    opt, sched = build_optimizer(model, lr=1e-3)
    for p in unwrap(model).parameters():
        if p.requires_grad:
            p.main_grad.fill_(0.01)
    opt.step()  # Adam state now exists for layer 3 only
    stacked = opt.sharded_state_dict(unwrap(model).sharded_state_dict(), metadata=dict(OPTIMIZER_METADATA))
    with pytest.raises(CheckpointingException, match="Invalid access pattern"):
        dist_checkpointing.save(stacked, str(tmp_path))

    out, _ = freeze_run  # saved with the last 2 layers trainable; this model trains the last 1
    with pytest.raises(CheckpointError, match="same model.freeze"):
        load_checkpoint(str(out / "checkpoints"), 2, {"actor": model}, {"actor": opt}, {})
