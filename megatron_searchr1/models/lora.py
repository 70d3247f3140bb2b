"""LoRA adapters on Megatron's tensor-parallel linears, named and scaled as PEFT / LLaMA-Factory name and scale them.

    apply_lora(model, LoraSettings(rank=8, alpha=16, dropout=0.05, targets=("all",)))   # base frozen, adapters added
    with disable_adapters(model): ...                  # the base model (LoRA RL's reference policy)
    for name, w in merged_weights(model): ...          # this rank's base tensors with scale * B @ A folded in

What a layer computes: `y = W x + (alpha / r) * B (A dropout(x))`, dropout on the LoRA input only, B zero at the
start (so the adapted model starts as the base), A initialised as PEFT does (kaiming-uniform, a=sqrt(5)).

Targets are HF module names (`q_proj k_proj v_proj o_proj gate_proj up_proj down_proj`) or `all` (LLaMA-Factory:
every linear of the decoder layers, not the output layer). Megatron fuses some of them into one linear:

    HF projection(s)        Megatron linear                 TP kind   adapter shards
    q_proj, k_proj, v_proj  self_attention.linear_qkv       column    A whole; B: the rows of W this rank holds
    o_proj                  self_attention.linear_proj      row       A: the input columns this rank holds; B whole
    gate_proj, up_proj      mlp.linear_fc1                  column    A whole; B: the rows of W this rank holds
    down_proj               mlp.linear_fc2                  row       A: the input columns this rank holds; B whole

A fused linear keeps one (A, B) per HF projection, so `q_proj` alone adapts only the query rows, and the exported
adapter is PEFT's. Each B·A lands in its projection's rows of this rank's fused output: which local rows those are
comes from the family layout (`interleave_qkv` / `stack_gate_up` and `tp_split` applied to row numbers), so the
per-query-group QKV interleave and the per-rank [gate_r; up_r] stacking are read from the one place that defines
them.

Communication follows Megatron's own linears, but on the rank-r intermediate `u = A x` (small) rather than on x:
a column layer's A is whole while its output rows are split, so A's gradient sums over TP (`copy_to_...` on u;
with sequence parallelism u is all-gathered over the sequence and A is marked `sequence_parallel`, which Megatron's
finalize_model_grads sums over TP); a row layer's `u` is a partial sum over TP (`reduce_from_...`), B is then whole
and replicated. Sharded adapter tensors carry Megatron's `tensor_model_parallel` attributes (grad-norm clipping
counts them once per rank, whole ones once per TP group).

The base parameters are frozen (`requires_grad=False`): Megatron DDP allocates no gradient buffer and the optimizer
keeps no state (nor fp32 master copy) for them. Only Megatron's local spec (the CPU path, `model.use_te=false`) is
supported: Transformer Engine fuses the norm into linear_qkv / linear_fc1, so the input the adapter needs is never
materialised outside TE.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

from megatron_searchr1.models.families import interleave_qkv, stack_gate_up, tp_split
from megatron_searchr1.models.forward import unwrap
from megatron_searchr1.config.finetune import LoraSettings  # noqa: F401 (re-exported)
from megatron_searchr1.models.lora_settings import HF_MODULE, PROJECTIONS  # noqa: F401 (re-exported)

# ----------------------------------------------------------------------------------------------------------------
# Layouts: where each HF projection's rows sit in this rank's shard of a fused column linear
# ----------------------------------------------------------------------------------------------------------------
def projection_sizes(config) -> dict[str, int]:
    """Full output rows of each HF projection (from a TransformerConfig)."""
    nq, d = config.num_attention_heads, config.kv_channels
    ng = config.num_query_groups or nq
    return {"q_proj": nq * d, "k_proj": ng * d, "v_proj": ng * d, "gate_proj": config.ffn_hidden_size,
            "up_proj": config.ffn_hidden_size}


def column_layout(suffix: str, config, tp: int, rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """For a fused column linear: HF projection -> (positions in this rank's output rows, the projection's rows
    there), i.e. local_out[pos] = proj_out[rows].

    The family's layout helpers are applied to row *numbers* (q, k, v numbered one after another, then interleaved
    per query group and TP-split exactly as the weight is), so this is the weight's own layout.
    """
    sizes = projection_sizes(config)
    projs = ("q_proj", "k_proj", "v_proj") if suffix.endswith("linear_qkv") else ("gate_proj", "up_proj")
    offsets, numbered, start = {}, [], 0
    for p in projs:
        offsets[p] = start
        numbered.append(torch.arange(start, start + sizes[p]))
        start += sizes[p]
    if suffix.endswith("linear_qkv"):
        nq, ng = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
        full = interleave_qkv(*numbered, nq, ng)
    else:
        full = stack_gate_up(*numbered)
    local = tp_split(f"decoder.layers.0.{suffix}.weight", full, tp)[rank]
    out = {}
    for p in projs:
        pos = ((local >= offsets[p]) & (local < offsets[p] + sizes[p])).nonzero().flatten()
        out[p] = (pos, local[pos] - offsets[p])
    return out


# ----------------------------------------------------------------------------------------------------------------
# The adapter module (a child of the Megatron linear it adapts, applied by a forward hook)
# ----------------------------------------------------------------------------------------------------------------
class LoraAdapter(torch.nn.Module):
    """The (A, B) pairs of one Megatron linear, one pair per targeted HF projection.

    `lora_A[p]` (r, in or in/tp) and `lora_B[p]` (out rows of p held here, r). `forward(x)` returns the delta to add
    to the linear's output (this rank's shard, scale included).
    """

    def __init__(self, linear: torch.nn.Module, suffix: str, kind: str, projections: Sequence[str],
                 settings: LoraSettings, layer_index: int, config, tp: int, tp_rank: int, tp_group):
        super().__init__()
        self.kind, self.scale, self.enabled = kind, settings.scale, True
        self.dropout = settings.dropout
        self.tp, self.tp_rank, self.tp_group = tp, tp_rank, tp_group
        self.sequence_parallel = bool(config.sequence_parallel)
        out_local, in_local = linear.weight.shape
        dtype, device = linear.weight.dtype, linear.weight.device
        r = settings.rank
        self.lora_A, self.lora_B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        self.full_shapes: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {}  # p -> (A full, B full)
        if kind == "column":
            layout = column_layout(suffix, config, tp, tp_rank)
            pos_all = []
            for p in projections:
                pos, rows = layout[p]
                self.register_buffer(f"rows_{p}", rows.to(device), persistent=False)
                pos_all.append(pos)
                self.full_shapes[p] = ((r, in_local), (projection_sizes(config)[p], r))
            self.register_buffer("positions", torch.cat(pos_all).to(device), persistent=False)
            self.out_local = out_local
        else:
            for p in projections:
                self.full_shapes[p] = ((r, in_local * tp), (out_local, r))
        for p in projections:
            (a_shape, b_shape) = self.full_shapes[p]
            # A drawn on the FULL shape from a generator seeded by (run seed, layer, projection), then sharded: the
            # same adapter at every TP/PP (PEFT: kaiming_uniform_(a=sqrt(5)), what nn.Linear's reset_parameters does).
            seed = (torch.initial_seed() * 1000003 + layer_index * 101 + list(PROJECTIONS).index(p)) % 2**63
            g = torch.Generator().manual_seed(seed)
            bound = 1.0 / math.sqrt(a_shape[1])  # kaiming_uniform(a=sqrt(5)): gain*sqrt(3/fan_in) = 1/sqrt(fan_in)
            a_full = (torch.rand(a_shape, generator=g) * 2 - 1) * bound
            b_full = torch.zeros(b_shape)
            a, b = self.shard(p, a_full, b_full)
            self.lora_A[p] = torch.nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
            self.lora_B[p] = torch.nn.Parameter(b.to(device=device, dtype=dtype).contiguous())
            self._mark(p)

    def _mark(self, p: str) -> None:
        """Megatron's TP attributes: which tensor is a shard (grad-norm counts it on every rank) and which whole
        tensor's gradient is partial under sequence parallelism (finalize_model_grads sums it over TP)."""
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        if self.kind == "column":
            set_tensor_model_parallel_attributes(self.lora_B[p], self.tp > 1, 0, 1)
            self.lora_A[p].sequence_parallel = self.sequence_parallel
        else:
            set_tensor_model_parallel_attributes(self.lora_A[p], self.tp > 1, 1, 1)

    # -- full (TP-merged) tensors <-> this rank's shards ------------------------------------------------------------
    def shard(self, p: str, a_full: torch.Tensor, b_full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Full (A, B) of projection p -> this rank's (A, B)."""
        if self.kind == "column":
            return a_full, b_full[getattr(self, f"rows_{p}")]
        return a_full.chunk(self.tp, dim=1)[self.tp_rank], b_full

    def gather(self, p: str, grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (A, B) of projection p -> full (A, B) (their gradients with `grad`, zeros when None);
        collective over the TP group when TP > 1."""
        pa, pb = self.lora_A[p], self.lora_B[p]
        if grad:
            a = pa.grad if pa.grad is not None else torch.zeros_like(pa)
            b = pb.grad if pb.grad is not None else torch.zeros_like(pb)
        else:
            a, b = pa.detach(), pb.detach()
        if self.tp == 1:
            return a.clone(), b.clone()
        import torch.distributed as dist

        if self.kind == "row":
            shards = [torch.empty_like(a) for _ in range(self.tp)]
            dist.all_gather(shards, a.contiguous(), group=self.tp_group)
            return torch.cat(shards, dim=1), b.clone()
        rows = getattr(self, f"rows_{p}")
        counts = [None] * self.tp
        dist.all_gather_object(counts, int(rows.numel()), group=self.tp_group)
        n = max(counts)
        pad_b = torch.zeros(n, b.shape[1], dtype=b.dtype, device=b.device)
        pad_r = torch.full((n,), -1, dtype=torch.long, device=b.device)
        pad_b[: rows.numel()], pad_r[: rows.numel()] = b, rows.to(b.device)
        bs, rs = [torch.empty_like(pad_b) for _ in range(self.tp)], [torch.empty_like(pad_r) for _ in range(self.tp)]
        dist.all_gather(bs, pad_b, group=self.tp_group)
        dist.all_gather(rs, pad_r, group=self.tp_group)
        full = torch.zeros(self.full_shapes[p][1], dtype=b.dtype, device=b.device)
        for bb, rr, c in zip(bs, rs, counts):
            full[rr[:c]] = bb[:c]
        return a.clone(), full

    def delta_weight(self) -> torch.Tensor:
        """scale * (B A) placed where it adds to this rank's weight shard (zeros for untargeted rows)."""
        if self.kind == "row":
            return self.scale * sum(self.lora_B[p] @ self.lora_A[p] for p in self.lora_A)
        first = next(iter(self.lora_A.values()))
        blocks = torch.cat([self.lora_B[p] @ self.lora_A[p] for p in self.lora_A], dim=0)
        delta = torch.zeros(self.out_local, first.shape[1], dtype=first.dtype, device=first.device)
        return self.scale * delta.index_copy(0, self.positions, blocks)

    # -- the forward delta ------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The delta for the linear's output given its input x ([s, b, in] column / [s, b, in/tp] row)."""
        from megatron.core.tensor_parallel import mappings

        if self.dropout and self.training:
            x = F.dropout(x, p=self.dropout, training=True)
        if self.kind == "column":
            outs = []
            for p in self.lora_A:
                u = x @ self.lora_A[p].t()  # [s(/tp), b, r]
                if self.sequence_parallel:  # the base all-gathers its input over the sequence; we gather u
                    u = mappings.gather_from_sequence_parallel_region(u, group=self.tp_group)
                else:  # A is whole but sees only this rank's output rows: its input gradient sums over TP
                    u = mappings.copy_to_tensor_model_parallel_region(u, group=self.tp_group)
                outs.append(u @ self.lora_B[p].t())  # [s, b, rows of p here]
            cat = torch.cat(outs, dim=-1)
            delta = cat.new_zeros(*cat.shape[:-1], self.out_local).index_copy(-1, self.positions, cat)
            return self.scale * delta
        y = 0
        for p in self.lora_A:
            u = mappings.reduce_from_tensor_model_parallel_region(x @ self.lora_A[p].t(), group=self.tp_group)
            y = y + u @ self.lora_B[p].t()  # [s, b, h], the same on every TP rank
        if self.sequence_parallel:  # the base reduce-scatters its output over the sequence: keep our part
            y = mappings.scatter_to_sequence_parallel_region(y, group=self.tp_group)
        return self.scale * y


    # -- checkpointing ----------------------------------------------------------------------------------------------
    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """Megatron dist-checkpoint entries of the adapters, sharded as they are held (column B on dim 0, row A on
        dim 1, the whole ones replicated over TP), so an adapter checkpoint loads at any TP/PP. A fused column
        layer whose projection rows are not split evenly over TP (fewer KV heads than TP) has no such layout:
        refused."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        if self.kind == "column":
            axis = {f"lora_B.{p}": 0 for p in self.lora_B}
            for p in self.lora_B:
                rows, n = getattr(self, f"rows_{p}"), self.full_shapes[p][1][0]
                even = torch.arange(n // self.tp, device=rows.device) + self.tp_rank * (n // self.tp)
                if n % self.tp or not torch.equal(rows, even):
                    raise ValueError(f"{p}: its rows are not split evenly over TP={self.tp} (fewer KV heads than "
                                     "TP?): save the adapter with lora_export.write_peft_adapter instead")
        else:
            axis = {f"lora_A.{p}": 1 for p in self.lora_A}
        dp_cp = (metadata or {}).get("dp_cp_group") or ps.get_data_parallel_group(with_context_parallel=True)
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, axis,
                                                   sharded_offsets, tp_group=self.tp_group, dp_cp_group=dp_cp)


def _with_adapter_checkpoint(linear: torch.nn.Module) -> None:
    """Make `linear.sharded_state_dict` list its adapters sharded right (Megatron's parallel linears build theirs
    from their own state dict, where the adapters would count as TP-replicated tensors)."""
    base = linear.sharded_state_dict

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        out = {k: v for k, v in base(prefix, sharded_offsets, metadata).items() if not k.startswith(f"{prefix}lora.")}
        out.update(linear.lora.sharded_state_dict(f"{prefix}lora.", sharded_offsets, metadata))
        return out

    linear.sharded_state_dict = sharded_state_dict


def _lora_hook(module, args, kwargs, output):
    adapter = module.lora
    if not adapter.enabled:
        return output
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + adapter(x).to(out.dtype), bias


# ----------------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------------
def apply_lora(model: torch.nn.Module, settings: LoraSettings) -> list[str]:
    """Freeze every parameter of `model` (a bare GPTModel stage, before wrap_ddp) and add LoRA adapters to the
    targeted linears; returns the adapted Megatron module names (stage-local). Call it once, after loading the base
    weights and before wrap_ddp / build_optimizer (they see only trainable parameters)."""
    from megatron.core import parallel_state as ps

    from megatron_searchr1.models.spec import uses_te_spec

    if unwrap(model) is not model:
        raise ValueError("apply_lora takes the bare model, before wrap_ddp: DDP sizes its gradient buffers for the "
                         "parameters that are trainable when it wraps the model")
    if uses_te_spec(model):
        raise ValueError("LoRA needs Megatron's local spec (set model.use_te=false): Transformer Engine fuses the "
                         "norm into linear_qkv / linear_fc1, so the adapters' input is not available")
    if any(isinstance(m, LoraAdapter) for m in model.modules()):
        raise ValueError("apply_lora was already called on this model")
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    tp_group = ps.get_tensor_model_parallel_group()
    for p in model.parameters():
        p.requires_grad_(False)
    by_linear: dict[str, list[str]] = {}
    for p in settings.projections:
        by_linear.setdefault(PROJECTIONS[p][0], []).append(p)
    adapted = []
    decoder = getattr(model, "decoder", None)
    for i, layer in enumerate(decoder.layers if decoder is not None else []):
        for suffix, projs in by_linear.items():
            linear = layer.get_submodule(suffix)
            if getattr(linear, "gather_output", False):
                raise ValueError(f"{suffix}: a column linear that gathers its output is not supported")
            linear.lora = LoraAdapter(linear, suffix, PROJECTIONS[projs[0]][1], projs, settings,
                                      layer.layer_number - 1, model.config, tp, tp_rank, tp_group)
            linear.register_forward_hook(_lora_hook, with_kwargs=True)
            _with_adapter_checkpoint(linear)
            adapted.append(f"decoder.layers.{i}.{suffix}")
    model.lora_settings = settings
    return adapted


def adapters(model: torch.nn.Module) -> Iterator[tuple[int, LoraAdapter]]:
    """(global layer index, adapter) for every adapted linear of this stage."""
    model = unwrap(model)
    decoder = getattr(model, "decoder", None)
    for layer in (decoder.layers if decoder is not None else []):
        for m in layer.modules():
            if isinstance(m, LoraAdapter):
                yield layer.layer_number - 1, m


def is_lora_param(name: str) -> bool:
    """Whether a parameter name (of named_parameters) belongs to an adapter."""
    return ".lora.lora_A." in name or ".lora.lora_B." in name


def lora_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for n, p in unwrap(model).named_parameters() if is_lora_param(n)]


def adapter_sharded_state_dict(model: torch.nn.Module) -> dict:
    """The adapters' entries of `model.sharded_state_dict()`: a LoRA checkpoint (megatron.core.dist_checkpointing
    save / load) that holds the adapters only and loads at any TP/PP; load with
    `model.load_state_dict(dist_checkpointing.load(adapter_sharded_state_dict(model), dir), strict=False)`."""
    return {k: v for k, v in unwrap(model).sharded_state_dict().items() if ".lora.lora_" in k}


@contextlib.contextmanager
def disable_adapters(model: torch.nn.Module):
    """Within the block the model computes the base model (LoRA RL's reference policy: the same weights, no
    second copy)."""
    ads = [a for _, a in adapters(model)]
    before = [a.enabled for a in ads]
    for a in ads:
        a.enabled = False
    try:
        yield model
    finally:
        for a, e in zip(ads, before):
            a.enabled = e


@torch.no_grad()
def merged_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(stage-local Megatron name, tensor) for every base parameter of this rank: W + scale * B A for adapted
    linears (a new tensor; the base is not changed), the parameter itself (detached) otherwise. Adapter parameters
    are not listed: the result names exactly the tensors of the model without adapters."""
    model = unwrap(model)
    deltas = {}
    for name, module in model.named_modules():
        if isinstance(getattr(module, "lora", None), LoraAdapter):
            deltas[f"{name}.weight"] = module.lora
    for name, p in model.named_parameters():
        if is_lora_param(name):
            continue
        a = deltas.get(name)
        yield name, (p.detach() if a is None else p.detach() + a.delta_weight().to(p.dtype))


def gather_adapter_state(model: torch.nn.Module, grad: bool = False) -> dict[str, torch.Tensor]:
    """Full (TP-merged) adapter tensors of this pipeline stage under PEFT's names without the
    `base_model.model.` prefix: `model.layers.{i}.self_attn.q_proj.lora_A.weight` (r, in) and `...lora_B.weight`
    (out, r), i global (their gradients with `grad`). Every TP rank of the stage must call it (all-gathers); all
    get the tensors."""
    out = {}
    for i, adapter in adapters(model):
        for p in adapter.lora_A:
            a, b = adapter.gather(p, grad=grad)
            base = f"model.layers.{i}.{HF_MODULE[p]}"
            out[f"{base}.lora_A.weight"], out[f"{base}.lora_B.weight"] = a, b
    return out


@torch.no_grad()
def load_adapter_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Set this rank's adapter shards from full adapter tensors (`gather_adapter_state`'s names; PEFT's with the
    `base_model.model.` prefix are accepted too). Every adapter of the stage must be in `state`."""
    state = {k.removeprefix("base_model.model."): v for k, v in state.items()}
    for i, adapter in adapters(model):
        for p in adapter.lora_A:
            base = f"model.layers.{i}.{HF_MODULE[p]}"
            missing = [k for k in (f"{base}.lora_A.weight", f"{base}.lora_B.weight") if k not in state]
            if missing:
                raise KeyError(f"adapter state lacks {missing}")
            a_full, b_full = state[f"{base}.lora_A.weight"], state[f"{base}.lora_B.weight"]
            want_a, want_b = adapter.full_shapes[p]
            if tuple(a_full.shape) != want_a or tuple(b_full.shape) != want_b:
                raise ValueError(f"{base}: adapter shapes {tuple(a_full.shape)}, {tuple(b_full.shape)} but the model "
                                 f"expects {want_a}, {want_b} (a different rank or model?)")
            a, b = adapter.shard(p, a_full.to(adapter.lora_A[p].device), b_full.to(adapter.lora_B[p].device))
            adapter.lora_A[p].copy_(a)
            adapter.lora_B[p].copy_(b)


def has_lora(model: torch.nn.Module) -> bool:
    """Whether `model` (bare or wrapped) had apply_lora."""
    return getattr(unwrap(model), "lora_settings", None) is not None
