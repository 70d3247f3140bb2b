"""Mixture-of-experts families: Qwen3-MoE (routed experts, q/k norm) and Qwen2-MoE (routed experts plus a shared
expert behind a sigmoid gate, q/k/v bias).

An MoE layer keeps the dense layer's attention and norms and replaces its MLP by Megatron's MoELayer:

    HF  model.layers.{i}.mlp.gate.weight                  (E, h)   -> mlp.router.weight
        model.layers.{i}.mlp.experts.{e}.gate_proj/up_proj (fm, h) -> mlp.experts.local_experts.{e}.linear_fc1 [gate;up]
        model.layers.{i}.mlp.experts.{e}.down_proj        (h, fm)  -> mlp.experts.local_experts.{e}.linear_fc2
        model.layers.{i}.mlp.shared_expert.*_proj                  -> mlp.shared_experts.linear_fc1 / linear_fc2
        model.layers.{i}.mlp.shared_expert_gate.weight    (1, h)   -> mlp.shared_experts.gate_weight

Megatron's names are those of Megatron's SequentialMLP (the local spec, which the CPU runs). TE's grouped-GEMM
experts (TEGroupedMLP, the TE spec with `moe_grouped_gemm`) hold the same tensors as `mlp.experts.linear_fc1.weight{j}`
/ `linear_fc2.weight{j}` (local expert j); every name is read through base.te_to_local_name, which renames them, and
convert.global_names gives them SequentialMLP's global names. Expert linears split over the expert-TP group
(parallel.expert_tp), not the TP group.

Which layers have experts follows HF: layer i does unless i is in `mlp_only_layers` or (i + 1) is not a multiple of
`decoder_sparse_step`; the other layers are dense MLPs of `intermediate_size` (spec.block_spec builds both kinds).
Router: softmax over the E logits, top-k; `norm_topk_prob=True` renormalises the k probabilities (Megatron
`moe_router_pre_softmax=False`: softmax over the k chosen logits, the same numbers), False keeps them
(`moe_router_pre_softmax=True`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from megatron_searchr1.models.families.base import (
    LAYER_TENSORS, MOE_LAYER_TENSORS, ModelFamily, Tensor, expert_index, layer_name, layer_table_key,
    split_layer_name, stack_gate_up, te_to_local_name, unstack_gate_up,
)
from megatron_searchr1.models.families.dims import ModelDims, MoeDims, config_get
from megatron_searchr1.models.families.qwen2 import Qwen2Family
from megatron_searchr1.models.families.qwen3 import Qwen3Family


def moe_layer_indices(num_layers: int, sparse_step: int, mlp_only_layers) -> tuple[int, ...]:
    """HF's rule for which layers have experts.

    >>> moe_layer_indices(4, 1, []), moe_layer_indices(4, 2, []), moe_layer_indices(4, 1, [0, 3])
    ((0, 1, 2, 3), (1, 3), (1, 2))
    """
    if sparse_step < 1:
        raise ValueError(f"decoder_sparse_step={sparse_step} must be >= 1")
    dense = set(mlp_only_layers or ())
    return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % sparse_step == 0)


class MoeFamily(ModelFamily):
    """Name and tensor mapping for a decoder whose MLPs are (some or all) mixtures of experts."""

    shared_expert: bool = False

    @classmethod
    def read_moe(cls, hf_config: Any) -> MoeDims:
        g = lambda k, d=None: config_get(hf_config, k, d)  # noqa: E731
        num_experts = g("num_experts") or g("num_local_experts")
        if not num_experts:
            raise ValueError(f"{cls.architectures[0]} config has num_experts=0: convert it as its dense family")
        topk = int(g("num_experts_per_tok"))
        if not 1 <= topk <= num_experts:
            raise ValueError(f"num_experts_per_tok={topk} must be between 1 and num_experts={num_experts}")
        shared = int(g("shared_expert_intermediate_size", 0) or 0) if cls.shared_expert else 0
        return MoeDims(
            num_experts=int(num_experts), topk=topk, ffn_hidden_size=int(g("moe_intermediate_size")),
            norm_topk_prob=bool(g("norm_topk_prob", False)),
            aux_loss_coeff=float(g("router_aux_loss_coef", 0.001) or 0.0),
            layers=moe_layer_indices(g("num_hidden_layers"), int(g("decoder_sparse_step", 1) or 1),
                                     g("mlp_only_layers", [])),
            shared_expert_size=shared, shared_expert_gate=shared > 0)

    @classmethod
    def read_dims(cls, hf_config: Any, padded_vocab_size: int | None = None) -> ModelDims:
        dims = super().read_dims(hf_config, padded_vocab_size)
        return dataclasses.replace(dims, moe=cls.read_moe(hf_config))

    # -- the names ----------------------------------------------------------------------------------------------
    def layer_sources_at(self, index: int) -> dict[str, tuple[str, ...]]:
        """Layer `index`'s Megatron suffix -> HF suffixes: a dense layer's, or attention + norms + the MoE tensors,
        one entry per routed expert (global expert index)."""
        d = self.dims
        if not d.is_moe_layer(index):
            return self.layer_sources()
        out = {s: t.hf for s, t in LAYER_TENSORS.items() if t.present(d) and not s.startswith("mlp.")}
        for suffix, t in MOE_LAYER_TENSORS.items():
            if not t.present(d):
                continue
            if "{e}" in suffix:
                for e in range(d.moe.num_experts):
                    out[suffix.format(e=e)] = tuple(h.format(e=e) for h in t.hf)
            else:
                out[suffix] = t.hf
        return out

    def layer_megatron_names(self, index: int) -> list[str]:
        return [layer_name(index, s) for s in self.layer_sources_at(index)]

    def layer_hf_names(self, index: int) -> list[str]:
        return [f"model.layers.{index}.{s}" for srcs in self.layer_sources_at(index).values() for s in srcs]

    def hf_sources(self, name: str) -> list[str]:
        local = te_to_local_name(name)
        parsed = split_layer_name(local)
        if parsed is None:
            return super().hf_sources(name)
        i, suffix = parsed
        if i >= self.dims.num_layers:
            raise KeyError(f"{name!r}: layer {i} does not exist (num_layers={self.dims.num_layers})")
        e = expert_index(suffix)
        if e is not None and e >= self.dims.moe.num_experts:
            raise KeyError(f"{name!r}: expert {e} does not exist (num_experts={self.dims.moe.num_experts})")
        sources = self.layer_sources_at(i)
        if suffix not in sources:
            raise KeyError(f"{type(self).__name__} has no HF source for Megatron parameter {name!r} (layer {i} is "
                           f"{'MoE' if self.dims.is_moe_layer(i) else 'dense'})")
        return [f"model.layers.{i}.{s}" for s in sources[suffix]]

    # -- the tensors --------------------------------------------------------------------------------------------
    def _moe_key(self, name: str) -> str | None:
        """The MOE_LAYER_TENSORS key of an MoE-layer tensor name, None for every other name."""
        parsed = split_layer_name(te_to_local_name(name))
        if parsed is None or not self.dims.is_moe_layer(parsed[0]):
            return None
        key = layer_table_key(parsed[1])
        return key if key in MOE_LAYER_TENSORS else None

    def hf_to_megatron(self, name: str, hf_tensors: Mapping[str, Tensor]) -> Tensor:
        key = self._moe_key(name)
        if key is None:
            return super().hf_to_megatron(name, hf_tensors)
        srcs = self.hf_sources(name)
        missing = [s for s in srcs if s not in hf_tensors]
        if missing:
            raise KeyError(f"building {name!r} needs HF tensors {missing} which were not given")
        ts = [hf_tensors[s] for s in srcs]
        full = stack_gate_up(*ts) if MOE_LAYER_TENSORS[key].tp == "fc1" else ts[0]
        self._check_shape(", ".join(srcs), full, self.megatron_shape(name))
        return full

    def megatron_to_hf(self, name: str, tensor: Tensor) -> list[tuple[str, Tensor]]:
        key = self._moe_key(name)
        if key is None:
            return super().megatron_to_hf(name, tensor)
        srcs = self.hf_sources(name)
        return list(zip(srcs, unstack_gate_up(tensor))) if MOE_LAYER_TENSORS[key].tp == "fc1" else [(srcs[0], tensor)]

    def megatron_shape(self, name: str) -> tuple[int, ...]:
        key = self._moe_key(name)
        return super().megatron_shape(name) if key is None else MOE_LAYER_TENSORS[key].shape(self.dims)


class Qwen3MoeFamily(MoeFamily, Qwen3Family):
    """Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention (q/k norm, no bias), routed experts, no shared
    expert."""

    architectures = ("Qwen3MoeForCausalLM",)
    model_types = ("qwen3_moe",)


class Qwen2MoeFamily(MoeFamily, Qwen2Family):
    """Qwen2-MoE / Qwen1.5-MoE: Qwen2 attention (q/k/v bias), routed experts plus a shared expert whose output is
    scaled by sigmoid(x @ shared_expert_gate)."""

    architectures = ("Qwen2MoeForCausalLM",)
    model_types = ("qwen2_moe",)
    shared_expert = True

    @classmethod
    def qkv_bias(cls, hf_config: Any) -> bool:
        return bool(config_get(hf_config, "qkv_bias", True))

