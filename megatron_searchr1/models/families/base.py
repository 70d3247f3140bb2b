"""Hugging Face <-> Megatron-core weight mapping shared by the dense decoder families (Qwen2, Qwen3, Llama, Mistral).

Everything here is a pure tensor function over names and tensors: no torch.distributed, no Megatron import. The
checkpoint converter and the rollout weight sync both use it, one tensor (or one layer) at a time, so a converter
can stream safetensors shards and a weight sync can go bucket by bucket.

Conventions
- A *Megatron name* is the name in a GPTModel's `state_dict()` built with Megatron's local layer spec, with a GLOBAL
  layer index (`decoder.layers.{i}.self_attention.linear_qkv.weight`). A pipeline stage's own state dict uses
  stage-LOCAL layer indices: `rename_layer` with the global indices the stage's layers carry (any split), or
  `local_to_global_name` / `global_to_local_name` for a uniform split.
  The Transformer Engine spec fuses the pre-attention / pre-MLP norms into the next linear
  (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`): `te_to_local_name` / `local_to_te_name`.
- A *full* Megatron tensor is the TP-merged tensor (what TP=1 holds), with the vocab padded to `padded_vocab_size`.
  `tp_split` / `tp_merge` go between a full tensor and the per-TP-rank shards.

Layouts (h = hidden, d = head dim, nq = query heads, ng = query groups = kv heads, f = ffn hidden)
- linear_qkv.weight (ng * (nq/ng + 2) * d, h): rows grouped per query group, each group [q heads of the group, k, v].
- linear_fc1.weight (2f, h): [gate; up] stacked; a TP rank holds [gate_r; up_r] (each split, then stacked).
- q_layernorm / k_layernorm.weight (d,): Qwen3's per-head RMSNorm weights, the same on every TP rank.
- embedding / output_layer (padded_vocab, h): vocab rows, split over TP; padding rows are zeros.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from megatron_searchr1.models.families.dims import ModelDims, check_common, config_get, rope_settings

Tensor = torch.Tensor

# ----------------------------------------------------------------------------------------------------------------
# Names
# ----------------------------------------------------------------------------------------------------------------
EMBEDDING = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT_LAYER = "output_layer.weight"
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# The one per-layer table: Megatron suffix -> how it is split over TP, the HF tensors it is built from (within
# `model.layers.{i}.`), its full (TP-merged) shape, whether a model has it, and its Transformer Engine name when TE
# fuses it into the following linear. TP kinds: "column": rows (dim 0) split; "row": columns (dim 1) split;
# "replicated": every rank holds it all; "fc1": gate and up each split on rows then stacked per rank.
@dataclass(frozen=True)
class LayerTensor:
    tp: str
    hf: tuple[str, ...]
    shape: Callable[[ModelDims], tuple[int, ...]]
    present: Callable[[ModelDims], bool] = lambda d: True
    te_name: str | None = None


def _qkv_rows(d: ModelDims) -> int:
    return (d.num_heads + 2 * d.num_kv_heads) * d.head_dim


_ATTN = "self_attn."
LAYER_TENSORS: dict[str, LayerTensor] = {
    "input_layernorm.weight": LayerTensor(
        "replicated", ("input_layernorm.weight",), lambda d: (d.hidden_size,),
        te_name="self_attention.linear_qkv.layer_norm_weight"),
    "self_attention.linear_qkv.weight": LayerTensor(
        "column", tuple(f"{_ATTN}{p}_proj.weight" for p in "qkv"), lambda d: (_qkv_rows(d), d.hidden_size)),
    "self_attention.linear_qkv.bias": LayerTensor(
        "column", tuple(f"{_ATTN}{p}_proj.bias" for p in "qkv"), lambda d: (_qkv_rows(d),), lambda d: d.qkv_bias),
    "self_attention.q_layernorm.weight": LayerTensor(
        "replicated", (f"{_ATTN}q_norm.weight",), lambda d: (d.head_dim,), lambda d: d.qk_norm),
    "self_attention.k_layernorm.weight": LayerTensor(
        "replicated", (f"{_ATTN}k_norm.weight",), lambda d: (d.head_dim,), lambda d: d.qk_norm),
    "self_attention.linear_proj.weight": LayerTensor(
        "row", (f"{_ATTN}o_proj.weight",), lambda d: (d.hidden_size, d.num_heads * d.head_dim)),
    "self_attention.linear_proj.bias": LayerTensor(
        "replicated", (f"{_ATTN}o_proj.bias",), lambda d: (d.hidden_size,), lambda d: d.linear_bias),
    "pre_mlp_layernorm.weight": LayerTensor(
        "replicated", ("post_attention_layernorm.weight",), lambda d: (d.hidden_size,),
        te_name="mlp.linear_fc1.layer_norm_weight"),
    "mlp.linear_fc1.weight": LayerTensor(
        "fc1", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), lambda d: (2 * d.ffn_hidden_size, d.hidden_size)),
    "mlp.linear_fc1.bias": LayerTensor(
        "fc1", ("mlp.gate_proj.bias", "mlp.up_proj.bias"), lambda d: (2 * d.ffn_hidden_size,), lambda d: d.linear_bias),
    "mlp.linear_fc2.weight": LayerTensor(
        "row", ("mlp.down_proj.weight",), lambda d: (d.hidden_size, d.ffn_hidden_size)),
    "mlp.linear_fc2.bias": LayerTensor(
        "replicated", ("mlp.down_proj.bias",), lambda d: (d.hidden_size,), lambda d: d.linear_bias),
}
TP_KIND_NON_LAYER = {EMBEDDING: "vocab", OUTPUT_LAYER: "vocab", FINAL_NORM: "replicated"}

# A mixture-of-experts layer (families/moe.py) replaces the dense `mlp.*` tensors above with these; `{e}` is the
# expert index. In a *full* (global) Megatron name it is the GLOBAL expert index; a rank's own state dict numbers its
# experts from 0 (`local_experts.{j}` is global expert ep_rank * E/ep + j): `rename_expert`. Expert linears are
# split over the expert-tensor-parallel group like the dense MLP ("fc1", "row"); the router and the shared expert's
# gate are replicated; the shared expert is a dense MLP over the TP group.
_EXPERT = "mlp.experts.local_experts.{e}."
MOE_LAYER_TENSORS: dict[str, LayerTensor] = {
    "mlp.router.weight": LayerTensor(
        "replicated", ("mlp.gate.weight",), lambda d: (d.moe.num_experts, d.hidden_size)),
    _EXPERT + "linear_fc1.weight": LayerTensor(
        "fc1", ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
        lambda d: (2 * d.moe.ffn_hidden_size, d.hidden_size)),
    _EXPERT + "linear_fc2.weight": LayerTensor(
        "row", ("mlp.experts.{e}.down_proj.weight",), lambda d: (d.hidden_size, d.moe.ffn_hidden_size)),
    "mlp.shared_experts.linear_fc1.weight": LayerTensor(
        "fc1", ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
        lambda d: (2 * d.moe.shared_expert_size, d.hidden_size), lambda d: d.moe.shared_expert_size > 0),
    "mlp.shared_experts.linear_fc2.weight": LayerTensor(
        "row", ("mlp.shared_expert.down_proj.weight",), lambda d: (d.hidden_size, d.moe.shared_expert_size),
        lambda d: d.moe.shared_expert_size > 0),
    "mlp.shared_experts.gate_weight": LayerTensor(
        "replicated", ("mlp.shared_expert_gate.weight",), lambda d: (1, d.hidden_size),
        lambda d: d.moe.shared_expert_gate),
}
_EXPERT_RE = re.compile(r"(mlp\.experts\.local_experts\.)(\d+)(\.)")


def expert_index(name: str) -> int | None:
    """The expert index in a routed expert's parameter name, None for any other name.

    >>> expert_index("decoder.layers.1.mlp.experts.local_experts.5.linear_fc2.weight"), expert_index("embedding")
    (5, None)
    """
    m = _EXPERT_RE.search(grouped_to_sequential_name(name))
    return int(m.group(2)) if m else None


def rename_expert(name: str, offset: int) -> str:
    """Shift a routed expert's index by `offset` (rank-local -> global: offset = ep_rank * E/ep; back: -offset).

    >>> rename_expert("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", 4)
    'decoder.layers.0.mlp.experts.local_experts.5.linear_fc1.weight'
    """
    return _EXPERT_RE.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + offset}{m.group(3)}", name, count=1)


def is_expert_param(name: str) -> bool:
    """True for routed-expert parameters: Megatron splits them over the expert-parallel and expert-tensor-parallel
    groups and all-reduces their gradients over the expert-data-parallel group (they carry `allreduce=False`)."""
    return expert_index(name) is not None


def layer_table_key(suffix: str) -> str:
    """A layer suffix as the tables key it (`local_experts.7.` -> `local_experts.{e}.`)."""
    return _EXPERT_RE.sub(lambda m: m.group(1) + "{e}" + m.group(3), suffix, count=1)


def split_layer_name(name: str) -> tuple[int, str] | None:
    """`decoder.layers.3.mlp.linear_fc2.weight` -> (3, 'mlp.linear_fc2.weight'); None for non-layer names."""
    m = _LAYER_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def layer_name(index: int, suffix: str) -> str:
    return f"decoder.layers.{index}.{suffix}"


# Transformer Engine's grouped-GEMM experts (Megatron's TEGroupedMLP of TE GroupedLinear, `moe_grouped_gemm=True`
# on the TE spec) hold one weight per local expert, `weight{j}`, in the module that serves all of them:
# `mlp.experts.linear_fc1.weight{j}` is `mlp.experts.local_experts.{j}.linear_fc1.weight` with the same shape
# ([gate_r; up_r] rows of expert j on expert-TP rank r), so the grouped naming is a rename, like the fused norms.
_GROUPED_RE = re.compile(r"(mlp\.experts\.)(linear_fc[12])\.(weight|bias)(\d+)$")
_SEQUENTIAL_RE = re.compile(r"(mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")


def grouped_to_sequential_name(name: str) -> str:
    """TEGroupedMLP's expert name -> SequentialMLP's (identity for every other name).

    >>> grouped_to_sequential_name("decoder.layers.2.mlp.experts.linear_fc2.weight7")
    'decoder.layers.2.mlp.experts.local_experts.7.linear_fc2.weight'
    """
    return _GROUPED_RE.sub(lambda m: f"{m.group(1)}local_experts.{m.group(4)}.{m.group(2)}.{m.group(3)}", name)


def sequential_to_grouped_name(name: str) -> str:
    """SequentialMLP's expert name -> TEGroupedMLP's (identity for every other name).

    >>> sequential_to_grouped_name("decoder.layers.2.mlp.experts.local_experts.7.linear_fc1.weight")
    'decoder.layers.2.mlp.experts.linear_fc1.weight7'
    """
    return _SEQUENTIAL_RE.sub(lambda m: f"{m.group(1)}{m.group(3)}.{m.group(4)}{m.group(2)}", name)


def te_to_local_name(name: str) -> str:
    """Transformer Engine spec name (fused norms, grouped experts) -> local spec name (identity for names that do
    not differ)."""
    name = grouped_to_sequential_name(name)
    for local, entry in LAYER_TENSORS.items():
        if entry.te_name and name.endswith("." + entry.te_name):
            return name[: -len(entry.te_name)] + local
    return name


def local_to_te_name(name: str, grouped_experts: bool = False) -> str:
    """Local spec name -> Transformer Engine spec name (`grouped_experts`: the TE spec with moe_grouped_gemm)."""
    if grouped_experts:
        name = sequential_to_grouped_name(name)
    for local, entry in LAYER_TENSORS.items():
        if entry.te_name and name.endswith("." + local) and name.startswith("decoder.layers."):
            return name[: -len(local)] + entry.te_name
    return name


def tp_kind(name: str) -> str:
    """How a Megatron tensor is split over TP ranks: 'column', 'row', 'fc1', 'vocab' or 'replicated'."""
    name = te_to_local_name(name)
    if name in TP_KIND_NON_LAYER:
        return TP_KIND_NON_LAYER[name]
    parsed = split_layer_name(name)
    key = None if parsed is None else layer_table_key(parsed[1])
    if key in MOE_LAYER_TENSORS:
        return MOE_LAYER_TENSORS[key].tp
    if key not in LAYER_TENSORS:
        raise KeyError(f"no tensor-parallel rule for Megatron parameter {name!r}")
    return LAYER_TENSORS[key].tp


# ----------------------------------------------------------------------------------------------------------------
# QKV interleave and gate/up stacking
# ----------------------------------------------------------------------------------------------------------------
def interleave_qkv(q: Tensor, k: Tensor, v: Tensor, num_heads: int, num_kv_heads: int) -> Tensor:
    """HF q/k/v projections -> Megatron linear_qkv (weight or bias).

    q: (nq*d, ...), k and v: (ng*d, ...) -> (ng * (nq/ng + 2) * d, ...), per group [q heads of the group; k; v].
    """
    d = k.shape[0] // num_kv_heads
    rest = q.shape[1:]
    per_group = num_heads // num_kv_heads
    q = q.reshape(num_kv_heads, per_group * d, *rest)
    k = k.reshape(num_kv_heads, d, *rest)
    v = v.reshape(num_kv_heads, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def deinterleave_qkv(qkv: Tensor, num_heads: int, num_kv_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """Megatron linear_qkv (weight or bias) -> HF (q, k, v); inverse of `interleave_qkv`."""
    per_group = num_heads // num_kv_heads
    rest = qkv.shape[1:]
    d = qkv.shape[0] // (num_kv_heads * (per_group + 2))
    grouped = qkv.reshape(num_kv_heads, (per_group + 2) * d, *rest)
    q, k, v = torch.split(grouped, [per_group * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def stack_gate_up(gate: Tensor, up: Tensor) -> Tensor:
    """HF gate_proj, up_proj (f, h) -> Megatron linear_fc1 (2f, h) = [gate; up]."""
    return torch.cat([gate, up], dim=0)


def unstack_gate_up(fc1: Tensor) -> tuple[Tensor, Tensor]:
    """Megatron linear_fc1 (2f, h) -> (gate, up)."""
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate, up


# ----------------------------------------------------------------------------------------------------------------
# Tensor parallelism
# ----------------------------------------------------------------------------------------------------------------
def _check_divisible(name: str, size: int, tp: int) -> None:
    if size % tp != 0:
        raise ValueError(f"{name}: dimension {size} is not divisible by tensor-parallel size {tp}")


def tp_split(name: str, full: Tensor, tp: int) -> list[Tensor]:
    """A full Megatron tensor -> the `tp` shards (index = TP rank) Megatron's layers hold.

    The QKV rows are already grouped per query group, so a plain row split hands each rank whole groups (or, when
    tp > ng, a contiguous slice of one group, which is also what Megatron's attention expects).
    """
    kind = tp_kind(name)
    if tp == 1 or kind == "replicated":
        return [full] * tp
    if kind in ("column", "vocab"):
        _check_divisible(name, full.shape[0], tp)
        return list(torch.chunk(full, tp, dim=0))
    if kind == "row":
        _check_divisible(name, full.shape[1], tp)
        return list(torch.chunk(full, tp, dim=1))
    # fc1: gate and up are split separately so every rank gets matching gate/up rows.
    gate, up = unstack_gate_up(full)
    _check_divisible(name, gate.shape[0], tp)
    return [stack_gate_up(g, u) for g, u in zip(torch.chunk(gate, tp, dim=0), torch.chunk(up, tp, dim=0))]


def tp_merge(name: str, shards: list[Tensor]) -> Tensor:
    """The per-TP-rank shards (in TP rank order) -> the full Megatron tensor; inverse of `tp_split`."""
    kind = tp_kind(name)
    if len(shards) == 1 or kind == "replicated":
        return shards[0]
    if kind in ("column", "vocab"):
        return torch.cat(shards, dim=0)
    if kind == "row":
        return torch.cat(shards, dim=1)
    gates, ups = zip(*(unstack_gate_up(s) for s in shards))
    return stack_gate_up(torch.cat(gates, dim=0), torch.cat(ups, dim=0))


def tp_place(name: str, full: Tensor, tp: int, rank: int, shard: Tensor) -> None:
    """Copy TP rank `rank`'s shard into `full` where `tp_merge` puts it: one rank's part of the merge, in place (the
    weight sync's shared buffer holds merged tensors that each rank fills with its own shard)."""
    kind = tp_kind(name)
    if kind == "fc1":  # full = [gate_0 .. gate_tp-1; up_0 .. up_tp-1], a shard = [gate_r; up_r]
        for dst, src in zip(unstack_gate_up(full), unstack_gate_up(shard)):
            dst.chunk(tp, dim=0)[rank].copy_(src)
    elif kind == "replicated":
        full.copy_(shard)
    else:  # column, vocab: rows; row: columns
        full.chunk(tp, dim=1 if kind == "row" else 0)[rank].copy_(shard)


# ----------------------------------------------------------------------------------------------------------------
# Pipeline parallelism. A stage's state dict uses stage-local layer indices; its layers know their global index
# (`layer.layer_number - 1`), which is what the converter and the weight sync read (`rename_layer`), so uneven
# splits (num_layers_in_first/last_pipeline_stage) map correctly. The helpers below compute the uniform split.
# ----------------------------------------------------------------------------------------------------------------
def stage_layer_counts(num_layers: int, pp: int, first: int | None = None, last: int | None = None) -> list[int]:
    """Layers per pipeline stage, as Megatron splits them: `first` / `last` (when given) on the first / last stage,
    the rest evenly over the other stages; ValueError saying what to change when that does not divide.

    >>> stage_layer_counts(8, 4), stage_layer_counts(7, 3, first=1), stage_layer_counts(5, 2, last=2)
    ([2, 2, 2, 2], [1, 3, 3], [3, 2])
    """
    if pp == 1:
        return [num_layers]
    ends = [x for x in (first, last) if x is not None]
    middle_stages = pp - len(ends)
    middle_layers = num_layers - sum(ends)
    if any(x < 1 for x in ends) or middle_layers < 0:
        raise ValueError(f"num_layers_in_first/last_pipeline_stage={first}/{last} do not fit num_layers={num_layers}")
    if middle_stages == 0:
        if middle_layers:
            raise ValueError(f"PP={pp}: first + last stage layers ({first} + {last}) must equal num_layers={num_layers}")
        return [first, last]
    if middle_layers % middle_stages:
        what = "PP" if not ends else "the stages between the first and last"
        raise ValueError(f"PP={pp} does not divide num_hidden_layers={num_layers}: choose a PP that divides it"
                         if not ends else
                         f"{what} ({middle_stages}) must split the remaining {middle_layers} layers evenly: change "
                         "num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage")
    per = middle_layers // middle_stages
    return ([first] if first is not None else []) + [per] * middle_stages + ([last] if last is not None else [])


def pp_layer_range(num_layers: int, pp: int, pp_rank: int) -> range:
    """Global indices of the layers stage `pp_rank` holds (uniform split, as Megatron does without overrides)."""
    if num_layers % pp != 0:
        raise ValueError(f"num_layers={num_layers} is not divisible by pipeline-parallel size {pp}")
    per_stage = num_layers // pp
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


def global_to_local_layer(index: int, num_layers: int, pp: int) -> tuple[int, int]:
    """Global layer index -> (pp_rank, index within that stage), uniform split."""
    per_stage = pp_layer_range(num_layers, pp, 0).stop
    return index // per_stage, index % per_stage


def rename_layer(name: str, global_index: Sequence[int]) -> str:
    """A stage's state-dict name -> the global name, `global_index[i]` being the global index of local layer i
    (read off the model: `[layer.layer_number - 1 for layer in model.decoder.layers]`)."""
    parsed = split_layer_name(name)
    return name if parsed is None else layer_name(global_index[parsed[0]], parsed[1])


def local_to_global_name(name: str, num_layers: int, pp: int, pp_rank: int) -> str:
    """A stage's state-dict name (local layer index) -> the global Megatron name, uniform split."""
    return rename_layer(name, pp_layer_range(num_layers, pp, pp_rank))


def global_to_local_name(name: str, num_layers: int, pp: int) -> tuple[int | None, str]:
    """Global Megatron name -> (pp_rank owning the layer, stage-local name), uniform split; pp_rank None for
    non-layer names."""
    parsed = split_layer_name(name)
    if parsed is None:
        return None, name
    stage, local = global_to_local_layer(parsed[0], num_layers, pp)
    return stage, layer_name(local, parsed[1])


# ----------------------------------------------------------------------------------------------------------------
# Vocab padding
# ----------------------------------------------------------------------------------------------------------------
def pad_vocab(t: Tensor, padded_vocab_size: int) -> Tensor:
    """(vocab, h) -> (padded_vocab, h) with zero rows appended (Megatron splits the vocab evenly over TP)."""
    if t.shape[0] > padded_vocab_size:
        raise ValueError(f"vocab rows {t.shape[0]} exceed padded_vocab_size {padded_vocab_size}")
    if t.shape[0] == padded_vocab_size:
        return t
    return torch.cat([t, t.new_zeros(padded_vocab_size - t.shape[0], *t.shape[1:])], dim=0)


def trim_vocab(t: Tensor, vocab_size: int) -> Tensor:
    """(padded_vocab, h) -> (vocab, h): drop the padding rows."""
    if t.shape[0] < vocab_size:
        raise ValueError(f"vocab rows {t.shape[0]} are fewer than vocab_size {vocab_size}")
    return t[:vocab_size]


# ----------------------------------------------------------------------------------------------------------------
# The family: reads an HF config into ModelDims, maps names and tensors
# ----------------------------------------------------------------------------------------------------------------
class ModelFamily:
    """Name and tensor mapping for a dense decoder; subclasses set the architectures and read their config."""

    architectures: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()

    def __init__(self, dims: ModelDims):
        self.dims = dims

    # -- reading the HF config (once) ---------------------------------------------------------------------------
    @classmethod
    def qkv_bias(cls, hf_config: Any) -> bool:
        """Whether q/k/v projections carry a bias in this family."""
        raise NotImplementedError

    @classmethod
    def linear_bias(cls, hf_config: Any) -> bool:
        """Whether o_proj and the MLP linears carry a bias (Megatron's add_bias_linear)."""
        return False

    @classmethod
    def qk_norm(cls, hf_config: Any) -> bool:
        """Whether queries and keys are RMS-normalised over the head dim."""
        return False

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        """Refuse what this family cannot translate (ValueError saying what to change)."""
        check_common(hf_config)

    @classmethod
    def read_dims(cls, hf_config: Any, padded_vocab_size: int | None = None) -> ModelDims:
        """Validate `hf_config` and read it into ModelDims; `padded_vocab_size` defaults to the unpadded size."""
        cls.check_config(hf_config)
        g = lambda k, d=None: config_get(hf_config, k, d)  # noqa: E731
        num_heads = g("num_attention_heads")
        vocab = g("vocab_size")
        dims = ModelDims(
            num_layers=g("num_hidden_layers"), hidden_size=g("hidden_size"), num_heads=num_heads,
            num_kv_heads=g("num_key_value_heads") or num_heads,
            head_dim=g("head_dim") or g("hidden_size") // num_heads, ffn_hidden_size=g("intermediate_size"),
            vocab_size=vocab, padded_vocab_size=padded_vocab_size or vocab,
            tie_embeddings=bool(g("tie_word_embeddings", False)), qkv_bias=cls.qkv_bias(hf_config),
            linear_bias=cls.linear_bias(hf_config), qk_norm=cls.qk_norm(hf_config),
            norm_eps=float(g("rms_norm_eps", 1e-6)), rope=rope_settings(hf_config),
            max_position_embeddings=int(g("max_position_embeddings", 4096) or 4096),
            attention_dropout=float(g("attention_dropout", 0.0) or 0.0),
            init_std=float(g("initializer_range", 0.02)), architecture=cls.architectures[0],
        )
        if dims.num_heads % dims.num_kv_heads != 0:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of "
                             f"num_key_value_heads={dims.num_kv_heads}")
        return dims

    @classmethod
    def from_hf_config(cls, hf_config: Any, padded_vocab_size: int | None = None) -> "ModelFamily":
        """Bind the mapping to a model: `padded_vocab_size` defaults to the unpadded vocab size."""
        return cls(cls.read_dims(hf_config, padded_vocab_size))

    # -- the names ----------------------------------------------------------------------------------------------
    def layer_sources(self) -> dict[str, tuple[str, ...]]:
        """Per-layer Megatron suffix -> the HF suffixes it is built from (within `model.layers.{i}.`), for the
        tensors this model has."""
        return {suffix: t.hf for suffix, t in LAYER_TENSORS.items() if t.present(self.dims)}

    def layer_megatron_names(self, index: int) -> list[str]:
        """Megatron names of one layer (global index): stream a model layer by layer with
        `{n: hf_to_megatron(n, hf_layer_tensors) for n in layer_megatron_names(i)}`."""
        return [layer_name(index, s) for s in self.layer_sources()]

    def layer_hf_names(self, index: int) -> list[str]:
        """HF names of one layer: exactly the tensors `layer_megatron_names(index)` are built from."""
        return [f"model.layers.{index}.{s}" for srcs in self.layer_sources().values() for s in srcs]

    def megatron_names(self, with_output_layer: bool | None = None) -> list[str]:
        """Every Megatron parameter name (global layer indices) of the full model.

        `with_output_layer`: default = not tied. Megatron keeps an `output_layer.weight` copy on the last stage when
        embeddings are tied and PP > 1; pass True to list it.
        """
        if with_output_layer is None:
            with_output_layer = not self.dims.tie_embeddings
        names = [EMBEDDING]
        for i in range(self.dims.num_layers):
            names += self.layer_megatron_names(i)
        names.append(FINAL_NORM)
        if with_output_layer:
            names.append(OUTPUT_LAYER)
        return names

    def hf_names(self) -> list[str]:
        """Every HF tensor name of the full model (no lm_head when tied)."""
        names = ["model.embed_tokens.weight"]
        for i in range(self.dims.num_layers):
            names += self.layer_hf_names(i)
        names.append("model.norm.weight")
        if not self.dims.tie_embeddings:
            names.append("lm_head.weight")
        return names

    def hf_sources(self, name: str) -> list[str]:
        """The HF tensor names a Megatron tensor is built from (global name; local or TE spec)."""
        name = te_to_local_name(name)
        if name == EMBEDDING:
            return ["model.embed_tokens.weight"]
        if name == FINAL_NORM:
            return ["model.norm.weight"]
        if name == OUTPUT_LAYER:
            # Tied: the output layer is the embedding (an HF checkpoint has no lm_head then).
            return ["model.embed_tokens.weight"] if self.dims.tie_embeddings else ["lm_head.weight"]
        parsed = split_layer_name(name)
        sources = self.layer_sources()
        if parsed is None or parsed[1] not in sources:
            raise KeyError(f"{type(self).__name__} has no HF source for Megatron parameter {name!r}")
        i, suffix = parsed
        if i >= self.dims.num_layers:
            raise KeyError(f"{name!r}: layer {i} does not exist (num_layers={self.dims.num_layers})")
        return [f"model.layers.{i}.{s}" for s in sources[suffix]]

    # -- the tensors --------------------------------------------------------------------------------------------
    def hf_to_megatron(self, name: str, hf_tensors: Mapping[str, Tensor]) -> Tensor:
        """Build one full Megatron tensor `name` (global name) from the HF tensors listed by `hf_sources(name)`."""
        d = self.dims
        srcs = self.hf_sources(name)
        missing = [s for s in srcs if s not in hf_tensors]
        if missing:
            raise KeyError(f"building {name!r} needs HF tensors {missing} which were not given")
        ts = [hf_tensors[s] for s in srcs]
        local = te_to_local_name(name)
        if local in (EMBEDDING, OUTPUT_LAYER):
            self._check_shape(srcs[0], ts[0], (d.vocab_size, d.hidden_size))
            return pad_vocab(ts[0], d.padded_vocab_size)
        if local.endswith("linear_qkv.weight") or local.endswith("linear_qkv.bias"):
            self._check_shape(srcs[0], ts[0], (d.num_heads * d.head_dim,) + tuple(ts[0].shape[1:]))
            self._check_shape(srcs[1], ts[1], (d.num_kv_heads * d.head_dim,) + tuple(ts[0].shape[1:]))
            return interleave_qkv(ts[0], ts[1], ts[2], d.num_heads, d.num_kv_heads)
        if local.endswith("linear_fc1.weight") or local.endswith("linear_fc1.bias"):
            self._check_shape(srcs[0], ts[0], (d.ffn_hidden_size,) + tuple(ts[0].shape[1:]))
            return stack_gate_up(ts[0], ts[1])
        return ts[0]

    def megatron_to_hf(self, name: str, tensor: Tensor) -> list[tuple[str, Tensor]]:
        """One full Megatron tensor (global name, TP-merged, vocab-padded) -> its HF (name, tensor) pairs.

        A tied model's `output_layer.weight` maps to nothing (HF ties lm_head to embed_tokens itself).
        """
        d = self.dims
        local = te_to_local_name(name)
        if local == EMBEDDING:
            return [("model.embed_tokens.weight", trim_vocab(tensor, d.vocab_size))]
        if local == OUTPUT_LAYER:
            return [] if d.tie_embeddings else [("lm_head.weight", trim_vocab(tensor, d.vocab_size))]
        srcs = self.hf_sources(local)
        if local.endswith("linear_qkv.weight") or local.endswith("linear_qkv.bias"):
            return list(zip(srcs, deinterleave_qkv(tensor, d.num_heads, d.num_kv_heads)))
        if local.endswith("linear_fc1.weight") or local.endswith("linear_fc1.bias"):
            return list(zip(srcs, unstack_gate_up(tensor)))
        return [(srcs[0], tensor)]

    # -- whole state dicts (tests, small models) ----------------------------------------------------------------
    def hf_to_megatron_state(self, hf: Mapping[str, Tensor], names: Iterable[str] | None = None) -> dict[str, Tensor]:
        """HF state dict -> full Megatron state dict (global names)."""
        return {n: self.hf_to_megatron(n, hf) for n in (names if names is not None else self.megatron_names())}

    def megatron_to_hf_state(self, mg: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Full Megatron state dict (global names) -> HF state dict."""
        out: dict[str, Tensor] = {}
        for n, t in mg.items():
            out.update(self.megatron_to_hf(n, t))
        return out

    def megatron_shape(self, name: str) -> tuple[int, ...]:
        """Full (TP-merged) shape of a Megatron tensor, to check a config against the tensors."""
        d = self.dims
        local = te_to_local_name(name)
        if local in (EMBEDDING, OUTPUT_LAYER):
            return (d.padded_vocab_size, d.hidden_size)
        if local == FINAL_NORM:
            return (d.hidden_size,)
        return LAYER_TENSORS[split_layer_name(local)[1]].shape(d)

    @staticmethod
    def _check_shape(name: str, t: Tensor, expected: tuple[int, ...]) -> None:
        if tuple(t.shape) != tuple(expected):
            raise ValueError(f"HF tensor {name!r} has shape {tuple(t.shape)} but the config says {tuple(expected)}: "
                             "the checkpoint and its config.json disagree")

