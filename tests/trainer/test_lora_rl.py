"""LoRA RL (`model.lora` in the RL config; trainer/build.py, trainer/roles.py AdaptersOffReference, checkpoint.py).

Quick: the config refuses what LoRA cannot do with a line that says what to change; in one process (TP=1) the
reference, the actor with its adapters off, gives the base model's log-probs exactly while the actor's differ; a
LoRA checkpoint holds the adapters (not the base) and their optimizer state, and loads back into a fresh actor.
Slow (--runslow): 3 GRPO steps at TP=2 under torchrun with vLLM rollouts (lora_rl_script.py): only adapters change,
the base is bit-identical after RL, the optimizer holds only adapters, the reference gives a freshly loaded base
model's log-probs, the engine's log-probs after each sync equal the trainer's (merged weights), the HF export is
merged (base tensors elsewhere unchanged) with a PEFT adapter alongside; and a run stopped after 2 steps and
resumed gives the uninterrupted run's step 3.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_searchr1.config import ConfigError
from megatron_searchr1.config.rl import Config, LoraConfig, ModelConfig
from megatron_searchr1.megatron.batching import TrainSequence
from tests.dist_utils import REPO, rank_results
from tests.models.test_gpt import megatron_tp1  # noqa: F401  (fixture)
from tests.models.test_lora import random_adapter_state, save_hf
from tests.rl_fixtures import child_env, rl_root, run_module, server, tiny_model, world  # noqa: F401 (fixtures)
from tests.test_train import STEP_FIELDS_THAT_VARY, rl_args, step_metrics


# ------------------------------------------------------------------------------------------------ config
def test_lora_is_off_by_default_and_reads_llama_factory_values():
    assert not Config().model.lora.enabled
    lora = LoraConfig(rank=8, targets="q_proj, v_proj")
    assert lora.enabled and lora.targets == ["q_proj", "v_proj"]
    s = lora.settings()
    assert s.rank == 8 and s.alpha == 16 and s.projections == ("q_proj", "v_proj")


@pytest.mark.parametrize("kwargs, expected", [
    (dict(lora=LoraConfig(rank=4), use_te=True), "set model.use_te=false"),
    (dict(lora=LoraConfig(rank=4), ref_offload=True), "set model.ref_offload=false"),
])
def test_model_config_refuses_what_lora_cannot_do(kwargs, expected):
    with pytest.raises(ConfigError, match=expected):
        ModelConfig(**kwargs)


@pytest.mark.parametrize("kwargs, expected", [
    (dict(rank=-1), "model.lora.rank must be >= 0"),
    (dict(rank=4, targets=["lm_head"]), "model.lora targets"),
    (dict(rank=4, dropout=1.0), "model.lora dropout"),
])
def test_lora_config_errors_name_the_field(kwargs, expected):
    with pytest.raises(ConfigError, match=expected):
        LoraConfig(**kwargs)


def test_lora_overrides_from_the_command_line():
    from megatron_searchr1.config import load_config

    cfg = load_config(None, ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[q_proj,o_proj]"])
    assert cfg.model.lora.settings().scale == 2.0 and cfg.model.lora.targets == ["q_proj", "o_proj"]


def test_lora_config_is_checked_before_torch_loads():
    """A command line says what is wrong before its heavy imports: validating model.lora (rank > 0) must not pull
    in torch (it did through models/lora.py; the settings live in the torch-free models/lora_settings.py)."""
    import subprocess
    import sys

    code = ("import sys\nfrom megatron_searchr1.config import load_config\n"
            "cfg = load_config(None, ['model.lora.rank=8', 'model.lora.targets=[q_proj,v_proj]'])\n"
            "assert cfg.model.lora.settings().projections == ('q_proj', 'v_proj')\n"
            "print(sorted(m for m in ('torch', 'megatron', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------------------------------ TP=1
def _lora_policy(cfg, hf_dir, seed=0):
    """The actor as build_roles makes it under model.lora (base loaded, adapters, DDP, optimizer), with random
    nonzero adapters so the adapted model differs from the base."""
    from megatron_searchr1.models.convert import bind_mapping
    from megatron_searchr1.models.forward import unwrap
    from megatron_searchr1.models.gpt import model_settings
    from megatron_searchr1.models.lora import LoraSettings, apply_lora, load_adapter_state
    from megatron_searchr1.trainer.build import build_optimizer_from_config
    from megatron_searchr1.trainer.roles import Policy
    from megatron_searchr1.trainer.sources import weights_loader
    from megatron_searchr1.trainer.roles import build_actor

    load = weights_loader(cfg, hf_dir)

    def load_and_adapt(m):
        load(m)
        apply_lora(m, LoraSettings(rank=4, alpha=8))
        load_adapter_state(m, random_adapter_state(m, seed=seed, scale=0.2))

    settings = model_settings(cfg, tp=1, pp=1, params_dtype=torch.float32, use_te=False)
    actor = build_actor(cfg, **settings, load_weights=load_and_adapt)
    opt, sched = build_optimizer_from_config(actor, Config().optim, 10, 1e-3)
    return Policy(actor, opt, sched, mapping=bind_mapping(cfg, unwrap(actor)), hf_config=cfg, hf_dir=hf_dir,
                  source=hf_dir), settings, load


def _seqs(cfg, n=3):
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        prompt = torch.randint(0, cfg.vocab_size, (5 + i,), generator=g).tolist()
        response = torch.randint(0, cfg.vocab_size, (7 - i,), generator=g).tolist()
        out.append(TrainSequence(prompt_ids=prompt, response_ids=response, loss_mask=torch.ones(len(response))))
    return out


def test_reference_is_the_base_model_without_a_second_copy(tmp_path, megatron_tp1):
    from megatron_searchr1.models.lora import lora_parameters
    from megatron_searchr1.trainer.roles import AdaptersOffReference
    from megatron_searchr1.trainer.roles import Policy, build_reference

    cfg, _, hf_dir = save_hf(tmp_path)
    policy, settings, load = _lora_policy(cfg, hf_dir)
    reference = AdaptersOffReference(policy)
    base = build_reference(cfg, **settings, load_weights=load)  # what the reference was before LoRA RL
    seqs = _seqs(cfg)
    ref_lp = reference.log_probs(seqs, 512, 1.0)
    base_lp = Policy(base).log_probs(seqs, max_tokens_per_micro_batch=512)
    actor_lp = policy.log_probs(seqs, 512, 1.0)
    assert all(torch.equal(r, b) for r, b in zip(ref_lp, base_lp))
    assert max((a - b).abs().max().item() for a, b in zip(actor_lp, base_lp)) > 1e-3  # the adapters matter
    # the adapters are back on after the reference's forward, and they are all the optimizer holds
    assert all(torch.equal(a, b) for a, b in zip(policy.log_probs(seqs, 512, 1.0), actor_lp))
    held = sum(p.numel() for g in policy.optimizer.param_groups for p in g["params"])
    assert held == sum(p.numel() for p in lora_parameters(policy.model)) > 0
    assert reference.source == hf_dir


def test_reference_refuses_to_resume_on_another_base():
    """A resumed LoRA run rebuilds its base from today's model source: when that resolves to other weights than the
    run started from (the SFT run trained on), the reference (and the base) would change: refused, saying what to set."""
    from types import SimpleNamespace

    from megatron_searchr1.checkpoint import CheckpointError
    from megatron_searchr1.trainer.roles import AdaptersOffReference

    ref = AdaptersOffReference(SimpleNamespace(source="/runs/sft/checkpoints/step_000020/actor"))
    with pytest.raises(CheckpointError, match="set model.megatron_ckpt=/runs/sft/checkpoints/step_000010/actor"):
        ref.load_weights("/runs/sft/checkpoints/step_000010/actor")


def test_lora_checkpoint_holds_the_adapters_and_their_optimizer_state(tmp_path, megatron_tp1):
    """One optimizer step, save; a fresh actor (other adapters) loads the adapters and Adam's moments back, and its
    next step equals the saved actor's next step. The checkpoint has no base tensors and no converter metadata."""
    from megatron_searchr1.checkpoint import load_checkpoint, save_checkpoint
    from megatron_searchr1.models.lora import gather_adapter_state
    from megatron_searchr1.trainer.losses import masked_nll_loss, sft_sequence
    from megatron_searchr1.megatron.batching import make_micro_batches

    cfg, _, hf_dir = save_hf(tmp_path)
    seqs = [sft_sequence(s.prompt_ids + s.response_ids, [1] * 12) for s in _seqs(cfg)]
    mbs = make_micro_batches(seqs, 512)
    a, _, _ = _lora_policy(cfg, hf_dir, seed=0)
    a.update(mbs, masked_nll_loss)
    root = str(tmp_path / "ckpt")
    save_checkpoint(root, 1, {"actor": a.model}, {"actor": a.optimizer}, {"actor": a.scheduler},
                    hf_dirs={"actor": hf_dir})
    with open(os.path.join(root, "step_000001", "actor", "metadata.json")) as f:
        assert json.load(f)  # a dist checkpoint ...
    from megatron.core.dist_checkpointing import load_tensors_metadata

    keys = list(load_tensors_metadata(os.path.join(root, "step_000001", "actor")))
    assert keys and all(".lora.lora_" in k for k in keys), keys[:5]  # ... of the adapters only
    assert not os.path.exists(os.path.join(root, "step_000001", "actor", "searchr1_checkpoint.json"))
    # ... which is no model to start another run from: refused with what to use instead
    from megatron_searchr1.cli import UsageError
    from megatron_searchr1.trainer.sources import weights_loader

    with pytest.raises(UsageError, match="LoRA adapters only.*merged export"):
        weights_loader(cfg, root)

    b, _, _ = _lora_policy(cfg, hf_dir, seed=1)
    load_checkpoint(root, 1, {"actor": b.model}, {"actor": b.optimizer}, {"actor": b.scheduler})
    saved, loaded = gather_adapter_state(a.model), gather_adapter_state(b.model)
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    a.update(mbs, masked_nll_loss)
    b.update(mbs, masked_nll_loss)  # Adam's moments came back too, or this step would differ
    after_a, after_b = gather_adapter_state(a.model), gather_adapter_state(b.model)
    assert all(torch.equal(after_a[k], after_b[k]) for k in after_a)
    assert any(not torch.equal(after_a[k], saved[k]) for k in saved)


# ------------------------------------------------------------------------------------------------ slow: GRPO TP=2
LORA = ("model.lora.rank=4", "model.lora.alpha=8", "optim.lr=1e-2")


@pytest.fixture(scope="module")
def lora_run(world, tiny_model, server, rl_root):
    out = os.path.join(rl_root, "grpo_lora")
    args = rl_args(world, tiny_model, server, out, "trainer.total_steps=3", *LORA)
    proc = run_module("tests.trainer.lora_rl_script", args, nproc=2, timeout=1200)
    log = proc.stdout + proc.stderr
    return out, rank_results(log), log



def test_results_are_read_from_shared_lines():
    log = 'x\nRESULT {"rank": 0, "a": 1}RESULT {"rank": 1, "a": 2}\nRESULT {"rank": 2}\n'
    assert [r["rank"] for r in rank_results(log)] == [0, 1, 2]


@pytest.mark.slow
def test_grpo_lora_tp2_trains_only_adapters_and_syncs_merged_weights(lora_run, tiny_model):
    from safetensors.torch import load_file

    from megatron_searchr1.metrics import read_scalars

    out, results, log = lora_run
    assert {r["rank"] for r in results} == {0, 1}, log[-3000:]
    for r in results:
        assert r["base_identical"] and r["base_tensors"] > 0, r
        assert r["adapters_moved"], r
        assert r["optimizer_numel"] == r["adapter_numel"] > 0, r
        assert r["ref_vs_base"] == 0.0 and r["actor_vs_base"] > 1e-4, r
        assert r["ref_model"] is None, r
    scalars = read_scalars(os.path.join(out, "tensorboard"))
    assert [s for s, _ in scalars["reward/mean"]] == [1, 2, 3]
    assert "actor/kl_loss" in scalars
    # the engine was synced with base + B·A: its log-probs equal the trainer's (adapters on), every step, also after
    # the updates moved the adapters
    gaps = [v for _, v in scalars["train/logprob_gap_engine"]]
    assert len(gaps) == 3 and all(v < 1e-3 for v in gaps), gaps
    # the export is the merged model: the adapted projections moved, everything else is the base's tensor
    merged, base = load_file(os.path.join(out, "hf", "model.safetensors")), load_file(
        os.path.join(tiny_model, "model.safetensors"))
    adapted = [n for n in base if n.endswith(("q_proj.weight", "o_proj.weight", "down_proj.weight"))]
    assert adapted and all(not torch.equal(merged[n], base[n]) for n in adapted)
    assert all(torch.equal(merged[n], base[n]) for n in base if "proj" not in n)
    adapter_dir = os.path.join(out, "hf_adapter")
    assert os.path.isfile(os.path.join(adapter_dir, "adapter_config.json"))
    assert os.path.isfile(os.path.join(adapter_dir, "adapter_model.safetensors"))


@pytest.mark.slow
def test_grpo_lora_resume_reproduces_the_next_step(lora_run, world, tiny_model, server, rl_root):
    """2 steps, stop, resume to 3: step 3 equals the uninterrupted run's (adapters + Adam state from the checkpoint,
    the base from the pinned start)."""
    reference, _, _ = lora_run
    out = os.path.join(rl_root, "grpo_lora_resumed")
    for steps in (2, 3):
        proc = run_module("megatron_searchr1.train", rl_args(world, tiny_model, server, out, f"trainer.total_steps={steps}",
                                                             "trainer.export_hf=false", *LORA), nproc=2, timeout=1200)
    assert "at step 2" in proc.stdout + proc.stderr
    want, got = step_metrics(reference), step_metrics(out)
    assert sorted(got) == [1, 2, 3]
    keys = [k for k in want[3] if not k.startswith(STEP_FIELDS_THAT_VARY)]
    diff = {k: (want[3][k], got[3].get(k)) for k in keys if want[3][k] != got[3].get(k)}
    assert not diff, f"step 3 differs: {diff}"
    assert want[3]["actor/entropy"] != want[1]["actor/entropy"]  # the steps moved the policy: not vacuous


def test_example_lora_recipe_loads():
    from megatron_searchr1.config import load_config

    cfg = load_config(os.path.join(REPO, "examples", "grpo_lora_tiny_cpu.yaml"))
    cfg.validate(world_size=2, check_files=False)
    assert cfg.model.lora.enabled and cfg.algo.use_kl_loss and cfg.model.lora.settings().scale == 2.0
