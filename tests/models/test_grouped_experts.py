"""Grouped-GEMM experts (TE's TEGroupedMLP, models/spec.py) and the expert tensor-parallel size (models/config.py):
the module tree Megatron builds for them, on the meta device at Qwen3-30B-A3B's real widths, maps name for name and
shape for shape onto the HF checkpoint and back (families/base.grouped_to_sequential_name, convert.global_names).

Transformer Engine does not run on the CPU, so its GroupedLinear is stood in for by a module that registers what TE's
registers and Megatron's TE wrapper reads back (`weight{j}` per local expert, the expert-TP shard of one expert's
linear: Megatron's TEGroupedLinear.sharded_state_dict maps `weight{j}` to expert j); the MoE layer, its router and
TEGroupedMLP around it are Megatron's own."""
from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_searchr1.models.config import check_parallel_sizes, transformer_config_from_hf
from megatron_searchr1.models.families import (
    get_family, grouped_to_sequential_name, sequential_to_grouped_name, te_to_local_name, tp_split,
)
from tests.models.test_gpt import megatron_tp1  # noqa: F401  (fixture)

HERE = os.path.dirname(__file__)


def real_config(num_layers: int = 2) -> dict:
    with open(os.path.join(HERE, "real_configs", "Qwen3-30B-A3B.json")) as f:
        raw = json.load(f)
    return {**raw, "num_hidden_layers": num_layers}


class GroupedLinearStandIn(torch.nn.Module):
    """TE GroupedLinear's parameters: one `weight{j}` (out/etp, in) or (out, in/etp) per local expert."""

    def __init__(self, num_gemms, input_size, output_size, *, config, init_method, bias, skip_bias_add, is_expert,
                 tp_comm_buffer_name=None, pg_collection=None, column=True):
        super().__init__()
        etp = pg_collection.expt_tp.size()
        shape = (output_size // etp, input_size) if column else (output_size, input_size // etp)
        for j in range(num_gemms):
            self.register_parameter(f"weight{j}", torch.nn.Parameter(torch.empty(shape)))


class ColumnStandIn(GroupedLinearStandIn):
    pass


class RowStandIn(GroupedLinearStandIn):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, column=False, **kwargs)


def grouped_model(raw: dict, monkeypatch):
    """A meta-device GPTModel of `raw` whose MoE layers hold TEGroupedMLP experts (grouped-GEMM spec)."""
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_searchr1.models import spec
    from megatron_searchr1.models.gpt import build_gpt_model

    local_layer_spec = spec.layer_spec

    def layer_spec(use_te, qk_norm=False, num_experts=None, grouped_gemm=False):
        out = local_layer_spec(use_te, qk_norm, num_experts)  # the local spec: attention, norms, MoELayer
        if num_experts:
            assert grouped_gemm, "block_spec did not ask for grouped experts"
            out.submodules.mlp.submodules.experts = ModuleSpec(
                module=TEGroupedMLP, submodules=MLPSubmodules(linear_fc1=ColumnStandIn, linear_fc2=RowStandIn))
        return out

    monkeypatch.setattr(spec, "layer_spec", layer_spec)
    config = transformer_config_from_hf(raw, moe_grouped_gemm=True, perform_initialization=False)
    with torch.device("meta"):
        return build_gpt_model(raw, config=config, use_te=False)


def test_grouped_names_are_a_rename_of_sequential_names():
    seq = "decoder.layers.3.mlp.experts.local_experts.17.linear_fc1.weight"
    grouped = "decoder.layers.3.mlp.experts.linear_fc1.weight17"
    assert sequential_to_grouped_name(seq) == grouped and grouped_to_sequential_name(grouped) == seq
    assert te_to_local_name(grouped) == seq
    for other in ("decoder.layers.3.mlp.router.weight", "decoder.layers.3.mlp.shared_experts.linear_fc1.weight"):
        assert sequential_to_grouped_name(other) == other == grouped_to_sequential_name(other)


@pytest.mark.slow
def test_grouped_expert_tree_maps_every_parameter_both_ways(megatron_tp1, monkeypatch):
    """Qwen3-30B-A3B widths (2 layers, 128 experts of 768): every parameter of the grouped tree has one HF source
    set, HF -> Megatron -> HF gives back exactly the checkpoint's names, and each parameter has the mapping's shape;
    the tree holds the same tensors as the SequentialMLP tree the CPU runs."""
    from megatron_searchr1.models.convert import global_names
    from megatron_searchr1.models.gpt import build_gpt_model

    raw = real_config(2)
    model = grouped_model(raw, monkeypatch)
    names = [n for n, _ in model.named_parameters()]
    assert "decoder.layers.1.mlp.experts.linear_fc1.weight127" in names
    assert not any("local_experts" in n for n in names)

    mapping = get_family(raw).from_hf_config(raw, padded_vocab_size=model.embedding.word_embeddings.weight.shape[0])
    hf_names = set()
    for _, g, p in global_names(model):
        assert tuple(p.shape) == mapping.megatron_shape(g), g
        srcs = mapping.hf_sources(g)
        hf_names.update(srcs)
        full = torch.empty(mapping.megatron_shape(g), device="meta")
        back = [n for n, _ in mapping.megatron_to_hf(g, full)]
        assert back == srcs, g
    assert hf_names == set(mapping.hf_names())

    monkeypatch.undo()  # back to the spec the CPU builds: SequentialMLP
    with torch.device("meta"):
        sequential = build_gpt_model(raw, config=transformer_config_from_hf(raw, perform_initialization=False),
                                     use_te=False)
    seq = {g: tuple(p.shape) for _, g, p in global_names(sequential)}
    assert seq == {g: tuple(p.shape) for _, g, p in global_names(model)}


def test_expert_tp_defaults_to_one_for_moe_and_sizes_the_expert_shards():
    """slime's Qwen3-30B-A3B layout: TP4 x EP8 with expert-TP 1 (whole experts per rank); expert-TP 2 halves an
    expert's fc1 rows and fc2 columns; an expert-TP that does not divide the expert width is refused."""
    raw = real_config(48)
    config = transformer_config_from_hf(raw, tp=4, ep=8, sequence_parallel=True)
    assert (config.expert_tensor_parallel_size, config.tensor_model_parallel_size) == (1, 4)
    assert transformer_config_from_hf(raw, tp=4, ep=8, expert_tp=2, sequence_parallel=True
                                      ).expert_tensor_parallel_size == 2
    mapping = get_family(raw).from_hf_config(raw)
    fc1 = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    fc2 = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"
    for etp, rows, cols in ((1, 1536, 768), (2, 768, 384)):
        assert tuple(tp_split(fc1, torch.empty(mapping.megatron_shape(fc1), device="meta"), etp)[0].shape) == (rows, 2048)
        assert tuple(tp_split(fc2, torch.empty(mapping.megatron_shape(fc2), device="meta"), etp)[0].shape) == (2048, cols)
    check_parallel_sizes(raw, 4, 1, ep=8, world_size=32)
    with pytest.raises(ValueError, match="expert TP=5 does not divide moe_intermediate_size=768"):
        check_parallel_sizes(raw, 4, 1, ep=8, expert_tp=5)


def test_model_settings_take_expert_tp_and_refuse_grouped_gemm_on_the_local_spec():
    from megatron_searchr1.models import spec
    from megatron_searchr1.models.gpt import model_settings

    raw = real_config(2)
    s = model_settings(raw, tp=2, pp=1, params_dtype=torch.float32, use_te=False, sequence_parallel=True)
    assert s["config"].expert_tensor_parallel_size == 1 and not s["config"].moe_grouped_gemm
    assert not s["config"].moe_permute_fusion
    s = model_settings(raw, tp=2, pp=1, params_dtype=torch.float32, use_te=False, sequence_parallel=True, expert_tp=2)
    assert s["config"].expert_tensor_parallel_size == 2
    with pytest.raises(ValueError, match="need the Transformer Engine spec"):
        spec.layer_spec(False, True, num_experts=4, grouped_gemm=True)
