"""Tests for megatron_searchr1/models/convert.py: converted Megatron logits == HF logits at TP/PP, input checks.

The logits checks run tests/models/convert_logits_script.py under real torchrun (gloo, world = TP*PP); that script
also asserts that deliberately wrong mappings (no QKV interleave, gate/up swapped) FAIL the comparison and that the
converter's dist checkpoint (saved at TP=1) loads at the case's TP/PP with the same logits. Its launches, one per
world size, also run the weight sync's checks for tests/rollout/test_weight_sync.py (tests/models/launches.py).
"""
import json
import os

import pytest
import torch

from megatron_searchr1.models.convert import ConversionError, SafetensorsReader, check_hf_tensor_names, load_hf_config
from megatron_searchr1.models.convert_megatron import check_sizes
from megatron_searchr1.models.families import mapping_for
from tests.dist_utils import rank_results
from tests.models.launches import ALL, TP2_AND_PP2, UNEVEN_PP2, convert_models, launch


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> (HF dir, TP1 checkpoint) of the four families (launches.convert_models)."""
    return convert_models(tmp_path_factory)


def _check_cases(out, cases):
    """The checks of `cases` ({case: archs}) in a launch's output: all present and passing, right mappings within
    1e-4 of HF's logits, wrong ones far from them."""
    results = [r for r in rank_results(out) if "case" in r and r["case"].partition("@")[0] in cases]
    # families x cases x (right mapping, export round trip, 2 wrong mappings, dist checkpoint)
    assert len(results) == sum(len(archs) for archs in cases.values()) * 5, out[-4000:]
    assert all(r["ok"] for r in results), results
    results = [r for r in results if r["check"] != "gather_round_trip"]
    right = [r for r in results if r["check"] in ("hf_weights", "dist_checkpoint_tp1")]
    wrong = [r for r in results if r not in right]
    assert max(r["diff"] for r in right) <= 1e-4 and min(r["diff"] for r in wrong) > 1e-2
    return results


def test_logits_match_hf_tp1(tmp_path_factory):
    _check_cases(launch(tmp_path_factory, 1), {"1x1": ALL})


@pytest.mark.slow
def test_logits_match_hf_tp2_and_pp2(tmp_path_factory):
    _check_cases(launch(tmp_path_factory, 2), TP2_AND_PP2)


@pytest.mark.slow
def test_logits_match_hf_tp2_pp2(tmp_path_factory):
    _check_cases(launch(tmp_path_factory, 4), {"2x2": ALL})


@pytest.mark.slow
def test_uneven_pipeline_split_loads_and_exports_the_right_layers(tmp_path_factory):
    """PP=2 with one layer on the first stage and three on the last: every layer's global index comes from the
    layer itself (an even-split assumption would load layer 1's weights into layer 2 and export them misnamed)."""
    _check_cases(launch(tmp_path_factory, 2), UNEVEN_PP2)


def test_checkpoint_metadata_written(models):
    hf, ckpt = models["llama"]
    meta = json.load(open(os.path.join(ckpt, "searchr1_checkpoint.json")))
    assert meta["architecture"] == "LlamaForCausalLM" and (meta["saved_tp"], meta["saved_pp"]) == (1, 1)
    assert meta["padded_vocab_size"] % 128 == 0 and meta["padded_vocab_size"] >= meta["hf_config"]["vocab_size"]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert os.path.isfile(os.path.join(ckpt, "hf", name)), name


def test_input_checks(models, tmp_path):
    hf, _ = models["qwen2"]
    cfg = load_hf_config(hf)
    with pytest.raises(ConversionError, match="TP=3 does not divide num_attention_heads=4"):
        check_sizes(cfg, 3, 1)
    with pytest.raises(ConversionError, match="PP=3 does not divide num_hidden_layers=4"):
        check_sizes(cfg, 1, 3)
    with pytest.raises(ConversionError, match="torchrun --nproc_per_node 4"):
        check_sizes(cfg, 2, 2)  # this pytest process is a world of one
    # Megatron's GQA rule: KV heads may divide TP (replicated) but must otherwise be a multiple of it
    cfg.num_key_value_heads = 1
    with pytest.raises(ConversionError, match="torchrun --nproc_per_node 2"):  # the model fits; the world does not
        check_sizes(cfg, 2, 1)
    cfg.num_attention_heads, cfg.num_key_value_heads = 6, 3
    with pytest.raises(ConversionError, match="num_key_value_heads .*=3 must be a multiple of TP=2 .* or divide it"):
        check_sizes(cfg, 2, 1)
    with pytest.raises(ConversionError, match="does not exist"):
        load_hf_config(str(tmp_path / "nope"))

    # config vs tensors: an extra layer's tensors, and a missing shard of a sharded checkpoint
    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(hf, "model.safetensors"))
    bad = tmp_path / "extra"
    bad.mkdir()
    extra = dict(tensors, **{"model.layers.9.mlp.down_proj.weight": torch.zeros(2, 2)})
    save_file(extra, str(bad / "model.safetensors"))
    with pytest.raises(ConversionError, match=r"unexpected tensors \['model.layers.9.mlp.down_proj.weight'\]"):
        check_hf_tensor_names(mapping_for(cfg), SafetensorsReader(str(bad)))
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:5]}, str(sharded / "model-00001-of-00002.safetensors"))
    index = {"weight_map": {n: ("model-00001-of-00002.safetensors" if i < 5 else "model-00002-of-00002.safetensors")
                            for i, n in enumerate(names)}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConversionError, match="model-00002-of-00002.safetensors"):
        SafetensorsReader(str(sharded))


def test_exported_tensors_are_host_tensors():
    """megatron_to_hf collects a whole stage before writing: on a GPU each tensor must be moved off it right away
    (the device check bites only where CUDA is present; on the CPU this checks dtype, layout and values)."""
    from megatron_searchr1.models.convert import host_tensors

    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = torch.arange(12, dtype=torch.float32, device=device).reshape(3, 4)
    out = host_tensors([("a", base.t()), ("b", base)], torch.bfloat16)
    assert sorted(out) == ["a", "b"]
    for name, ref in (("a", base.t()), ("b", base)):
        t = out[name]
        assert t.device.type == "cpu" and t.dtype == torch.bfloat16 and t.is_contiguous()
        assert torch.equal(t, ref.to(torch.bfloat16).cpu())



def test_export_keeps_tensors_on_writers_only():
    """megatron_to_hf: TP rank 0 of DP replica 0 keeps and writes its stage; the other TP ranks take part in the
    all-gathers and keep nothing; other DP replicas do not gather at all."""
    from megatron_searchr1.models.convert import export_role, host_tensors

    assert export_role(0, 0) == "write" and export_role(1, 0) == "gather"
    assert export_role(0, 1) == export_role(3, 2) == "skip"
    seen = []

    def pairs():  # stands for gather_hf_weights: each step is a collective every TP rank must run
        for i in range(3):
            seen.append(i)
            yield f"t{i}", torch.full((2,), float(i))

    assert host_tensors(pairs(), torch.float32, keep=False) == {} and seen == [0, 1, 2]
    kept = host_tensors(pairs(), torch.bfloat16)
    assert sorted(kept) == ["t0", "t1", "t2"] and kept["t2"].dtype == torch.bfloat16
