"""Pure mapping tests for megatron_searchr1/models/families (no Megatron process, no torch.distributed)."""
import pytest
import torch

from megatron_searchr1.models.families import (
    SUPPORTED_ARCHITECTURES, LlamaFamily, MistralFamily, Qwen2Family, Qwen3Family, deinterleave_qkv, get_family,
    global_to_local_name, interleave_qkv, local_to_global_name, local_to_te_name, mapping_for, pad_vocab,
    pp_layer_range, read_dims, rename_layer, stage_layer_counts, te_to_local_name, tp_kind, tp_merge, tp_place,
    tp_split, trim_vocab,
)


def qwen2_cfg(**kw):
    cfg = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", num_hidden_layers=4, hidden_size=16,
               num_attention_heads=4, num_key_value_heads=2, intermediate_size=24, vocab_size=50,
               tie_word_embeddings=False)
    cfg.update(kw)
    return cfg


def llama_cfg(**kw):
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=2, hidden_size=16,
               num_attention_heads=4, num_key_value_heads=1, head_dim=8, intermediate_size=24, vocab_size=50,
               tie_word_embeddings=True)
    cfg.update(kw)
    return cfg


def qwen3_cfg(**kw):
    cfg = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", num_hidden_layers=2, hidden_size=16,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=24, vocab_size=50,
               tie_word_embeddings=True, attention_bias=False)
    cfg.update(kw)
    return cfg


def mistral_cfg(**kw):
    cfg = dict(architectures=["MistralForCausalLM"], model_type="mistral", num_hidden_layers=2, hidden_size=16,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=24, vocab_size=50,
               tie_word_embeddings=False, sliding_window=None)
    cfg.update(kw)
    return cfg


def random_hf_state(mapping, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = mapping.dims
    shapes = {}
    for name in mapping.hf_names():
        short = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            shapes[name] = (d.vocab_size, d.hidden_size)
        elif name == "model.norm.weight" or short.endswith("layernorm.weight"):
            shapes[name] = (d.hidden_size,)
        elif short.endswith(("q_norm.weight", "k_norm.weight")):
            shapes[name] = (d.head_dim,)
        elif "q_proj" in short:
            shapes[name] = (d.num_heads * d.head_dim, d.hidden_size)[: 1 if short.endswith("bias") else 2]
        elif "k_proj" in short or "v_proj" in short:
            shapes[name] = (d.num_kv_heads * d.head_dim, d.hidden_size)[: 1 if short.endswith("bias") else 2]
        elif "o_proj" in short:
            shapes[name] = (d.hidden_size,) if short.endswith("bias") else (d.hidden_size, d.num_heads * d.head_dim)
        elif "gate_proj" in short or "up_proj" in short:
            shapes[name] = (d.ffn_hidden_size,) if short.endswith("bias") else (d.ffn_hidden_size, d.hidden_size)
        elif "down_proj" in short:
            shapes[name] = (d.hidden_size,) if short.endswith("bias") else (d.hidden_size, d.ffn_hidden_size)
        else:
            raise AssertionError(name)
    return {n: torch.randn(*s, generator=g) for n, s in shapes.items()}


@pytest.mark.parametrize("cfg", [qwen2_cfg(), llama_cfg(), llama_cfg(attention_bias=True, mlp_bias=True,
                                                                      tie_word_embeddings=False),
                                 qwen3_cfg(), mistral_cfg()])
def test_hf_megatron_hf_identity(cfg):
    mapping = mapping_for(cfg, padded_vocab_size=64)
    hf = random_hf_state(mapping)
    mg = mapping.hf_to_megatron_state(hf)
    assert set(mg) == set(mapping.megatron_names())
    for name, t in mg.items():
        assert tuple(t.shape) == mapping.megatron_shape(name), name
    # padding rows are zeros, real rows are the HF rows
    assert torch.equal(mg["embedding.word_embeddings.weight"][50:], torch.zeros(14, 16))
    back = mapping.megatron_to_hf_state(mg)
    assert set(back) == set(hf)
    for name in hf:
        assert torch.equal(back[name], hf[name]), name


def test_layer_by_layer_streaming_equals_whole_dict():
    mapping = mapping_for(qwen2_cfg(), padded_vocab_size=64)
    hf = random_hf_state(mapping, seed=2)
    whole = mapping.hf_to_megatron_state(hf)
    for i in range(mapping.dims.num_layers):
        layer_hf = {n: hf[n] for n in mapping.layer_hf_names(i)}  # only this layer's tensors are needed
        for name in mapping.layer_megatron_names(i):
            assert torch.equal(mapping.hf_to_megatron(name, layer_hf), whole[name]), name


def test_family_bias_and_tie_flags():
    q = mapping_for(qwen2_cfg())
    assert q.dims.qkv_bias and not q.dims.linear_bias and not q.dims.tie_embeddings
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in q.megatron_names()
    assert "output_layer.weight" in q.megatron_names() and "lm_head.weight" in q.hf_names()
    ll = mapping_for(llama_cfg())
    assert not ll.dims.qkv_bias and ll.dims.tie_embeddings and ll.dims.head_dim == 8
    assert "output_layer.weight" not in ll.megatron_names() and "lm_head.weight" not in ll.hf_names()
    # Tied: Megatron's last-stage output_layer copy is built from the embedding and maps back to nothing.
    assert ll.hf_sources("output_layer.weight") == ["model.embed_tokens.weight"]
    assert ll.megatron_to_hf("output_layer.weight", torch.zeros(50, 16)) == []


def test_qkv_interleave_hand_example():
    # nq=4 query heads, ng=2 groups, head dim 1, hidden 1: Megatron rows are [q0 q1 k0 v0 | q2 q3 k1 v1].
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    qkv = interleave_qkv(q, k, v, num_heads=4, num_kv_heads=2)
    assert qkv.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    # bias (1-D) and head dim 2
    qb, kb, vb = torch.arange(4.0), torch.arange(100.0, 102.0), torch.arange(200.0, 202.0)
    assert interleave_qkv(qb, kb, vb, 2, 1).tolist() == [0, 1, 2, 3, 100, 101, 200, 201]
    back = deinterleave_qkv(qkv, 4, 2)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))


def test_tp_split_hand_examples():
    # qkv: each TP rank gets whole query groups.
    qkv = interleave_qkv(torch.tensor([[10.0], [11.0], [12.0], [13.0]]), torch.tensor([[20.0], [21.0]]),
                         torch.tensor([[30.0], [31.0]]), 4, 2)
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    r0, r1 = tp_split(name, qkv, 2)
    assert r0.flatten().tolist() == [10, 11, 20, 30] and r1.flatten().tolist() == [12, 13, 21, 31]
    # fc1: rank r holds [gate_r; up_r].
    fc1 = torch.tensor([[0.0], [1.0], [2.0], [3.0], [100.0], [101.0], [102.0], [103.0]])  # gate 0..3, up 100..103
    s0, s1 = tp_split("decoder.layers.1.mlp.linear_fc1.weight", fc1, 2)
    assert s0.flatten().tolist() == [0, 1, 100, 101] and s1.flatten().tolist() == [2, 3, 102, 103]
    # row-parallel splits columns, norms replicate, vocab splits rows
    proj = torch.arange(8.0).reshape(2, 4)
    p0, p1 = tp_split("decoder.layers.0.self_attention.linear_proj.weight", proj, 2)
    assert p0.tolist() == [[0, 1], [4, 5]] and p1.tolist() == [[2, 3], [6, 7]]
    assert tp_kind("decoder.layers.0.input_layernorm.weight") == "replicated"
    assert tp_kind("embedding.word_embeddings.weight") == "vocab"
    with pytest.raises(ValueError, match="not divisible by tensor-parallel size 3"):
        tp_split("decoder.layers.0.self_attention.linear_proj.weight", proj, 3)


@pytest.mark.parametrize("name", ["decoder.layers.0.self_attention.linear_qkv.weight",
                                  "decoder.layers.1.mlp.linear_fc1.weight",
                                  "decoder.layers.0.self_attention.linear_proj.weight",
                                  "embedding.word_embeddings.weight", "decoder.layers.0.input_layernorm.weight"])
def test_tp_place_puts_each_shard_where_tp_merge_does(name):
    full = torch.arange(48.0).reshape(8, 6) if tp_kind(name) != "replicated" else torch.arange(6.0)
    shards = tp_split(name, full, 2)
    rebuilt = torch.full_like(full, -1.0)
    for rank, shard in enumerate(shards):
        tp_place(name, rebuilt, 2, rank, shard)
    assert torch.equal(rebuilt, tp_merge(name, shards)) and torch.equal(rebuilt, full)


@pytest.mark.parametrize("cfg,tp", [(qwen2_cfg(), 2), (qwen2_cfg(num_key_value_heads=4), 4),
                                    (llama_cfg(), 2), (llama_cfg(attention_bias=True, mlp_bias=True), 4)])
def test_tp_split_merge_identity(cfg, tp):
    mapping = mapping_for(cfg, padded_vocab_size=64)
    mg = mapping.hf_to_megatron_state(random_hf_state(mapping, seed=1))
    for name, full in mg.items():
        shards = tp_split(name, full, tp)
        assert len(shards) == tp
        if tp_kind(name) != "replicated":
            assert sum(s.numel() for s in shards) == full.numel(), name
        assert torch.equal(tp_merge(name, shards), full), name


def test_pp_layer_offsets():
    assert list(pp_layer_range(8, 2, 1)) == [4, 5, 6, 7]
    assert global_to_local_name("decoder.layers.5.mlp.linear_fc2.weight", 8, 2) == (1, "decoder.layers.1.mlp.linear_fc2.weight")
    assert global_to_local_name("decoder.final_layernorm.weight", 8, 2) == (None, "decoder.final_layernorm.weight")
    assert local_to_global_name("decoder.layers.1.mlp.linear_fc2.weight", 8, 4, 3) == "decoder.layers.7.mlp.linear_fc2.weight"
    for i in range(8):
        stage, local = global_to_local_name(f"decoder.layers.{i}.input_layernorm.weight", 8, 4)
        assert local_to_global_name(local, 8, 4, stage) == f"decoder.layers.{i}.input_layernorm.weight"
    with pytest.raises(ValueError, match="not divisible by pipeline-parallel size 3"):
        pp_layer_range(8, 3, 0)


def test_vocab_pad_trim():
    t = torch.randn(50, 4)
    p = pad_vocab(t, 64)
    assert p.shape == (64, 4) and torch.equal(p[:50], t) and not p[50:].any()
    assert torch.equal(trim_vocab(p, 50), t)
    with pytest.raises(ValueError):
        pad_vocab(t, 40)


def test_te_names():
    te = "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"
    assert te_to_local_name(te) == "decoder.layers.3.input_layernorm.weight"
    assert local_to_te_name("decoder.layers.3.pre_mlp_layernorm.weight") == "decoder.layers.3.mlp.linear_fc1.layer_norm_weight"
    m = mapping_for(qwen2_cfg())
    assert m.hf_sources(te) == ["model.layers.3.input_layernorm.weight"]
    assert m.megatron_to_hf(te, torch.ones(16))[0][0] == "model.layers.3.input_layernorm.weight"


def test_get_family_registry_and_errors():
    assert get_family("Qwen2ForCausalLM") is Qwen2Family and get_family(llama_cfg()) is LlamaFamily
    assert get_family({"model_type": "llama"}) is LlamaFamily
    with pytest.raises(ValueError) as e:
        get_family({"architectures": ["GemmaForCausalLM"]})
    assert "GemmaForCausalLM" in str(e.value) and all(a in str(e.value) for a in SUPPORTED_ARCHITECTURES)


def test_shape_disagreement_is_reported():
    mapping = mapping_for(qwen2_cfg())
    hf = random_hf_state(mapping)
    hf["model.layers.0.self_attn.k_proj.weight"] = torch.randn(16, 16)  # config says 2 kv heads x 4 = 8 rows
    with pytest.raises(ValueError, match="disagree"):
        mapping.hf_to_megatron("decoder.layers.0.self_attention.linear_qkv.weight", hf)
    with pytest.raises(KeyError, match="layer 9 does not exist"):
        mapping.hf_sources("decoder.layers.9.mlp.linear_fc2.weight")


def test_qwen3_and_mistral_families():
    """Qwen3: q/k norms over the head dim (replicated over TP), explicit head_dim; Mistral: the Llama layout."""
    assert get_family(qwen3_cfg()) is Qwen3Family and get_family("MistralForCausalLM") is MistralFamily
    q3 = mapping_for(qwen3_cfg(), padded_vocab_size=64)
    assert q3.dims.qk_norm and not q3.dims.qkv_bias and q3.dims.head_dim == 8
    qn = "decoder.layers.1.self_attention.q_layernorm.weight"
    assert qn in q3.megatron_names() and "model.layers.1.self_attn.k_norm.weight" in q3.hf_names()
    assert q3.hf_sources(qn) == ["model.layers.1.self_attn.q_norm.weight"] and q3.megatron_shape(qn) == (8,)
    assert tp_kind(qn) == "replicated" and all(torch.equal(s, torch.arange(8.0)) for s in tp_split(qn, torch.arange(8.0), 2))
    # head_dim * heads (32) != hidden (16): o_proj is (hidden, heads * head_dim)
    assert q3.megatron_shape("decoder.layers.0.self_attention.linear_proj.weight") == (16, 32)
    mi = mapping_for(mistral_cfg())
    assert not mi.dims.qk_norm and not mi.dims.qkv_bias and mi.dims.architecture == "MistralForCausalLM"
    assert mi.megatron_names() == mapping_for(llama_cfg(num_key_value_heads=2, tie_word_embeddings=False)).megatron_names()


@pytest.mark.parametrize("cfg, message", [
    (mistral_cfg(sliding_window=4096), "sliding_window=4096"),
    (qwen3_cfg(attention_bias=True), "attention_bias"),
    (llama_cfg(attention_bias=True), "mlp_bias"),  # o_proj bias without MLP biases: Megatron cannot express it
    (llama_cfg(mlp_bias=True), "mlp_bias"),
    (qwen2_cfg(hidden_act="gelu"), "hidden_act"),
])
def test_configs_the_families_refuse(cfg, message):
    with pytest.raises(ValueError, match=message):
        mapping_for(cfg)


def test_linear_bias_needs_attention_and_mlp_bias_together():
    both = mapping_for(llama_cfg(attention_bias=True, mlp_bias=True))
    assert both.dims.qkv_bias and both.dims.linear_bias
    names = both.layer_megatron_names(0)
    for suffix in ("linear_proj.bias", "linear_fc1.bias", "linear_fc2.bias", "linear_qkv.bias"):
        assert any(n.endswith(suffix) for n in names), suffix


def test_dims_read_once_carry_what_megatron_needs():
    dims = read_dims(llama_cfg(rms_norm_eps=1e-5, rope_theta=5e5, max_position_embeddings=1024,
                               initializer_range=0.1))
    assert (dims.norm_eps, dims.rope.theta, dims.max_position_embeddings, dims.init_std) == (1e-5, 5e5, 1024, 0.1)
    assert read_dims(dims) is dims and mapping_for(dims, padded_vocab_size=64).dims.padded_vocab_size == 64


def test_uneven_pipeline_stages_and_layer_renaming():
    assert stage_layer_counts(8, 2) == [4, 4]
    assert stage_layer_counts(6, 2, first=2) == [2, 4] and stage_layer_counts(7, 3, last=1) == [3, 3, 1]
    assert stage_layer_counts(5, 3, first=1, last=2) == [1, 2, 2]
    with pytest.raises(ValueError, match="PP=3 does not divide num_hidden_layers=8"):
        stage_layer_counts(8, 3)
    with pytest.raises(ValueError, match="num_layers_in_first_pipeline_stage"):
        stage_layer_counts(8, 3, first=1)  # 7 layers over 2 stages
    # a stage holding global layers 2..5 (first stage took 2): local index 1 is global 3, whatever the even split says
    assert rename_layer("decoder.layers.1.mlp.linear_fc2.weight", range(2, 6)) == "decoder.layers.3.mlp.linear_fc2.weight"
    assert rename_layer("decoder.final_layernorm.weight", range(2, 6)) == "decoder.final_layernorm.weight"
