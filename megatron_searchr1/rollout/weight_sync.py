"""Weight sync Megatron -> rollout engine: TP all-gather, PP broadcast, HF names, bucket by bucket.

    sync = WeightSync(model, bind_mapping(hf_config, model), bucket_bytes=256 << 20, dtype=torch.bfloat16)
    stats = sync.sync(engine)          # every rank calls it; engine=None on ranks that feed no engine
    # or, with the plan cached per model: stats = sync_weights(model, engine, mapping, dtype=torch.bfloat16)

What moves, per pipeline stage s (every rank walks the stages in order, so the collectives match):
1. The stage's TP ranks pack their shards of a bucket of parameters into one flat byte buffer, cast at the source
   to `dtype`, and all-gather it over the TP group: one collective per bucket, not one per tensor. Replicated
   tensors (norms) are not gathered.
2. Each parameter's shards are merged (`families.tp_merge`) and mapped to HF (name, tensor) pairs by the family
   mapping, `mapping.megatron_to_hf`: the SAME mapping the checkpoint converter uses (QKV de-interleave, gate/up
   split, padded vocab rows trimmed). A tied model's last-stage `output_layer.weight` copy and a critic's
   `value_head.*` are skipped: HF has no tensor for them.
3. The HF pairs are packed into one flat byte bucket and broadcast over the pipeline group from stage s, so every
   rank ends with the whole model (a rank that feeds no engine still relays: it is a member of the groups).
4. Each bucket is handed to `engine.load_weights` as (hf_name, view into the flat bucket); the views are valid
   for that call only (the engine copies them into its own parameters). `engine.finish_weight_sync()` at the end.

Transport. On the GPU the bytes move with the collectives above (NCCL). On the CPU those run over gloo/TCP loopback,
several times slower than a memory copy (tools/benchmarks/bench_weight_sync.py), so when every rank of a group is on
the same host the group instead shares one /dev/shm-backed buffer (mapped by every rank at init, one region per
bucket). TP: each rank writes its shards straight where the merged tensor has them, one `dist.barrier` over the
group, and every rank reads the merged tensors in place (no merge copy). PP: every stage writes all its packed HF
buckets at once, one barrier over the pipeline group, and every rank reads every stage's buckets in place. A barrier
at the end of each sync keeps the next sync from overwriting a region a slower peer still reads.
`transport="collective"` forces the collectives; "shm" insists on shared memory (an error where it cannot be used);
"auto" (default) takes shared memory where it can. `SyncStats.transport` says which ran. The price: the buffers hold
a copy of the synced bytes (tmpfs pages) for the WeightSync's life, where the collectives need one bucket at a time;
on the CPU that is a small model's worth.

The plan (which parameters go in which bucket, and the HF names, shapes, dtypes and byte offsets of every bucket
of every stage) is built once: the shapes come from running the mapping on meta tensors, and the stages exchange
their plans once with `all_gather_object` over the pipeline group (names, shapes and dtypes before any bytes).
Later syncs only move bytes; a model whose parameters changed shape since then is refused.

LoRA: an adapted linear's weight is sent merged, `W + (alpha / r) * B A` computed on this rank's shard as its bucket
is packed (a new tensor; the trained base is never changed in place, so the reference stays the base), and the
adapter tensors themselves are never sent: the engine serves a plain model, and the bucket bounds hold as before.

Layer indices come from the layers themselves (`decoder.layers[i].layer_number - 1`, Megatron's global 1-based
number), never from an even-split offset formula, so an uneven pipeline split (`num_layers_in_first_pipeline_stage`
/ `num_layers_in_last_pipeline_stage`) or virtual pipeline chunks cannot misplace weights.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_searchr1.collectives import collective_device
from megatron_searchr1.rollout.buckets import (  # noqa: F401 (importable from here, as before they had a module)
    ALIGN, BucketLayout, Slot, aligned, layout_bucket, pack_bucket, plan_buckets, unpack_bucket,
)
from megatron_searchr1.models.convert import expert_weights, gather_hf_weights, global_names
from megatron_searchr1.models.families.base import (
    OUTPUT_LAYER, ModelFamily, is_expert_param, split_layer_name, te_to_local_name, tp_kind, tp_merge, tp_place,
)
from megatron_searchr1.models.forward import unwrap
from megatron_searchr1.models.lora import LoraAdapter, is_lora_param

DEFAULT_BUCKET_BYTES = 256 << 20
"""256 MiB: few enough collectives for a 7B model (~60 buckets in bf16), little enough transient memory."""
SKIP_PREFIXES = ("value_head.",)
"""Parameters with no HF counterpart (a critic's value head): never sent."""
SHM_DIR = "/dev/shm"
"""Where the same-host transport's buffers live (tmpfs: memory shared between processes, not a disk)."""
TRANSPORTS = ("auto", "shm", "collective")


# ----------------------------------------------------------------------------------------------------------------
# The model: global names
# ----------------------------------------------------------------------------------------------------------------
def global_param_names(model: torch.nn.Module) -> list[tuple[str, str, torch.nn.Parameter]]:
    """(local name, global Megatron name, parameter) of a bare model chunk (convert.global_names: each layer's
    global index read off its `layer_number`, whatever the pipeline split), skipping SKIP_PREFIXES."""
    return [(n, g, p) for n, g, p in global_names(model) if not n.startswith(SKIP_PREFIXES)]


# ----------------------------------------------------------------------------------------------------------------
# The plan
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Source:
    """One parameter of this rank's stage as the sync reads it."""

    global_name: str
    param: torch.nn.Parameter
    gather: bool
    """True when its shards differ per TP rank (all-gathered); False for replicated tensors."""
    adapter: Any = None
    """The LoraAdapter of this weight's linear (LoRA): the engine gets W + scale * B A, made per bucket."""

    def value(self, dtype: torch.dtype) -> torch.Tensor:
        """This rank's shard as the engine gets it, cast to `dtype`: the parameter, or base + B A in a new tensor
        (the base is never changed in place; one shard-sized temporary at a time)."""
        w = self.param.detach()
        if self.adapter is not None:
            w = w + self.adapter.delta_weight().to(w.dtype)
        return w.to(dtype)


@dataclass(frozen=True)
class _SendBucket:
    """A bucket this rank's stage sends: the parameters, their shards' gather layout, the HF output layout."""

    sources: tuple[_Source, ...]
    gather_layout: BucketLayout
    """This rank's shards of the gathered sources (cast to the sync dtype)."""
    hf_layout: BucketLayout
    """The HF tensors the sources map to: what every rank receives."""


@dataclass
class SyncStats:
    """What one sync moved, for logging."""

    bytes: int
    """HF tensor bytes handed to this rank's engine (or that would have been, engine=None), all stages."""
    seconds: float
    """Wall time of the whole sync on this rank (collectives, mapping, engine loads, finish)."""
    tensors: int
    """HF tensors delivered."""
    buckets: int
    """Buckets delivered (= engine.load_weights calls)."""
    gathered_bytes: int
    """Bytes this rank received in TP all-gathers."""
    broadcast_bytes: int
    """Bytes moved in PP broadcasts (sent or received by this rank)."""
    transport: str = "none"
    """How the bytes moved: "shm", "collective", "tp=shm,pp=collective" when the groups differ, "none" at TP = PP
    = 1 (nothing moves between ranks). Not in `as_dict`: its values are averaged over ranks as numbers."""

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else float("inf")

    def as_dict(self) -> dict[str, float]:
        return dict(bytes=self.bytes, seconds=self.seconds, tensors=self.tensors, buckets=self.buckets,
                    gathered_bytes=self.gathered_bytes, broadcast_bytes=self.broadcast_bytes,
                    bytes_per_s=self.bytes_per_s)


def _parallel_groups() -> tuple[int, Any, int, int, Any]:
    """(tp, tp group, pp, pp rank, pp group) from Megatron's parallel state."""
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group(),
            ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank(),
            ps.get_pipeline_model_parallel_group())


def _shm_buffer(group: Any, nbytes: int, device: torch.device, transport: str) -> Optional[torch.Tensor]:
    """A uint8 CPU tensor of `nbytes` in shared memory that every rank of `group` maps (collective over the group),
    or None where the group must use its collectives: transport "collective", tensors not on the CPU, ranks on
    different hosts, /dev/shm without room. Every rank of the group gets the same answer (decided from gathered
    facts or by rank 0), so none waits in a barrier the others skip; transport "shm" raises instead of None."""
    if transport == "collective":
        return None

    def refuse(why: str) -> None:  # "auto" falls back to the collectives (None), "shm" was promised: raise
        if transport == "shm":
            raise RuntimeError(f"WeightSync(transport='shm'): {why}")

    facts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(facts, (socket.gethostname(), device.type), group=group)
    if any(f != (socket.gethostname(), "cpu") for f in facts):
        return refuse(f"needs CPU tensors on one host, the group has (host, device) {sorted(set(facts))}")
    creator = dist.get_global_rank(group, 0)
    name = [None]
    if dist.get_rank() == creator and os.path.isdir(SHM_DIR) and shutil.disk_usage(SHM_DIR).free >= nbytes:
        path = os.path.join(SHM_DIR, f"searchr1-weight-sync-{uuid.uuid4().hex}")
        try:  # no exception may escape before the broadcast: the other ranks would wait in it forever
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:  # allocate the pages now: a full tmpfs fails here (ENOSPC), not with a SIGBUS mid-sync
                os.posix_fallocate(fd, 0, max(nbytes, 1))
            finally:
                os.close(fd)
            name[0] = path
        except OSError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    dist.broadcast_object_list(name, src=creator, group=group)
    if name[0] is None:
        return refuse(f"{SHM_DIR} has no room for {nbytes} bytes")
    # torch.from_file(shared=True) would create a missing file, so a rank that cannot see rank 0's file (another
    # host with the same name, a container with its own /dev/shm) must say so instead of syncing into nothing.
    seen = os.path.exists(name[0]) and os.path.getsize(name[0]) >= nbytes
    buf = torch.from_file(name[0], shared=True, size=max(nbytes, 1), dtype=torch.uint8) if seen else None
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, seen, group=group)  # also: every rank has mapped it (or failed to)
    if dist.get_rank() == creator:
        os.unlink(name[0])  # the mappings keep the memory; a crash from here on leaks nothing
    if not all(everyone):
        return refuse(f"not every rank sees {name[0]}: separate /dev/shm")
    return buf[:nbytes]


def _offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Consecutive regions of `sizes` bytes (each a multiple of ALIGN): their start offsets and the total."""
    starts, total = [], 0
    for n in sizes:
        starts.append(total)
        total += n
    return starts, total


class WeightSync:
    """Moves a Megatron actor's weights into a rollout engine; the plan is built once (collectively) at init.

    model: this rank's stage (Megatron DDP / Float16Module wrappers are unwrapped) or a list of virtual-pipeline
    chunks. mapping: the family mapping bound to it (`models.convert.bind_mapping(hf_config, model)`, which knows
    the padded vocab so the padding rows are trimmed). bucket_bytes: HF bytes per bucket (a tensor larger than
    that travels alone). dtype: what the engine receives (cast on the source rank before anything moves; None =
    the parameters' dtype). transport: "auto" | "shm" | "collective", how bytes move between ranks (module
    docstring). Every rank of the trainer constructs it and calls `sync` in the same order.
    """

    def __init__(self, model: torch.nn.Module | Sequence[torch.nn.Module], mapping: ModelFamily, *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: Optional[torch.dtype] = None,
                 transport: str = "auto"):
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        self.chunks = [unwrap(c) for c in chunks]
        self.mapping = mapping
        self.bucket_bytes = int(bucket_bytes)
        self.dtype = dtype
        self.tp, self.tp_group, self.pp, self.pp_rank, self.pp_group = _parallel_groups()
        self._sources = self._read_sources()
        self._signature = self._param_signature()
        self._send = self._plan_send()
        # Names, shapes and dtypes of every stage's buckets, exchanged once over the pipeline group.
        mine = [b.hf_layout for b in self._send]
        if self.pp > 1:
            stages: list = [None] * self.pp
            dist.all_gather_object(stages, mine, group=self.pp_group)
            self.stage_layouts: list[list[BucketLayout]] = stages
        else:
            self.stage_layouts = [mine]
        self._pp_ranks = dist.get_process_group_ranks(self.pp_group) if self.pp > 1 else []
        self._setup_transport(transport)

    def _setup_transport(self, transport: str) -> None:
        """Map the shared buffers (None: that group uses its collectives). TP: per send bucket, a region with its
        merged tensors (TP x its packed shards). PP: per bucket of every stage, its packed HF bytes."""
        device = self._device()
        self._tp_shm = self._pp_shm = None
        if self.tp > 1:
            self._tp_starts, total = _offsets([self.tp * b.gather_layout.nbytes for b in self._send])
            self._tp_shm = _shm_buffer(self.tp_group, total, device, transport)
            self._tp_rank = dist.get_rank(self.tp_group)
            meta = {s.name: torch.empty(s.shape, device="meta") for b in self._send for s in b.gather_layout.slots}
            self._merged_shapes = {n: tuple(tp_merge(n, [t] * self.tp).shape) for n, t in meta.items()}
        if self.pp > 1:
            starts, total = _offsets([lay.nbytes for layouts in self.stage_layouts for lay in layouts])
            it = iter(starts)
            self._pp_starts = [[next(it) for _ in layouts] for layouts in self.stage_layouts]
            self._pp_shm = _shm_buffer(self.pp_group, total, device, transport)
        used = {g: "collective" if buf is None else "shm"
                for g, n, buf in (("tp", self.tp, self._tp_shm), ("pp", self.pp, self._pp_shm)) if n > 1}
        kinds = set(used.values())
        if len(kinds) <= 1:
            self.transport = kinds.pop() if kinds else "none"
        else:
            self.transport = ",".join(f"{g}={t}" for g, t in used.items())

    def _pp_region(self, stage: int, i: int) -> torch.Tensor:
        """Bucket i of `stage` in the shared PP buffer."""
        start = self._pp_starts[stage][i]
        return self._pp_shm[start: start + self.stage_layouts[stage][i].nbytes]

    # -- planning -------------------------------------------------------------------------------------------
    def _read_sources(self) -> list[_Source]:
        sources = []
        for chunk in self.chunks:
            # LoRA: adapter tensors are not sent; the weight of each adapted linear goes merged (base + B A)
            adapted = {f"{name}.weight": m.lora for name, m in chunk.named_modules()
                       if isinstance(getattr(m, "lora", None), LoraAdapter)}
            for local_name, global_name, p in global_param_names(chunk):
                if is_lora_param(local_name):
                    continue
                if te_to_local_name(global_name) == OUTPUT_LAYER and self.mapping.dims.tie_embeddings:
                    continue  # the last stage's copy of a tied embedding: HF has no lm_head then
                if is_expert_param(global_name) and experts_apart():
                    continue  # split over other groups than TP: sync_expert_weights sends them
                gather = self.tp > 1 and tp_kind(global_name) != "replicated"
                sources.append(_Source(global_name, p, gather, adapted.get(local_name)))
        return sources

    def _param_signature(self) -> list[tuple]:
        return [(s.global_name, tuple(s.param.shape), s.param.dtype) for s in self._sources]

    def _out_dtype(self, p: torch.Tensor) -> torch.dtype:
        return self.dtype or p.dtype

    def _hf_specs(self, src: _Source) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """The HF (name, shape, dtype) a source maps to, by running the mapping on meta tensors."""
        dtype = self._out_dtype(src.param)
        shard = torch.empty(src.param.shape, dtype=dtype, device="meta")
        full = tp_merge(src.global_name, [shard] * self.tp) if src.gather else shard
        return [(n, tuple(t.shape), t.dtype) for n, t in self.mapping.megatron_to_hf(src.global_name, full)]

    def _plan_send(self) -> list[_SendBucket]:
        specs = [self._hf_specs(s) for s in self._sources]
        sizes = [sum(aligned(Slot(n, sh, dt, 0).nbytes) for n, sh, dt in sp) for sp in specs]
        buckets = []
        for run in plan_buckets(sizes, self.bucket_bytes):
            srcs = tuple(self._sources[i] for i in run)
            gather_layout = layout_bucket([(s.global_name, tuple(s.param.shape), self._out_dtype(s.param))
                                           for s in srcs if s.gather])
            hf_layout = layout_bucket([spec for i in run for spec in specs[i]])
            buckets.append(_SendBucket(srcs, gather_layout, hf_layout))
        return buckets

    # -- moving ---------------------------------------------------------------------------------------------
    def _gather_and_map(self, i: int) -> tuple[list[torch.Tensor], int]:
        """This stage's bucket i: TP all-gather (one collective, or the shared buffer), merge, map to HF. Returns
        the HF tensors in hf_layout order and the bytes received."""
        bucket = self._send[i]
        merged: dict[str, torch.Tensor] = {}
        received = 0
        if bucket.gather_layout.slots:
            if self._tp_shm is not None:  # every rank wrote its shards at the start of the sync
                merged = self._merged_views(i)
            else:
                shards = [s.value(self._out_dtype(s.param)) for s in bucket.sources if s.gather]
                local = pack_bucket(shards, bucket.gather_layout)
                everything = torch.empty(self.tp * local.numel(), dtype=torch.uint8, device=local.device)
                dist.all_gather_into_tensor(everything, local, group=self.tp_group)
                per_rank = [unpack_bucket(chunk, bucket.gather_layout) for chunk in everything.chunk(self.tp)]
                for j, slot in enumerate(bucket.gather_layout.slots):
                    merged[slot.name] = tp_merge(slot.name, [per_rank[r][j][1] for r in range(self.tp)])
            received = (self.tp - 1) * bucket.gather_layout.nbytes
        out = []
        for s in bucket.sources:
            full = merged[s.global_name] if s.gather else s.value(self._out_dtype(s.param))
            out += [t for _, t in self.mapping.megatron_to_hf(s.global_name, full)]
        return out, received

    def _merged_views(self, i: int) -> dict[str, torch.Tensor]:
        """Send bucket i's gathered tensors in the shared TP buffer, merged: Megatron name -> full tensor (a view).

        Not the collective's rank-major layout: slot j's region (at TP x its offset) holds the MERGED tensor, and
        each rank writes its shard straight where `tp_merge` would put it (`_write_shards`), so every rank reads the
        full tensors in place, with no merge copy (torch.cat) at all."""
        layout = self._send[i].gather_layout
        base = self._tp_starts[i]
        return {s.name: self._tp_shm[base + self.tp * s.offset: base + self.tp * (s.offset + s.nbytes)]
                .view(s.dtype).view(self._merged_shapes[s.name]) for s in layout.slots}

    def _write_shards(self) -> None:
        """This rank's shards of every send bucket into the shared TP buffer, then one barrier over the group (not
        one per bucket: the regions are disjoint)."""
        for i, bucket in enumerate(self._send):
            merged = self._merged_views(i)
            for s in bucket.sources:
                if s.gather:
                    shard = s.value(self._out_dtype(s.param))
                    tp_place(s.global_name, merged[s.global_name], self.tp, self._tp_rank, shard)
        dist.barrier(group=self.tp_group)

    def _by_broadcast(self, stage: int, i: int, layout: BucketLayout) -> tuple[list[tuple[str, torch.Tensor]], int]:
        """Bucket i of `stage` where the PP group has no shared buffer: the source stage gathers and maps it, then
        broadcasts it over the pipeline group (at PP = 1 hands it over as mapped). Returns the (HF name, tensor)
        pairs and the TP bytes received."""
        got = 0
        if stage == self.pp_rank:
            hf, got = self._gather_and_map(i)
            if self.pp == 1:  # nothing to broadcast: skip the packing copy, hand the mapped tensors over
                pairs = [(s.name, t) for s, t in zip(layout.slots, hf)]
                for (name, t), s in zip(pairs, layout.slots):
                    if tuple(t.shape) != s.shape or t.dtype != s.dtype:
                        raise ValueError(f"{name}: mapped to {tuple(t.shape)} {t.dtype}, planned {s.shape} {s.dtype}")
                return pairs, got
            flat = pack_bucket(hf, layout)
        else:
            flat = torch.empty(layout.nbytes, dtype=torch.uint8, device=self._device())
        dist.broadcast(flat, src=self._pp_ranks[stage], group=self.pp_group)
        return unpack_bucket(flat, layout), got

    @torch.no_grad()
    def sync(self, engine: Optional[Any]) -> SyncStats:
        """Send every weight to `engine` (None: only take part in the collectives); returns what moved."""
        if self._param_signature() != self._signature:
            raise ValueError("the model's parameters changed name, shape or dtype since this WeightSync planned "
                             "them: build a new WeightSync for the new model")
        start = time.perf_counter()
        nbytes = tensors = buckets = gathered = broadcast = 0
        if self._tp_shm is not None:
            self._write_shards()
        if self._pp_shm is not None:
            # The stages' regions are disjoint, so every stage packs all its buckets at once and one barrier
            # publishes them: the stages work side by side instead of taking turns bucket by bucket.
            for i, layout in enumerate(self.stage_layouts[self.pp_rank]):
                hf, got = self._gather_and_map(i)
                gathered += got
                pack_bucket(hf, layout, out=self._pp_region(self.pp_rank, i))
            dist.barrier(group=self.pp_group)
        for stage, layouts in enumerate(self.stage_layouts):
            for i, layout in enumerate(layouts):
                if self._pp_shm is not None:  # read in place: packed above by its stage
                    pairs = unpack_bucket(self._pp_region(stage, i), layout)
                else:
                    pairs, got = self._by_broadcast(stage, i, layout)
                    gathered += got
                if self.pp > 1:
                    broadcast += layout.nbytes
                if engine is not None:
                    engine.load_weights(iter(pairs))
                nbytes += sum(s.nbytes for s in layout.slots)
                tensors += len(layout.slots)
                buckets += 1
        # Every rank has read every region: only now may the next sync overwrite them.
        for group, buf in ((self.tp_group, self._tp_shm), (self.pp_group, self._pp_shm)):
            if buf is not None:
                dist.barrier(group=group)
        if engine is not None:
            engine.finish_weight_sync()
        return SyncStats(bytes=nbytes, seconds=time.perf_counter() - start, tensors=tensors, buckets=buckets,
                         gathered_bytes=gathered, broadcast_bytes=broadcast, transport=self.transport)

    def _device(self) -> torch.device:
        for c in self.chunks:
            for p in c.parameters():
                return p.device
        return collective_device()

    @property
    def hf_names(self) -> list[str]:
        """Every HF name the engine receives, in sync order."""
        return [s.name for layouts in self.stage_layouts for lay in layouts for s in lay.slots]


def sync_weights(model: torch.nn.Module | Sequence[torch.nn.Module], engine: Optional[Any], mapping: ModelFamily, *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: Optional[torch.dtype] = None,
                 transport: str = "auto") -> SyncStats:
    """`WeightSync(model, mapping, ...).sync(engine)`, the WeightSync (its plan and shared buffers) cached on the
    bare model per mapping, bucket size, dtype and transport. Every rank calls it in the same order; engine=None on
    ranks that feed no engine."""
    bare = unwrap(model[0] if isinstance(model, (list, tuple)) else model)
    cache = bare.__dict__.setdefault("_searchr1_weight_syncs", {})
    key = (id(mapping), int(bucket_bytes), dtype, transport)
    if key not in cache or cache[key].mapping is not mapping:
        cache[key] = WeightSync(model, mapping, bucket_bytes=bucket_bytes, dtype=dtype, transport=transport)
    sync_expert_weights(model, engine, mapping, dtype=dtype)  # before: WeightSync.sync finishes the engine's sync
    return cache[key].sync(engine)


def experts_apart() -> bool:
    """Whether the routed experts are split differently from the TP group WeightSync gathers over: EP > 1 (other
    ranks hold other experts), or an expert-TP size other than TP (parallel.expert_tp=1 under TP > 1: every TP rank
    holds whole experts, which a TP all-gather would stack TP times). sync_expert_weights sends them then, over
    Megatron's expert-TP and EP groups."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return False
    return (ps.get_expert_model_parallel_world_size() > 1
            or ps.get_expert_tensor_parallel_world_size() != ps.get_tensor_model_parallel_world_size())


@torch.no_grad()
def sync_expert_weights(model: torch.nn.Module | Sequence[torch.nn.Module], engine: Optional[Any],
                        mapping: ModelFamily, *, dtype: Optional[torch.dtype] = None) -> int:
    """Under expert parallelism or an expert TP other than TP (experts_apart; a no-op returning 0 otherwise), send
    the routed experts that WeightSync leaves out: one MoE layer at a time, every expert all-gathered over expert-TP and EP (convert.gather_hf_weights)
    on the layer's stage, broadcast over the pipeline group from that stage, handed to `engine.load_weights` under
    the checkpoint's per-expert HF names (what vLLM's MoE loaders read). Every rank calls it; returns the bytes
    handed over. At most one layer's experts (all E of them, cast to `dtype` at the source) are in flight: the
    memory bound, in place of WeightSync's buckets.
    """
    if not experts_apart():
        return 0
    from megatron.core import parallel_state as ps

    chunks = [unwrap(m) for m in (model if isinstance(model, (list, tuple)) else [model])]
    mine: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for chunk in chunks:
        for name, t in expert_weights(chunk):
            mine.setdefault(split_layer_name(name)[0], []).append((name, t if dtype is None else t.to(dtype)))
    pp, pp_rank, pp_group = (ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank(),
                             ps.get_pipeline_model_parallel_group())
    layers = [sorted(mine)] * pp
    if pp > 1:
        layers = [None] * pp
        dist.all_gather_object(layers, sorted(mine), group=pp_group)
    pp_ranks = dist.get_process_group_ranks(pp_group) if pp > 1 else [dist.get_rank()]
    nbytes = 0
    for stage, stage_layers in enumerate(layers):
        for layer in stage_layers:
            pairs = list(gather_hf_weights(None, mapping, weights=mine[layer])) if stage == pp_rank else None
            if pp > 1:
                meta = [[(n, tuple(t.shape), t.dtype) for n, t in pairs] if pairs is not None else None]
                dist.broadcast_object_list(meta, src=pp_ranks[stage], group=pp_group)
                if pairs is None:
                    pairs = [(n, torch.empty(shape, dtype=dt, device=collective_device())) for n, shape, dt in meta[0]]
                for _, t in pairs:
                    dist.broadcast(t, src=pp_ranks[stage], group=pp_group)
            if engine is not None:
                engine.load_weights(iter(pairs))
            nbytes += sum(t.numel() * t.element_size() for _, t in pairs)
    return nbytes
