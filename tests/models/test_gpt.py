"""GPTModel from HF configs: config translation and its errors, and logits equal to `transformers` (fp32, 1e-4).

The HF -> Megatron weight copy here is a small direct one, written from the documented layouts in gpt.py
(the real mapping lives in models/families/ and has its own tests). This file is also the torchrun worker
for the 2-process TP=2 / PP=2 checks: `python -m torch.distributed.run --nproc_per_node 2 test_gpt.py OUT`.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

if __name__ == "__main__":  # torchrun worker: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from transformers import LlamaConfig, Qwen2Config

from megatron_searchr1.models.families import get_family
from megatron_searchr1.models.families.dims import rope_settings
from megatron_searchr1.models.gpt import (
    SUPPORTED_ARCHITECTURES,
    build_gpt_model,
    padded_vocab_size,
    transformer_config_from_hf,
    uses_te_spec,
)


def model_family(cfg) -> str:
    return get_family(cfg).model_types[0]

VOCAB = 250  # not a multiple of 128: exercises vocab padding and trimming
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)


def tiny_config(kind: str, **kw):
    """Tiny HF configs: 'qwen2' (untied, qkv bias), 'qwen2kv1' (qwen2 with one KV head: replicated at TP=2),
    'llama' (tied), 'llama3rope' (tied, llama3 RoPE scaling)."""
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if kind == "qwen2":
        return Qwen2Config(**{**base, "tie_word_embeddings": False, **kw})
    if kind == "qwen3":  # q/k norms, head_dim 32 != hidden / heads
        from transformers import Qwen3Config

        return Qwen3Config(**{**base, "tie_word_embeddings": False, "head_dim": 32, **kw})
    if kind == "mistral":
        from transformers import MistralConfig

        return MistralConfig(**{**base, "tie_word_embeddings": False, "head_dim": 16, "sliding_window": None, **kw})
    if kind == "qwen2kv1":
        return Qwen2Config(**{**base, "tie_word_embeddings": False, "num_key_value_heads": 1, **kw})
    if kind == "llama":
        return LlamaConfig(**{**base, "tie_word_embeddings": True, **kw})
    if kind == "llama3rope":
        return LlamaConfig(**{**base, "tie_word_embeddings": True, "max_position_embeddings": 16384,
                              "rope_parameters": dict(LLAMA3_ROPE), **kw})
    raise ValueError(kind)


def tiny_hf_model(kind: str, seed: int = 0):
    """A deterministic random HF model with every tensor (biases, norms too) far from its default init."""
    cfg = tiny_config(kind)
    torch.manual_seed(seed)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return cfg, model


def hf_to_megatron_state(hf_model, cfg, *, vocab_pad: int, tp_rank=0, tp=1, pp_rank=0, pp=1, swap_kv=False):
    """This (TP, PP) rank's local-spec state dict from an HF Qwen2/Llama model (stage-local layer indices)."""
    sd = hf_model.state_dict()
    nq, ng = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // nq

    def shard(t, dim):
        return t.chunk(tp, dim=dim)[tp_rank].clone()

    def pad(t):
        out = torch.zeros(vocab_pad, t.shape[1], dtype=t.dtype)
        out[: t.shape[0]] = t
        return out

    def per_group(q, k, v):  # rows per query group: [q heads of the group, k, v]; rows split over TP (a rank
        if swap_kv:          # holds whole groups, or a slice of one group when ng < tp)
            k, v = v, k
        full = torch.cat([q.reshape(ng, (nq // ng) * d, -1), k.reshape(ng, d, -1), v.reshape(ng, d, -1)], dim=1)
        return shard(full.reshape(-1, full.shape[-1]), 0).squeeze(-1)

    per_stage = cfg.num_hidden_layers // pp
    first, last = pp_rank == 0, pp_rank == pp - 1
    out = {}
    if first:
        out["embedding.word_embeddings.weight"] = shard(pad(sd["model.embed_tokens.weight"]), 0)
    if last:
        out["decoder.final_layernorm.weight"] = sd["model.norm.weight"].clone()
        head = sd["model.embed_tokens.weight"] if cfg.tie_word_embeddings else sd["lm_head.weight"]
        if not (cfg.tie_word_embeddings and first):  # tied at PP>1: the last stage keeps its own copy
            out["output_layer.weight"] = shard(pad(head), 0)
    for local in range(per_stage):
        h, m = f"model.layers.{pp_rank * per_stage + local}.", f"decoder.layers.{local}."
        a = h + "self_attn."
        out[m + "input_layernorm.weight"] = sd[h + "input_layernorm.weight"].clone()
        out[m + "pre_mlp_layernorm.weight"] = sd[h + "post_attention_layernorm.weight"].clone()
        out[m + "self_attention.linear_qkv.weight"] = per_group(
            sd[a + "q_proj.weight"], sd[a + "k_proj.weight"], sd[a + "v_proj.weight"])
        if a + "q_proj.bias" in sd:
            out[m + "self_attention.linear_qkv.bias"] = per_group(
                sd[a + "q_proj.bias"][:, None], sd[a + "k_proj.bias"][:, None], sd[a + "v_proj.bias"][:, None])
        out[m + "self_attention.linear_proj.weight"] = shard(sd[a + "o_proj.weight"], 1)
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [shard(sd[h + "mlp.gate_proj.weight"], 0), shard(sd[h + "mlp.up_proj.weight"], 0)])
        out[m + "mlp.linear_fc2.weight"] = shard(sd[h + "mlp.down_proj.weight"], 1)
    return out


def load_into(model, state):
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    assert not missing and not unexpected, (missing, unexpected)


def sample_ids(batch=2, seq=48, seed=1):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def megatron_tp1():
    """A 1-process Megatron world for this module; torchrun-style env vars are restored afterwards, so later
    subprocesses (converters, torchrun workers) do not inherit this process's rendezvous port."""
    import os

    from megatron_searchr1.megatron.initialize import destroy_megatron, initialize_megatron

    saved = {k: os.environ.get(k) for k in _DIST_ENV}
    initialize_megatron(tp=1, pp=1)
    yield
    destroy_megatron()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


# ------------------------------------------------------------------------------------------------ config
def test_padded_vocab_size_rounds_up_to_multiple_of_divisible_by_times_tp():
    assert padded_vocab_size(250, 1) == 256
    assert padded_vocab_size(256, 1) == 256
    assert padded_vocab_size(257, 1) == 384
    assert padded_vocab_size(250, 4) == 512
    assert padded_vocab_size(151643, 2) == 151808  # Qwen2.5's tokenizer size at TP=2
    assert padded_vocab_size(100, 2, divisible_by=8) == 112
    with pytest.raises(ValueError):
        padded_vocab_size(0, 1)


def test_config_translates_qwen2_and_llama():
    q = transformer_config_from_hf(tiny_config("qwen2", rms_norm_eps=1e-5), tp=2, pp=2)
    assert (q.num_layers, q.hidden_size, q.ffn_hidden_size) == (2, 64, 128)
    assert (q.num_attention_heads, q.num_query_groups, q.kv_channels) == (4, 2, 16)
    assert q.add_qkv_bias and not q.add_bias_linear and q.gated_linear_unit
    assert q.normalization == "RMSNorm" and q.layernorm_epsilon == 1e-5
    assert (q.tensor_model_parallel_size, q.pipeline_model_parallel_size) == (2, 2)
    assert q.pipeline_dtype == torch.float32 and q.hidden_dropout == 0.0
    ll = transformer_config_from_hf(tiny_config("llama", head_dim=32), params_dtype=torch.bfloat16)
    assert not ll.add_qkv_bias and ll.kv_channels == 32
    assert ll.params_dtype == ll.pipeline_dtype == torch.bfloat16 and ll.bf16
    assert transformer_config_from_hf(tiny_config("qwen2"), recompute_granularity="full",
                                      recompute_method="uniform", recompute_num_layers=1).recompute_granularity == "full"
    assert rope_settings(tiny_config("qwen2", rope_parameters={"rope_type": "default", "rope_theta": 1e6})).theta == 1e6
    assert rope_settings(tiny_config("llama3rope")).llama3_factor == 8.0
    assert model_family(tiny_config("qwen2")) == "qwen2" and model_family(tiny_config("llama")) == "llama"
    assert set(SUPPORTED_ARCHITECTURES) == {"Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM",
                                            "MistralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"}


@pytest.mark.parametrize("make, kwargs, message", [
    (lambda: tiny_config("qwen2", architectures=["GemmaForCausalLM"]), {}, "Qwen2ForCausalLM"),
    (lambda: tiny_config("qwen2", num_attention_heads=4, num_key_value_heads=4), {"tp": 3}, "num_attention_heads"),
    (lambda: tiny_config("qwen2", num_attention_heads=6, num_key_value_heads=3), {"tp": 2},
     "num_key_value_heads .*=3 must be a multiple of TP=2 .* or divide it"),
    (lambda: tiny_config("qwen2", intermediate_size=130), {"tp": 4},
     "TP=4 does not divide intermediate_size=130: choose a TP that divides it"),
    (lambda: tiny_config("qwen2", architectures=["Qwen2ForTokenClassification"]), {}, "Qwen2ForTokenClassification"),
    (lambda: tiny_config("qwen2", num_hidden_layers=3), {"pp": 2}, "num_hidden_layers"),
    (lambda: tiny_config("qwen2", use_sliding_window=True, sliding_window=64), {}, "liding"),
    (lambda: tiny_config("qwen2", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), {}, "yarn"),
    (lambda: tiny_config("llama", rope_parameters={**LLAMA3_ROPE, "high_freq_factor": 2.0}), {}, "high_freq_factor"),
    (lambda: tiny_config("llama", hidden_act="gelu"), {}, "hidden_act"),
    (lambda: tiny_config("llama", attention_bias=True), {}, "attention_bias"),
    (lambda: tiny_config("qwen2"), {"no_such_field": 1}, "no_such_field"),
])
def test_config_errors_are_clear(make, kwargs, message):
    with pytest.raises(ValueError, match=message):
        transformer_config_from_hf(make(), **kwargs)


def test_builder_and_mapping_accept_the_same_configs():
    """gpt.py delegates to the families registry: a config one accepts, the other accepts (and vice versa)."""
    for cfg in (tiny_config("qwen2"), tiny_config("llama"), tiny_config("qwen2", architectures=["Qwen2ForCausalLM"]),
                tiny_config("qwen2", architectures=["Qwen2ForTokenClassification"]),
                tiny_config("qwen2", architectures=["GemmaForCausalLM"])):
        try:
            family = get_family(cfg)
        except ValueError:
            family = None
        if family is None:
            with pytest.raises(ValueError):
                transformer_config_from_hf(cfg)
        else:
            transformer_config_from_hf(cfg)
            assert model_family(cfg) == family.model_types[0]


@pytest.mark.parametrize("heads, groups, tp", [(4, 1, 2), (8, 2, 4), (8, 1, 8), (4, 4, 2)])
def test_fewer_kv_heads_than_tp_is_allowed(heads, groups, tp):
    """Megatron replicates KV heads when num_query_groups divides TP (transformer_config.py's rule)."""
    c = transformer_config_from_hf(tiny_config("qwen2", num_attention_heads=heads, num_key_value_heads=groups), tp=tp)
    assert (c.num_query_groups, c.tensor_model_parallel_size) == (groups, tp)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_transformer_engine_without_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError, match="CUDA"):
        build_gpt_model(tiny_config("qwen2"), use_te=True)


def test_build_without_parallel_state_says_what_to_call():
    from megatron.core import parallel_state

    assert not parallel_state.model_parallel_is_initialized(), "an earlier test left Megatron initialised"
    with pytest.raises(RuntimeError, match="initialize_megatron"):
        build_gpt_model(tiny_config("qwen2"))


def test_config_for_other_parallel_sizes_says_how_to_build_it(megatron_tp1):
    cfg = tiny_config("qwen2")
    wanted = r"transformer_config_from_hf\(hf_config, tp=1, pp=1, \.\.\.\).*initialize_megatron"
    with pytest.raises(ValueError, match=wanted):
        build_gpt_model(cfg, config=transformer_config_from_hf(cfg, tp=2))


def test_bf16_model_holds_bf16_norms(megatron_tp1):
    """torch norms are created in fp32 whatever params_dtype says; the builder casts them (as Float16Module would)."""
    model = build_gpt_model(tiny_config("qwen3"), params_dtype=torch.bfloat16)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert "decoder.layers.0.self_attention.q_layernorm.weight" in dtypes
    assert set(dtypes.values()) == {torch.bfloat16}, {n: d for n, d in dtypes.items() if d != torch.bfloat16}
    logits = model(sample_ids(seq=8), None, None)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


# ------------------------------------------------------------------------------------------------ logits
@pytest.mark.parametrize("kind", ["qwen2", "llama", "llama3rope"])
def test_logits_equal_transformers(megatron_tp1, kind):
    from megatron_searchr1.models.forward import forward_logits

    cfg, hf = tiny_hf_model(kind)
    model = build_gpt_model(cfg).eval()
    assert not uses_te_spec(model)
    names = {n for n, _ in model.named_parameters()}
    assert ("output_layer.weight" in names) == (not cfg.tie_word_embeddings)
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in names) == (kind == "qwen2")
    load_into(model, hf_to_megatron_state(hf, cfg, vocab_pad=model.vocab_size))

    ids = sample_ids()
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    got = forward_logits(model, ids)
    assert got.shape == ref.shape == (2, 48, VOCAB)
    assert ref.abs().max() > 1.0  # logits are not trivially small
    assert (got - ref).abs().max().item() <= 1e-4

    # A deliberately wrong mapping (k and v swapped) must be caught by the same check.
    load_into(model, hf_to_megatron_state(hf, cfg, vocab_pad=model.vocab_size, swap_kv=True))
    assert (forward_logits(model, ids) - ref).abs().max().item() > 1e-2


@pytest.mark.parametrize("kind", ["qwen3", "mistral"])
def test_new_families_logits_equal_transformers(megatron_tp1, kind):
    """Qwen3 (q/k norms, head_dim 32 != hidden / heads) and Mistral through the families mapping: HF's logits."""
    from megatron_searchr1.models.families import mapping_for
    from megatron_searchr1.models.forward import forward_logits

    cfg, hf = tiny_hf_model(kind)
    model = build_gpt_model(cfg).eval()
    names = {n for n, _ in model.named_parameters()}
    assert ("decoder.layers.0.self_attention.q_layernorm.weight" in names) == (kind == "qwen3")
    mapping, sd = mapping_for(cfg, model.vocab_size), hf.state_dict()
    load_into(model, {n: mapping.hf_to_megatron(n, sd) for n in names})
    ids = sample_ids()
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    assert ref.abs().max() > 1.0
    assert (forward_logits(model, ids) - ref).abs().max().item() <= 1e-4
    if kind == "qwen3":  # the q/k norms matter: unit norms instead of the HF ones move the logits
        load_into(model, {n: (torch.ones_like(t) if "q_layernorm" in n else t)
                          for n, t in ((n, mapping.hf_to_megatron(n, sd)) for n in names)})
        assert (forward_logits(model, ids) - ref).abs().max().item() > 1e-2


def test_batch_first_output_layer_matches_megatron_layout(megatron_tp1):
    """Same logits and gradients as GPTModel's own [s, b, V] output layer."""
    from megatron.core import tensor_parallel

    from megatron_searchr1.models.gpt import BatchFirstOutputLayer

    model = build_gpt_model(tiny_config("qwen2"))
    assert type(model.output_layer) is BatchFirstOutputLayer
    ids = sample_ids(seq=16)

    def run(cls):
        model.output_layer.__class__ = cls
        model.zero_grad(set_to_none=True)
        logits = model(ids, None, None)
        assert logits.shape == (2, 16, 256) and logits.is_contiguous()
        torch.nn.functional.cross_entropy(logits.reshape(-1, 256), ids.reshape(-1)).backward()
        return logits.detach(), model.output_layer.weight.grad.clone(), model.embedding.word_embeddings.weight.grad.clone()

    ours, megatron = run(BatchFirstOutputLayer), run(tensor_parallel.ColumnParallelLinear)
    for a, b in zip(ours, megatron):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)


def test_labels_loss_path_equals_cross_entropy_of_logits(megatron_tp1):
    """Megatron's labels path reads [s, b, V] logits with .view: the batch-first output layer must stay out of it."""
    cfg, hf = tiny_hf_model("qwen2")
    model = build_gpt_model(cfg)
    load_into(model, hf_to_megatron_state(hf, cfg, vocab_pad=model.vocab_size))
    ids = sample_ids(seq=17)
    per_token = model(ids[:, :-1], None, None, labels=ids[:, 1:])
    assert per_token.shape == (2, 16)
    # Megatron's loss normalises over the *padded* vocabulary (the zero padding rows give logit 0), so compare
    # with cross entropy over all V_pad logits; HF-equal log-probs need the logits cut to VOCAB first.
    logits = model(ids[:, :-1], None, None)
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, model.vocab_size), ids[:, 1:].reshape(-1),
                                             reduction="none")
    assert (per_token.reshape(-1) - want).abs().max().item() <= 1e-5
    per_token.mean().backward()
    assert model.output_layer.weight.grad.abs().sum() > 0


def test_swiglu_mlp_matches_megatron_mlp(megatron_tp1):
    """SwiGLUMLP (gradient written in place) against Megatron's chunk+silu+mul MLP: same outputs and grads."""
    from megatron.core.transformer.mlp import MLP

    from megatron_searchr1.models.fast_modules import SwiGLUMLP, _SwiGLU

    x = torch.randn(4, 3, 16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_SwiGLU.apply, (x,))
    model = build_gpt_model(tiny_config("llama"))
    mlp = model.decoder.layers[0].mlp
    assert type(mlp) is SwiGLUMLP
    ids = sample_ids(seq=16)

    def run(cls):
        for layer in model.decoder.layers:
            layer.mlp.__class__ = cls
        model.zero_grad(set_to_none=True)
        logits = model(ids, None, None)
        logits.square().mean().backward()
        return logits.detach(), mlp.linear_fc1.weight.grad.clone(), mlp.linear_fc2.weight.grad.clone()

    ours, megatron = run(SwiGLUMLP), run(MLP)
    for a, b in zip(ours, megatron):
        assert torch.equal(a, b)


def test_llama3_rope_scaling_matters(megatron_tp1):
    """The llama3 case above would pass without scaling if scaling changed nothing: show it does."""
    from megatron_searchr1.models.forward import forward_logits

    cfg, hf = tiny_hf_model("llama3rope")
    plain = tiny_config("llama", max_position_embeddings=16384)
    model = build_gpt_model(plain).eval()
    load_into(model, hf_to_megatron_state(hf, cfg, vocab_pad=model.vocab_size))
    ids = sample_ids(seq=128)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    assert (forward_logits(model, ids) - ref).abs().max().item() > 1e-3


def test_forward_logits_rejects_left_padding_and_shifted_positions(megatron_tp1):
    from megatron_searchr1.models.forward import forward_logits

    cfg, hf = tiny_hf_model("qwen2")
    model = build_gpt_model(cfg).eval()
    load_into(model, hf_to_megatron_state(hf, cfg, vocab_pad=model.vocab_size))
    ids = sample_ids(seq=8)
    right = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    out = forward_logits(model, ids, attention_mask=right, position_ids=torch.arange(8).expand(2, 8))
    with torch.no_grad():  # real tokens of a right-padded row are unaffected by the padding
        ref = hf(input_ids=ids[1:, :5]).logits
    assert (out[1, :5] - ref[0]).abs().max().item() <= 1e-4
    with pytest.raises(ValueError, match="right-pad"):
        forward_logits(model, ids, attention_mask=right.flip(1))
    with pytest.raises(ValueError, match="positions"):
        forward_logits(model, ids, position_ids=torch.arange(1, 9).expand(2, 8))


# ------------------------------------------------------------------------------------------------ TP / PP
def full_grads(model, tp: int) -> dict:
    """Every parameter's gradient at its TP=1 shape (TP shards all-gathered; vocab padding rows cut off)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    out = {}
    for name, param in model.named_parameters():
        g = param.grad.detach()
        if getattr(param, "tensor_model_parallel", False) and tp > 1:
            parts = [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(parts, g.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
            if name.endswith("linear_fc1.weight"):  # each rank holds [gate_r; up_r]
                halves = [part.chunk(2) for part in parts]
                parts = [h[0] for h in halves] + [h[1] for h in halves]
            g = torch.cat(parts, dim=param.partition_dim)
        if "embedding" in name or "output_layer" in name:
            g = g[:VOCAB]
        out[name] = g.clone()
    return out


def labels_loss_grads(model, tp: int) -> dict:
    """Gradients of Megatron's own loss path (labels=..., vocab-parallel cross entropy) on a fixed batch."""
    ids = sample_ids(batch=2, seq=17, seed=5)
    model.train()
    model.zero_grad(set_to_none=True)
    model(ids[:, :-1], None, None, labels=ids[:, 1:]).mean().backward()
    return full_grads(model, tp)


def critic_state(hf_model, cfg, critic, **rank) -> dict:
    """This rank's critic state: the actor trunk's (no output layer) plus a fixed non-zero value head on the last
    stage (zero would make every value 0 and hide a wrong trunk)."""
    state = hf_to_megatron_state(hf_model, cfg, vocab_pad=critic.vocab_size, **rank)
    state.pop("output_layer.weight", None)
    if critic.post_process:
        g = torch.Generator().manual_seed(7)
        state["value_head.weight"] = 0.5 * torch.randn(1, cfg.hidden_size, generator=g)
        state["value_head.bias"] = torch.tensor([0.25])
    return state


def _worker(out_dir: str) -> None:
    """torchrun worker: logits of each tiny model at TP=2 and at PP=2 (micro-batched), and TP=2 gradients of the
    labels loss; plus logits of a one-KV-head model at TP=2 (KV head replicated) and critic values at TP=2 and
    PP=2; saved by global rank 0."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_searchr1.megatron.initialize import initialize_megatron
    from megatron_searchr1.models.critic import build_critic_model
    from megatron_searchr1.models.forward import forward_logits, forward_values

    torch.set_num_threads(1)
    results = {}
    for tp, pp in [(2, 1), (1, 2)]:
        initialize_megatron(tp=tp, pp=pp)
        for kind in ("qwen2", "llama") + (("qwen2kv1",) if tp == 2 else ()):
            cfg, hf = tiny_hf_model(kind)
            model = build_gpt_model(cfg).eval()
            tp_rank = parallel_state.get_tensor_model_parallel_rank()
            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
            if kind == "qwen2kv1":  # through the families mapping: its tp_split must handle a replicated KV head
                from megatron_searchr1.models.families import local_to_global_name, mapping_for, tp_split

                mapping, sd = mapping_for(cfg, model.vocab_size), hf.state_dict()
                load_into(model, {n: tp_split(g, mapping.hf_to_megatron(g, sd), tp)[tp_rank].clone()
                                  for n, _ in model.named_parameters()
                                  for g in [local_to_global_name(n, cfg.num_hidden_layers, pp, pp_rank)]})
            else:
                load_into(model, hf_to_megatron_state(hf, cfg, vocab_pad=model.vocab_size, tp_rank=tp_rank, tp=tp,
                                                      pp_rank=pp_rank, pp=pp))
            logits = forward_logits(model, sample_ids(batch=4), micro_batch_size=2)
            last = parallel_state.is_pipeline_last_stage()
            assert (logits is not None) == last
            if last and parallel_state.get_tensor_model_parallel_rank() == 0:
                results[f"{kind}_tp{tp}_pp{pp}"] = logits
            if tp == 2 and kind != "qwen2kv1":
                grads = labels_loss_grads(model, tp)
                if parallel_state.get_tensor_model_parallel_rank() == 0:
                    results[f"{kind}_tp2_grads"] = grads
        # The critic (same trunk, value head) at this TP/PP: values equal to the TP=1 critic's.
        cfg, hf = tiny_hf_model("qwen2")
        critic = build_critic_model(cfg).eval()
        load_into(critic, critic_state(hf, cfg, critic, tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                                       tp=tp, pp_rank=parallel_state.get_pipeline_model_parallel_rank(), pp=pp))
        values = forward_values(critic, sample_ids(batch=4), micro_batch_size=2)
        assert (values is not None) == parallel_state.is_pipeline_last_stage()
        if values is not None and parallel_state.get_tensor_model_parallel_rank() == 0:
            results[f"critic_tp{tp}_pp{pp}"] = values
        parallel_state.destroy_model_parallel()
    # The last PP stage holds the PP result: gather everything on rank 0 through the world group.
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        merged = {k: v for part in gathered for k, v in part.items()}
        torch.save(merged, Path(out_dir) / "logits.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_tp2_and_pp2_logits_equal_tp1(tmp_path, megatron_tp1):
    from megatron_searchr1.models.forward import forward_logits
    from tests.dist_utils import run_torchrun

    t0 = time.time()
    run_torchrun(__file__, 2, str(tmp_path), timeout=300)
    got = torch.load(tmp_path / "logits.pt")
    assert sorted(got) == ["critic_tp1_pp2", "critic_tp2_pp1", "llama_tp1_pp2", "llama_tp2_grads", "llama_tp2_pp1",
                           "qwen2_tp1_pp2", "qwen2_tp2_grads", "qwen2_tp2_pp1", "qwen2kv1_tp2_pp1"]
    from megatron_searchr1.models.critic import build_critic_model
    from megatron_searchr1.models.forward import forward_values

    cfg, hf = tiny_hf_model("qwen2")
    critic = build_critic_model(cfg).eval()
    load_into(critic, critic_state(hf, cfg, critic))
    ref_values = forward_values(critic, sample_ids(batch=4))
    assert ref_values.shape == (4, 48) and ref_values.std() > 0.1
    for case in ("tp2_pp1", "tp1_pp2"):
        assert (got[f"critic_{case}"] - ref_values).abs().max().item() <= 1e-5, case
    cfg, hf = tiny_hf_model("qwen2kv1")  # one KV head at TP=2: equal to transformers' logits
    with torch.no_grad():
        ref = hf(sample_ids(batch=4)).logits
    assert (got["qwen2kv1_tp2_pp1"] - ref).abs().max().item() <= 1e-4
    for kind in ("qwen2", "llama"):
        cfg, hf = tiny_hf_model(kind)
        model = build_gpt_model(cfg).eval()
        load_into(model, hf_to_megatron_state(hf, cfg, vocab_pad=model.vocab_size))
        ref = forward_logits(model, sample_ids(batch=4))
        for case in ("tp2_pp1", "tp1_pp2"):
            other = got[f"{kind}_{case}"]
            assert other.shape == ref.shape == (4, 48, VOCAB)
            assert (other - ref).abs().max().item() <= 1e-4, (kind, case)
        ref_grads, tp2_grads = labels_loss_grads(model, 1), got[f"{kind}_tp2_grads"]
        assert sorted(ref_grads) == sorted(tp2_grads)
        for name, g in ref_grads.items():
            assert g.abs().max() > 0, name
            assert (tp2_grads[name] - g).abs().max().item() <= 1e-5 * max(1.0, g.abs().max().item()), (kind, name)
    print(f"torchrun TP=2/PP=2 check took {time.time() - t0:.1f}s")


if __name__ == "__main__":
    _worker(sys.argv[1])
