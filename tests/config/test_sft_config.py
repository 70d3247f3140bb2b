"""The SFT config: LLaMA-Factory's flat YAML (config/llamafactory.py) read into our sections, the study guide's YAML
(examples/qwen3_lora_sft.yaml) as written, the fine-tuning types, and the CLI's one-line refusals."""
import os
import re
import subprocess
import sys

import pytest
import yaml

from megatron_searchr1.config import ConfigError, SFTConfig, load_config
from megatron_searchr1.config.llamafactory import translate
from tests.dist_utils import REPO

EXAMPLE = os.path.join(REPO, "examples", "qwen3_lora_sft.yaml")


@pytest.fixture
def seed_yaml(tmp_path):
    """examples/qwen3_lora_sft.yaml with its model path pointing at a local dir (config.json only)."""
    model = tmp_path / "Qwen3-4B-Instruct-2507"
    model.mkdir()
    (model / "config.json").write_text('{"num_attention_heads": 4, "num_hidden_layers": 2}')
    text = open(EXAMPLE).read().replace("models/Qwen3-4B-Instruct-2507", str(model))
    path = tmp_path / "qwen3_lora_sft.yaml"
    path.write_text(text)
    return str(path)


def lf_config(path, overrides=(), world_size=1, say=lambda s: None):
    return load_config(path, list(overrides), cls=SFTConfig, translate=lambda raw: translate(raw, world_size, say))


def test_the_seed_yaml_means_the_same_recipe_here(seed_yaml):
    said = []
    cfg = lf_config(seed_yaml, say=said.append)
    m, d, o, t = cfg.model, cfg.data, cfg.optim, cfg.trainer
    assert (m.lora.rank, m.lora.alpha, m.lora.dropout, m.lora.targets, m.use_te) == (8, None, 0.0, ["all"], False)
    assert (d.datasets, d.dataset_dir, d.template, d.max_length, d.max_samples) == (
        ["identity", "alpaca_en_demo"], "LLaMA-Factory/data", "qwen3_nothink", 2048, 1000)
    assert (d.batch_size, o.max_tokens_per_micro_batch) == (8, 2048)  # 1 x 8 accumulation x DP 1
    assert (o.lr, o.lr_decay, o.warmup_steps_ratio, o.weight_decay) == (1e-4, "cosine", 0.1, 0.0)
    assert (t.num_epochs, t.output_dir, t.log_every, t.save_freq, t.resume) == (
        3.0, "saves/qwen3-4b/lora/sft", 10, 500, "disable")  # overwrite_output_dir: true starts fresh
    assert (m.dtype, cfg.logging.plot, cfg.logging.tensorboard) == ("bfloat16", True, False)
    assert said == ["LLaMA-Factory keys with no effect here, ignored: trust_remote_code, preprocessing_num_workers, "
                    "dataloader_num_workers, save_only_model, ddp_timeout"]


def test_batch_size_counts_the_dp_ranks_and_our_dotted_keys_win(seed_yaml):
    assert lf_config(seed_yaml, ["parallel.tp=2"], world_size=2).data.batch_size == 8  # TP=2: DP 1
    assert lf_config(seed_yaml, [], world_size=2).data.batch_size == 16  # DP=2, as per-device batches add up
    cfg = lf_config(seed_yaml, ["optim.lr=3e-4", "learning_rate=2e-4", "max_steps=5",
                                "resume_from_checkpoint=true"])
    assert (cfg.optim.lr, cfg.trainer.total_steps, cfg.trainer.num_epochs, cfg.trainer.resume) == (3e-4, 5, None,
                                                                                                    "auto")


@pytest.mark.parametrize("override,message", [
    ("packing=true", "unknown key 'packing'"),
    ("template=llama3", "qwen3_nothink, qwen, default, alpaca"),
    ("lr_scheduler_type=polynomial", "cosine, linear, constant, constant_with_warmup"),
    ("report_to=wandb", "none or tensorboard"),
    ("stage=dpo", "stage: sft"),
    ("model_name_or_path=Qwen/Qwen3-4B-Instruct-2507", "huggingface-cli download"),
    ("lora_target=q_proj,qkv", "qkv"),
    ("finetuning_type=oft", "choose lora, full or freeze"),
])
def test_mistakes_are_refused_naming_the_key(seed_yaml, override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        lf_config(seed_yaml, [override])


def test_scheduler_kinds_and_our_own_yaml_passes_through(seed_yaml):
    assert lf_config(seed_yaml, ["lr_scheduler_type=constant"]).optim.warmup_steps_ratio == 0.0  # as there
    cfg = lf_config(seed_yaml, ["lr_scheduler_type=constant_with_warmup", "finetuning_type=full"])
    assert (cfg.optim.lr_decay, cfg.optim.warmup_steps_ratio, cfg.model.lora.rank) == ("constant", 0.1, 0)
    cfg = lf_config(seed_yaml, ["lora_rank=4", "lora_alpha=32", "lora_dropout=0.05", "lora_target=q_proj,v_proj"])
    assert (cfg.model.lora.rank, cfg.model.lora.alpha, cfg.model.lora.dropout, cfg.model.lora.targets) == (
        4, 32, 0.05, ["q_proj", "v_proj"])
    ours = lf_config(os.path.join(REPO, "examples", "sft_tiny_cpu.yaml"))
    plain = load_config(os.path.join(REPO, "examples", "sft_tiny_cpu.yaml"), cls=SFTConfig)
    assert ours == plain and plain.model.lora.rank == 0 and plain.data.template == ""


def test_freeze_takes_llamafactorys_keys_and_defaults(seed_yaml):
    """finetuning_type: freeze (once refused) sets model.freeze: LLaMA-Factory's defaults (the last 2 layers, all
    modules, no extras), its three keys as written, and its mistakes refused naming the choices."""
    m = lf_config(seed_yaml, ["finetuning_type=freeze"]).model
    assert (m.lora.rank, m.freeze.trainable_layers, m.freeze.trainable_modules, m.freeze.extra_modules) == (
        0, 2, ["all"], [])
    m = lf_config(seed_yaml, ["finetuning_type=freeze", "freeze_trainable_layers=-1",
                              "freeze_trainable_modules=mlp,self_attn", "freeze_extra_modules=embed_tokens,norm"]).model
    assert (m.freeze.trainable_layers, m.freeze.trainable_modules, m.freeze.extra_modules) == (
        -1, ["mlp", "self_attn"], ["embed_tokens", "norm"])
    assert not lf_config(seed_yaml, ["freeze_trainable_layers=4"]).model.freeze.enabled  # lora: ignored, as there
    for override, message in (("freeze_trainable_modules=q_proj", "self_attn, mlp, input_layernorm"),
                              ("freeze_extra_modules=lm_head,vision", "embed_tokens, norm, lm_head"),
                              ("freeze_trainable_layers=two", "freeze_trainable_layers: expected a number")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            lf_config(seed_yaml, ["finetuning_type=freeze", override])
    with pytest.raises(ConfigError, match="trains nothing"):
        load_config(None, ["model.freeze.trainable_layers=0"], cls=SFTConfig)
    with pytest.raises(ConfigError, match="two fine-tuning types"):
        load_config(None, ["model.freeze.trainable_layers=2", "model.lora.rank=8"], cls=SFTConfig)


def test_freeze_is_refused_by_rl():
    from megatron_searchr1.config import Config

    with pytest.raises(ConfigError, match="model.freeze .* is for SFT"):
        load_config(None, ["model.freeze.trainable_layers=2"], cls=Config).validate(check_files=False)


def test_lora_refuses_transformer_engine():
    with pytest.raises(ConfigError, match="use_te=false"):
        load_config(None, ["model.lora.rank=8", "model.use_te=true"], cls=SFTConfig)


def run_sft_cli(*args):
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run([sys.executable, "-m", "megatron_searchr1.sft", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_refuses_an_unknown_key_in_one_line(seed_yaml, tmp_path):
    raw = yaml.safe_load(open(seed_yaml))
    raw["neftune_noise_alpha"] = 5
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    proc = run_sft_cli(str(bad))
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: unknown key 'neftune_noise_alpha'"), proc.stderr
    assert "Traceback" not in proc.stderr
