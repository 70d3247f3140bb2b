"""LoRA on Megatron's parallel linears (models/lora.py) and its two exports (models/lora_export.py).

At TP=1 in this process: the adapted model equals the base with merged weights; a `q_proj`-only adapter touches only
Q's rows; a fresh adapter (B = 0) leaves the output unchanged; only adapters get gradients, and Megatron's DDP and
optimizer hold exactly the adapters' numel; PEFT loads our adapter onto the HF base with the same logits, as does
the merged HF export. Under torchrun at TP=2 (lora_tp_script.py): the sharded model gives the TP=1 logits and
adapter gradients (also with sequence parallelism, and at PP=2), its exports load in HF with the same logits, and
adapter-only checkpoints move between TP=1, TP=2 and PP=2.
"""
from __future__ import annotations

import json

import pytest
import torch

from megatron_searchr1.models.lora import (
    LoraSettings, adapter_sharded_state_dict, adapters, apply_lora, column_layout, disable_adapters,
    gather_adapter_state, is_lora_param, load_adapter_state, lora_parameters, merged_weights,
)
from tests.dist_utils import run_torchrun
from tests.models.test_gpt import megatron_tp1, tiny_hf_model  # noqa: F401  (megatron_tp1 is a fixture)

TOL = 1e-5
ALL = ("all",)


# ------------------------------------------------------------------------------------------------ helpers
def save_hf(tmp_path, kind="qwen3"):
    """A tiny random HF model written to disk (qwen3: GQA 4 query heads / 2 groups, q/k norms, head_dim 32)."""
    cfg, model = tiny_hf_model(kind)
    path = tmp_path / f"hf_{kind}"
    model.save_pretrained(path)
    return cfg, model, str(path)


def build_base(cfg, hf_dir, **config_overrides):
    """A Megatron model at the current TP/PP, filled from `hf_dir` through the family mapping."""
    from megatron_searchr1.models.convert import SafetensorsReader, bind_mapping, load_hf_weights
    from megatron_searchr1.models.gpt import build_gpt_model, parallel_sizes, transformer_config_from_hf

    tp, pp = parallel_sizes()
    config = transformer_config_from_hf(cfg, tp=tp, pp=pp, **config_overrides)
    model = build_gpt_model(cfg, config=config, use_te=False)
    load_hf_weights(model, SafetensorsReader(hf_dir), bind_mapping(cfg, model))
    return model


def random_adapter_state(model, seed=0, scale=0.05):
    """Full adapter tensors (gather_adapter_state's names and shapes), random, B nonzero."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, t in sorted(gather_adapter_state(model).items()):
        state[name] = scale * torch.randn(t.shape, generator=g)
    return state


def sample_ids(cfg, batch=2, seq=16, seed=1):
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def logits_of(model, ids):
    """(B, T, V) full-vocabulary logits, differentiable (train-mode forward, no pipeline schedule)."""
    out = model(ids, None, None, runtime_gather_output=True)
    return out[..., : getattr(model, "module", model).hf_vocab_size]


def loss_of(logits, seed=2):
    """A fixed random linear functional of the logits: its gradient reaches every adapter."""
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed))
    return (logits.float() * w).sum()


def lora_model(cfg, hf_dir, settings, seed=0, **config_overrides):
    model = build_base(cfg, hf_dir, **config_overrides)
    apply_lora(model, settings)
    state = random_adapter_state(model, seed)
    load_adapter_state(model, state)
    return model, state


# ------------------------------------------------------------------------------------------------ settings
def test_settings_read_llama_factory_values():
    s = LoraSettings(rank=8, targets="q_proj, v_proj")
    assert s.targets == ("q_proj", "v_proj") and s.alpha == 16 and s.scale == 2.0
    assert LoraSettings(rank=4, alpha=8).projections == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj")
    with pytest.raises(ValueError, match="lm_head"):
        LoraSettings(targets=("lm_head",))
    with pytest.raises(ValueError, match="rank"):
        LoraSettings(rank=0)
    with pytest.raises(ValueError, match="dropout"):
        LoraSettings(dropout=1.0)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_layout_finds_each_projections_rows_in_the_weight_shard(tp):
    """Interleave real HF q/k/v and gate/up tensors as the converter does, split them over TP, and check the layout
    recovers every projection row from each rank's shard (ng=2 < tp=4 included: a rank holds part of one group)."""
    from types import SimpleNamespace

    from megatron_searchr1.models.families import interleave_qkv, stack_gate_up, tp_split

    cfg = SimpleNamespace(num_attention_heads=4, num_query_groups=2, kv_channels=8, ffn_hidden_size=24)
    g = torch.Generator().manual_seed(0)
    hf = {"q_proj": torch.randn(32, 5, generator=g), "k_proj": torch.randn(16, 5, generator=g),
          "v_proj": torch.randn(16, 5, generator=g), "gate_proj": torch.randn(24, 5, generator=g),
          "up_proj": torch.randn(24, 5, generator=g)}
    fused = {"self_attention.linear_qkv": interleave_qkv(hf["q_proj"], hf["k_proj"], hf["v_proj"], 4, 2),
             "mlp.linear_fc1": stack_gate_up(hf["gate_proj"], hf["up_proj"])}
    for suffix, full in fused.items():
        seen = {}
        for rank in range(tp):
            shard = tp_split(f"decoder.layers.0.{suffix}.weight", full, tp)[rank]
            layout = column_layout(suffix, cfg, tp, rank)
            assert sorted(torch.cat([pos for pos, _ in layout.values()]).tolist()) == list(range(shard.shape[0]))
            for p, (pos, rows) in layout.items():
                assert torch.equal(shard[pos], hf[p][rows])
                seen.setdefault(p, []).extend(rows.tolist())
        assert all(sorted(v) == list(range(hf[p].shape[0])) for p, v in seen.items())


# ------------------------------------------------------------------------------------------------ TP=1
def test_fresh_adapter_leaves_the_output_unchanged(tmp_path, megatron_tp1):
    cfg, _, hf_dir = save_hf(tmp_path)
    base = build_base(cfg, hf_dir)
    ids = sample_ids(cfg)
    with torch.no_grad():
        ref = logits_of(base, ids)
        apply_lora(base, LoraSettings(rank=4, targets=ALL))
        assert all(torch.count_nonzero(b) == 0 for _, a in adapters(base) for b in a.lora_B.values())
        assert all(torch.count_nonzero(a_) > 0 for _, a in adapters(base) for a_ in a.lora_A.values())
        assert torch.equal(logits_of(base, ids), ref)


def test_lora_logits_equal_the_merged_model_and_disable_gives_the_base(tmp_path, megatron_tp1):
    cfg, _, hf_dir = save_hf(tmp_path)
    settings = LoraSettings(rank=4, alpha=12, targets=ALL)
    model, _ = lora_model(cfg, hf_dir, settings)
    ids = sample_ids(cfg)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not is_lora_param(n)}
    merged = build_base(cfg, hf_dir)
    merged.load_state_dict(dict(merged_weights(model)), strict=False)
    plain = build_base(cfg, hf_dir)
    with torch.no_grad():
        lora_out, merged_out, plain_out = logits_of(model, ids), logits_of(merged, ids), logits_of(plain, ids)
        with disable_adapters(model):
            disabled_out = logits_of(model, ids)
        again = logits_of(model, ids)
    assert (lora_out - plain_out).abs().max() > 1e-2  # the adapter does something
    assert (lora_out - merged_out).abs().max() <= TOL
    assert torch.equal(disabled_out, plain_out) and torch.equal(again, lora_out)
    # merged_weights left the base in place
    assert all(torch.equal(p, base_before[n]) for n, p in model.named_parameters() if not is_lora_param(n))


def test_q_proj_only_adapter_changes_only_q_rows(tmp_path, megatron_tp1):
    from megatron_searchr1.models.families import deinterleave_qkv

    cfg, _, hf_dir = save_hf(tmp_path)
    model, _ = lora_model(cfg, hf_dir, LoraSettings(rank=4, targets=("q_proj",)))
    merged = dict(merged_weights(model))
    changed = []
    for n, p in model.named_parameters():
        if is_lora_param(n):
            continue
        if n.endswith("linear_qkv.weight"):
            dq, dk, dv = deinterleave_qkv(merged[n] - p.detach(), cfg.num_attention_heads, cfg.num_key_value_heads)
            assert dq.abs().min(dim=1).values.gt(0).all(), "every q row should move"
            assert torch.count_nonzero(dk) == 0 and torch.count_nonzero(dv) == 0
            changed.append(n)
        else:
            assert torch.equal(merged[n], p.detach()), n
    assert len(changed) == cfg.num_hidden_layers


def test_only_adapters_get_gradients(tmp_path, megatron_tp1):
    cfg, _, hf_dir = save_hf(tmp_path)
    model, _ = lora_model(cfg, hf_dir, LoraSettings(rank=4, targets=ALL))
    loss_of(logits_of(model, sample_ids(cfg))).backward()
    for n, p in model.named_parameters():
        if is_lora_param(n):
            assert p.requires_grad and p.grad is not None and p.grad.abs().sum() > 0, n
        else:
            assert not p.requires_grad and p.grad is None, n


def test_dropout_applies_to_the_adapter_input_only(tmp_path, megatron_tp1):
    """In training a linear computes W x + scale * B A dropout(x), with dropout's mask drawn from torch's RNG."""
    cfg, _, hf_dir = save_hf(tmp_path)
    model, _ = lora_model(cfg, hf_dir, LoraSettings(rank=4, dropout=0.5, targets=("o_proj", "q_proj")))
    layers = model.decoder.layers
    for linear in (layers[0].self_attention.linear_proj, layers[1].self_attention.linear_qkv):
        x = torch.randn(5, 2, linear.weight.shape[1])
        torch.manual_seed(7)
        train_out, _ = linear.train()(x)
        torch.manual_seed(7)
        dropped = torch.nn.functional.dropout(x, p=0.5, training=True)
        with torch.no_grad():
            delta_w = linear.lora.delta_weight()  # scale * B A in this linear's output layout
        assert (train_out - (x @ linear.weight.T + dropped @ delta_w.T)).abs().max() <= TOL
        eval_out, _ = linear.eval()(x)
        assert (eval_out - (x @ linear.weight.T + x @ delta_w.T)).abs().max() <= TOL
        assert (eval_out - train_out).abs().max() > 1e-3


def test_ddp_and_optimizer_hold_only_the_adapters(tmp_path, megatron_tp1):
    """Megatron DDP's gradient buffers and the Adam state cover exactly the adapters' numel (base frozen)."""
    from megatron_searchr1.megatron.optimizer import build_optimizer, wrap_ddp

    cfg, _, hf_dir = save_hf(tmp_path)
    model, _ = lora_model(cfg, hf_dir, LoraSettings(rank=4, targets=ALL))
    n_lora = sum(p.numel() for p in lora_parameters(model))
    n_all = sum(p.numel() for p in model.parameters())
    ddp = wrap_ddp(model)
    optimizer, _ = build_optimizer(ddp, lr=1e-3)
    grad_numel = sum(b.grad_data.numel() for b in ddp.buffers + ddp.expert_parallel_buffers)
    opt_params = [p for g in optimizer.param_groups for p in g["params"]]
    assert grad_numel == n_lora == sum(p.numel() for p in opt_params) and n_lora < n_all / 10
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    loss_of(logits_of(ddp, sample_ids(cfg))).backward()
    ddp.finish_grad_sync()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ok, _, _ = optimizer.step()
    assert ok
    state = [t for s in optimizer.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    assert sum(t.numel() for t in state) == 2 * n_lora  # exp_avg and exp_avg_sq, adapters only
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) != is_lora_param(n), n


@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama"])  # q/k norms; qkv bias; tied embeddings
def test_peft_adapter_and_merged_export_give_the_same_logits(tmp_path, megatron_tp1, kind):
    """PeftModel.from_pretrained(hf_base, our adapter dir) == our LoRA model == our merged HF export (fp32)."""
    from megatron_searchr1.models.lora_export import export_merged_hf, read_peft_adapter, write_peft_adapter

    cfg, _, hf_dir = save_hf(tmp_path, kind)
    settings = LoraSettings(rank=4, alpha=8, dropout=0.1, targets=("q_proj", "v_proj", "o_proj", "down_proj",
                                                                   "gate_proj"))
    model, state = lora_model(cfg, hf_dir, settings)
    ids = sample_ids(cfg)
    with torch.no_grad():
        ours = logits_of(model.eval(), ids)
    write_peft_adapter(model, str(tmp_path / "adapter"), base_model_name_or_path=hf_dir)
    export_merged_hf(model, cfg, hf_dir, str(tmp_path / "merged"))
    peft_logits, merged_logits = hf_logits(hf_dir, str(tmp_path / "adapter"), str(tmp_path / "merged"), ids)
    assert (ours - peft_logits).abs().max() <= TOL
    assert (ours - merged_logits).abs().max() <= TOL
    cfg_json = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (cfg_json["r"], cfg_json["lora_alpha"], cfg_json["peft_type"], cfg_json["task_type"]) == (
        4, 8, "LORA", "CAUSAL_LM")
    back_settings, back = read_peft_adapter(str(tmp_path / "adapter"))
    assert (back_settings.rank, back_settings.alpha, back_settings.dropout, back_settings.projections) == (
        settings.rank, settings.alpha, settings.dropout, settings.projections)
    assert sorted(k.removeprefix("base_model.model.") for k in back) == sorted(state)
    assert all(torch.equal(back["base_model.model." + k], v) for k, v in state.items())


def hf_logits(hf_dir, adapter_dir, merged_dir, ids):
    """Logits of PEFT's model (HF base + our adapter) and of the merged HF export, fp32, eval."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, adapter_dir).eval()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return peft_model(ids).logits.float(), merged(ids).logits.float()


# ------------------------------------------------------------------------------------------------ TP=2
@pytest.mark.slow
def test_tp2_and_pp2_match_tp1_logits_grads_and_exports(tmp_path, megatron_tp1):
    """torchrun, 2 ranks, TP=2 (also with sequence parallelism) and PP=2: logits and gathered adapter gradients
    equal TP=1's; the PEFT adapters and merged exports written at TP=2 and at PP=2 load in HF with TP=1's logits;
    adapter checkpoints (dist_checkpointing, adapters only) move between TP=1, TP=2 and PP=2."""
    from pathlib import Path

    from megatron.core import dist_checkpointing

    cfg, _, hf_dir = save_hf(tmp_path)
    settings = LoraSettings(rank=4, alpha=8, targets=ALL)
    model, state = lora_model(cfg, hf_dir, settings)
    ids = sample_ids(cfg)
    logits = logits_of(model, ids)
    loss_of(logits).backward()
    grads = gather_adapter_state(model, grad=True)
    torch.save(dict(state=state, ids=ids), tmp_path / "inputs.pt")
    (tmp_path / "ckpt_tp1").mkdir()
    dist_checkpointing.save(adapter_sharded_state_dict(model), str(tmp_path / "ckpt_tp1"))
    script = Path(__file__).with_name("lora_tp_script.py")
    out = run_torchrun(script, 2, "--hf-dir", hf_dir, "--inputs", str(tmp_path / "inputs.pt"),
                       "--out", str(tmp_path / "tp2"), "--ckpt", str(tmp_path / "ckpt_tp1"), timeout=900)
    for case in ("tp2", "tp2sp", "pp2"):
        got = torch.load(tmp_path / "tp2" / f"{case}.pt")
        assert (got["logits"] - logits.detach()).abs().max() <= TOL, case
        assert sorted(got["grads"]) == sorted(grads), case
        for n, g in grads.items():
            assert (got["grads"][n] - g).abs().max() <= 1e-4 * max(1.0, g.abs().max().item()), (case, n)
    for prefix in ("", "pp2_"):
        peft_logits, merged_logits = hf_logits(hf_dir, str(tmp_path / "tp2" / f"{prefix}adapter"),
                                               str(tmp_path / "tp2" / f"{prefix}merged"), ids)
        assert (peft_logits - logits.detach()).abs().max() <= TOL, prefix
        assert (merged_logits - logits.detach()).abs().max() <= TOL, prefix
    assert "LORA_TP_OK" in out
    # the adapter checkpoint written at TP=2 loads at TP=1 with the same tensors
    fresh = build_base(cfg, hf_dir)
    apply_lora(fresh, settings)
    loaded = dist_checkpointing.load(adapter_sharded_state_dict(fresh), str(tmp_path / "tp2" / "ckpt_tp2"))
    result = fresh.load_state_dict(loaded, strict=False)
    assert not [k for k in result.missing_keys if is_lora_param(k)] and not result.unexpected_keys
    back = gather_adapter_state(fresh)
    assert sorted(back) == sorted(state) and all(torch.equal(back[k], v) for k, v in state.items())
