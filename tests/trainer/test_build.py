"""trainer/build.py: the one optimizer + LR-schedule setup the actor, the critic and the SFT model share."""
import pytest
import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

import megatron_searchr1.trainer.build as build
import megatron_searchr1.trainer.sft as sft
from megatron_searchr1.config import Config, SFTConfig, load_config


def _torch_optimizer(model, *, lr, min_lr, warmup_steps, decay_steps, decay_style, **_):
    """megatron/optimizer.py's schedule on a plain torch optimizer (no Megatron DDP model needed)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = OptimizerParamScheduler(opt, init_lr=0.0 if warmup_steps > 0 else lr, max_lr=lr, min_lr=min_lr,
                                    lr_warmup_steps=warmup_steps, lr_decay_steps=decay_steps,
                                    lr_decay_style=decay_style, start_wd=0.0, end_wd=0.0, wd_incr_steps=decay_steps,
                                    wd_incr_style="constant")
    return opt, sched


@pytest.mark.parametrize("cls", [Config, SFTConfig])
def test_the_first_step_trains_at_lr_over_warmup_not_zero(monkeypatch, cls):
    """Megatron's warmup starts at LR 0: the shared setup steps the schedule once, so with 4 warmup steps the first
    step trains at lr/4. SFT builds its optimizer here too (before, its first step had LR 0)."""
    monkeypatch.setattr(build, "build_optimizer", _torch_optimizer)
    cfg = load_config(None, ["optim.lr=1e-3", "optim.warmup_steps_ratio=0.4", "trainer.total_steps=10"], cls=cls)
    opt, sched = build.build_optimizer_from_config(None, cfg.optim, cfg.trainer.total_steps, cfg.optim.lr)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 / 4)
    sched.step(1)
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-3 / 4)
    assert sft.build_optimizer_from_config is build.build_optimizer_from_config  # the SFT trainer uses this one


def test_no_warmup_starts_at_lr(monkeypatch):
    monkeypatch.setattr(build, "build_optimizer", _torch_optimizer)
    cfg = load_config(None, ["optim.lr=1e-3", "optim.warmup_steps_ratio=0", "trainer.total_steps=10"])
    opt, _ = build.build_optimizer_from_config(None, cfg.optim, cfg.trainer.total_steps, cfg.optim.lr)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3)


@pytest.mark.parametrize("cls", [Config, SFTConfig])
def test_actor_settings_refuse_what_an_moe_model_cannot_do(cls):
    """RL and SFT build their models through build.actor_settings: LoRA on an MoE model, and an MoE model under TP
    without sequence parallelism, are one-line UsageErrors naming the setting, not tracebacks from every rank."""
    from transformers import Qwen2Config, Qwen3MoeConfig

    from megatron_searchr1.cli import UsageError

    moe = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=4, num_experts_per_tok=2)
    dense = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    lora = load_config(None, ["model.path=/m", "model.lora.rank=4"], cls=cls)
    with pytest.raises(UsageError, match=r"mixture-of-experts.*model\.lora\.rank=0"):
        build.actor_settings(lora, moe, torch.float32)
    assert build.actor_settings(lora, dense, torch.float32)["use_te"] is False  # LoRA: the local spec
    tp2 = load_config(None, ["model.path=/m", "parallel.tp=2"], cls=cls)
    with pytest.raises(UsageError, match="sequence_parallel=true"):
        build.actor_settings(tp2, moe, torch.float32)
    plain = load_config(None, ["model.path=/m"], cls=cls)
    assert build.actor_settings(plain, moe, torch.float32)["config"].num_moe_experts == 4
