"""trainer/build.py: the one optimizer + LR-schedule setup the actor, the critic and the SFT model share."""
import pytest
import torch

import megatron_searchr1.trainer.build as build
import megatron_searchr1.trainer.sft as sft
from megatron_searchr1.config import Config, SFTConfig, load_config


@pytest.fixture
def plain_optimizer(monkeypatch):
    """megatron/optimizer.py's build_optimizer, schedule and all, with Megatron's optimizer replaced by a plain
    torch SGD over one parameter (no DDP model needed); the model is the two config objects it reads."""
    from types import SimpleNamespace

    import megatron_searchr1.megatron.optimizer as mopt

    def sgd(opt_config, models):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=opt_config.lr)
        opt.scale_loss = lambda loss: loss
        return opt

    monkeypatch.setattr(mopt, "get_megatron_optimizer", sgd)
    return SimpleNamespace(config=SimpleNamespace(bf16=False, fp16=False, params_dtype=torch.float32),
                           ddp_config=SimpleNamespace(use_distributed_optimizer=False))


@pytest.mark.parametrize("cls", [Config, SFTConfig])
def test_the_first_step_trains_at_lr_over_warmup_not_zero(plain_optimizer, cls):
    """Megatron's warmup starts at LR 0: the shared setup steps the schedule once, so with 4 warmup steps the first
    step trains at lr/4. SFT builds its optimizer here too. The expected LRs are counted by hand: warmup =
    0.4 * 10 steps = 4, so steps 1..4 train at 1e-3 * k/4, then 1e-3 (constant)."""
    cfg = load_config(None, ["optim.lr=1e-3", "optim.warmup_steps_ratio=0.4", "trainer.total_steps=10",
                             "optim.lr_decay=constant"], cls=cls)
    opt, sched = build.build_optimizer_from_config(plain_optimizer, cfg.optim, cfg.trainer.total_steps, cfg.optim.lr)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(4):
        sched.step(1)
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == pytest.approx([0.00025, 0.0005, 0.00075, 0.001, 0.001])
    assert sft.build_optimizer_from_config is build.build_optimizer_from_config  # the SFT trainer uses this one


def test_no_warmup_starts_at_lr(plain_optimizer):
    cfg = load_config(None, ["optim.lr=1e-3", "optim.warmup_steps_ratio=0", "trainer.total_steps=10"])
    opt, _ = build.build_optimizer_from_config(plain_optimizer, cfg.optim, cfg.trainer.total_steps, cfg.optim.lr)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.001)


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


def test_load_data_reports_and_refuses_what_cannot_fill_a_batch(tmp_path, capsys):
    """build.load_data: one line per file on the console; a training set that cannot fill one batch is a
    UsageError naming data.train_files and the batch size (not a None sampler that crashes later)."""
    from megatron_searchr1.cli import UsageError
    from megatron_searchr1.data.qa import make_row, write_rows
    from megatron_searchr1.models.tiny import TinyModelConfig, train_tokenizer

    tok = train_tokenizer(TinyModelConfig(output_dir=str(tmp_path / "tok"), vocab_size=300))
    train, val = str(tmp_path / "train.parquet"), str(tmp_path / "val.parquet")
    write_rows([make_row(f"who founded acme {i}", ["Bo"], "nq", "train", i, uid=f"t{i}") for i in range(3)], train)
    write_rows([make_row("who founded acme", ["Bo"], "nq", "test", 0, uid="v0")], val)
    cfg = load_config(None, [f"data.train_files=[{train}]", f"data.val_files=[{val}]", "data.train_batch_size=2",
                             "data.max_prompt_length=4096"])
    data = build.load_data(cfg, tok, log=True)
    assert len(data.train) == 3 and len(data.val) == 1 and data.sampler.next_batch()
    assert capsys.readouterr().out.splitlines() == [f"data: {train}: 3 rows, 0 dropped, 3 used",
                                                    f"data: {val}: 1 rows, 0 dropped, 1 used"]
    cfg.data.train_batch_size = 4
    with pytest.raises(UsageError, match=r"data.train_files: 3 prompts cannot fill one batch of "
                                         r"data.train_batch_size=4"):
        build.load_data(cfg, tok, log=False)
    cfg.data.train_batch_size, cfg.data.max_prompt_length = 2, 8
    with pytest.raises(UsageError, match=r"data.train_files: no usable prompt: all are longer than "
                                         r"data.max_prompt_length=8 tokens \(the longest has \d+\)"):
        build.load_data(cfg, tok, log=False)


def test_load_tokenizer_refuses_what_cannot_drive_the_model(tmp_path):
    from transformers import Qwen2Config

    from megatron_searchr1.cli import UsageError
    from megatron_searchr1.models.tiny import TinyModelConfig, train_tokenizer

    path = str(tmp_path / "tok")
    tok = train_tokenizer(TinyModelConfig(output_dir=path, vocab_size=300))
    tok.chat_template = None
    tok.save_pretrained(path)
    fits = Qwen2Config(vocab_size=len(tok) + 64)
    assert len(build.load_tokenizer(path, fits)) == len(tok)
    with pytest.raises(UsageError, match=rf"has {len(tok)} tokens but the model's vocab_size is {len(tok) - 1}"):
        build.load_tokenizer(path, Qwen2Config(vocab_size=len(tok) - 1))
    with pytest.raises(UsageError, match="data.chat_template=always but the tokenizer"):
        build.load_tokenizer(path, fits, chat_template="always")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(path)
    assert build.load_tokenizer(path, fits, chat_template="always").chat_template == tok.chat_template
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UsageError, match="has no tokenizer files"):
        build.load_tokenizer(str(empty), fits)


@pytest.mark.parametrize("flags", [{}, {"param_offload": True, "grad_offload": True, "optimizer_offload": True}])
def test_the_engine_is_built_after_the_offload_and_sleeps_before_the_state_returns(flags):
    """vLLM measures the free GPU memory while it builds the engine: with offload flags on, the trainer's state is
    offloaded before the engine is built (verl's order), then the engine sleeps and the state comes back; without
    flags nothing moves and the engine stays as built."""
    from types import SimpleNamespace

    from megatron_searchr1.megatron.offload import GenerationOffload

    calls = []

    class Recorded(GenerationOffload):
        def before_wake(self):
            calls.append("offload state")

        def after_sync(self):
            calls.append("offload params") if self.params else None

        def reload(self):
            calls.append("reload")
            return {}

    cfg = SimpleNamespace(param_offload=False, grad_offload=False, optimizer_offload=False, ref_offload=False)
    offload = Recorded(SimpleNamespace(**{**vars(cfg), **flags}), actor=None, actor_opt=None)

    class Worker:
        def __init__(self, engine):
            calls.append(f"worker over {engine}")

        def sleep(self):
            calls.append("engine sleeps")
            offload.reload()

    build.start_rollout(offload, lambda: calls.append("build engine") or "engine", Worker)
    if flags:
        assert calls == ["offload state", "offload params", "build engine", "worker over engine", "engine sleeps",
                         "reload"]
    else:
        assert calls == ["build engine", "worker over engine"]
