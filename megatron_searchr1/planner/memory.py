"""GPU memory of every phase of an RL step, per GPU: byte arithmetic over the parameter counts of planner/counts.py.

Phases, in the trainer's order (trainer/rl.py `Trainer.step`, trainer/roles.py `RolloutWorker.sync / sleep`):

- start-up: the trainer's models exist and vLLM starts; vLLM requires its share (gpu_memory_utilization x the GPU's
  total) free at that moment, beside its own NCCL communicator. The trainer's communicators are counted here too,
  although which of them have connected by then depends on the first collectives: an upper bound.
- weight sync: `GenerationOffload.before_wake` has moved what the sync does not read (gradients, optimizer state,
  the reference and the critic, per model.*_offload flag), vLLM's weights are awake, the sync's buckets in flight.
- rollout: `after_sync` has moved the actor's weights (param_offload), vLLM's KV cache is awake: it generates.
- log-prob passes: the engine sleeps and `reload()` has brought everything back (old, reference log-probs and
  values need the models); one micro-batch's forward, no saved activations (torch.no_grad).
- update peak: everything resident (the reference too: nothing offloads it again before the next sync), one
  micro-batch's saved activations and the log-probs head.

Which states each phase holds is `resident_states`, the same rule GenerationOffload follows
(tests/test_plan_phases.py drives the real offload on a tiny model in the trainer's order and compares).

The counts, written down next to each number:

- weights: params x model.dtype bytes; gradients: Megatron DDP's fp32 buffer (`grad_reduce_in_fp32=True`), 4 bytes
  per param, never sharded; optimizer: Adam m and v in fp32 plus an fp32 master copy for bf16/fp16 models (12 bytes
  per param; 8 for fp32 models), divided by DP with the distributed optimizer.
- MoE (parallel.ep): a rank holds E/ep routed experts at 1/expert-TP of their width (Megatron's default expert-TP is
  TP) and the attention, norms, router and shared expert at its TP; the experts' gradients and optimizer state
  follow them, the optimizer state sharded over expert-DP = world / (ep x expert-TP x pp) instead of DP.
- activations (one micro-batch of optim.max_tokens_per_micro_batch tokens): Korthikanti et al. 2022 ("Reducing
  activation recomputation in large transformer models") per-layer accounting, adapted to these models (RMSNorm,
  GQA, SwiGLU, no dropout, fused flash attention on the GPU, so no s^2 score tensors), bytes per token per layer:
      a_bytes * (4h / sp + (nq/tp + 2 ceil(ng/tp)) d + nq d / tp + 3 F / tp)
  (two norm inputs and two linear inputs of width h, split over TP with sequence parallelism (sp = tp); q, k, v;
  the attention output; fc1's [gate; up] output and fc2's input). Selective recomputation re-runs the attention
  core, whose only saved tensors beyond these are flash attention's per-row statistics: it saves ~nothing with
  fused attention. Full recomputation keeps one h-wide input per layer and re-runs one layer at a time. With
  PP > 1, 1F1B keeps up to PP micro-batches in flight on the first stage: PP x that stage's layers. The MLP term
  of an MoE layer: `mlp_bytes_per_token`.
- log-probs head (last stage): per token and local vocab column (V_pad / tp), 12 bytes: the fp32 softmax kept for
  backward (4), its fp32 gradient (4) and the bf16 logits and their gradient (2 + 2); with entropy
  (algo.entropy_coeff > 0) 24: the fp32 shifted logits kept too (4) and two fp32 temporaries of dH/dz (8). A
  forward without gradients: the bf16 logits and two fp32 temporaries (10).
- vLLM (one engine per rollout.engine_tp GPUs): its share is gpu_memory_utilization x the GPU's total: its weights
  (sharded over engine_tp), an activation estimate (vLLM's default max_num_batched_tokens through one layer's
  widest tensors plus max_num_seqs rows of fp32 logits, `vllm_batch_defaults`), what stays outside its sleep
  pools (`vllm_residue`), and the KV cache, the rest. KV per token = 2 x layers x ceil(ng / engine_tp) x d x bytes.
- NCCL: `nccl_groups` (which of Megatron's groups communicate on this rank) x `NCCL_GROUP_BYTES`.
- the GPU: `usable_bytes` of the nominal size; the CUDA context on top.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

from megatron_searchr1.planner.counts import ModelCounts, sync_plan

BRIDGE_HOST_VERSIONS = 2
"""Weight versions a rank of the disaggregated bridge keeps in host memory at most: a rollout rank's two reused slots
(rollout/host_slots.py HOST_SLOTS; a test keeps the two equal), and trainer rank 0's version in flight plus the newest
queued behind it."""

GiB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

USABLE_FRACTION = 0.989
"""Of a GPU's nominal memory, the part CUDA reports as its total (`torch.cuda.mem_get_info()[1]`, what vLLM's
gpu_memory_utilization multiplies): an "80GB" H100 shows 81,559 MiB (79.6 GiB) in nvidia-smi (vllm-project/vllm#27508)
and PyTorch about 79.1 GiB of it as its total capacity; the rest holds ECC and the driver's reservation."""
CUDA_CONTEXT = 1 * GiB
"""Per GPU: the CUDA context and the kernels loaded (0.5-1 GiB with lazy loading); an estimate."""
NCCL_GROUP_BYTES = 1 * GiB
"""One NCCL communicator of two or more ranks, connected: NCCL's default buffers per channel and peer are 4 MiB
(NCCL_BUFFSIZE, Simple) + 0.5 MiB (LL) + 4.7 MiB (LL128), for the ring's and the tree's peers, at up to 32 channels
on NVLink: ~0.3 GiB per peer direction; 544-688 MB were measured per communicator on 4 A100s over NVLink
(NVIDIA/nccl#964), and H100s run more channels and NVLink SHARP buffers. An estimate, rounded up."""
NCCL_SINGLE_RANK_BYTES = GiB // 2
"""A one-rank communicator that runs a collective: NCCL 2.28 still allocates a 512 MiB shared P2P buffer for it
(NVIDIA/nccl#2363)."""
VLLM_BUFFERS = 1 * GiB
"""vLLM memory that sleep does not free, CUDA graphs aside: persistent input and sampler buffers, cuBLAS
workspaces, the allocator's leftovers; an estimate."""
VLLM_CUDA_GRAPHS = 3 * GiB // 2
"""vLLM's captured CUDA graphs (rollout.enforce_eager off): their memory pool survives sleep; an estimate (vLLM
logs the size it captured)."""
PHASES = ("start-up", "weight sync", "rollout", "log-prob passes", "update peak")
STATE_KINDS = ("actor weights", "actor gradients (fp32)", "actor optimizer", "reference weights", "critic weights",
               "critic gradients (fp32)", "critic optimizer")


def usable_bytes(nominal_gib: float) -> int:
    """What a GPU of `nominal_gib` GiB reports as its total memory (`USABLE_FRACTION`)."""
    return int(nominal_gib * GiB * USABLE_FRACTION)


def vllm_batch_defaults(total_bytes: int, gpu_name: str) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) vLLM picks for the offline `LLM` class when the engine sets neither
    (vLLM 0.32 `EngineArgs.get_batch_defaults`): 16384 and 1024 on GPUs of >= 70 GiB other than the A100, else 8192
    and 256."""
    if total_bytes >= 70 * GiB and "a100" not in gpu_name.lower():
        return 16384, 1024
    return 8192, 256


def resident_states(phase: str, model_cfg) -> frozenset:
    """The trainer states (STATE_KINDS) on the GPU during `phase`, by what megatron/offload.py's GenerationOffload
    moves: before the engine wakes, gradients (grad_offload), optimizer state (optimizer_offload), the critic's
    weights (param_offload) and the reference (ref_offload); after the sync the actor's weights (param_offload);
    `reload()` after generation brings all of it back for the log-prob passes and the update."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}")
    away = set()
    if phase in ("weight sync", "rollout"):
        m = model_cfg
        if m.grad_offload:
            away |= {"actor gradients (fp32)", "critic gradients (fp32)"}
        if m.optimizer_offload:
            away |= {"actor optimizer", "critic optimizer"}
        if m.param_offload:
            away.add("critic weights")
            if phase == "rollout":
                away.add("actor weights")
        if m.ref_offload:
            away.add("reference weights")
    return frozenset(STATE_KINDS) - away


def nccl_groups(world: int, tp: int, pp: int, ep: int = 1, etp: Optional[int] = None, *, moe: bool = False,
                tied: bool = False, distributed_optimizer: bool = True) -> list[tuple[str, int]]:
    """(group, size) of the process groups one rank runs NCCL collectives on (CUDA tensors), each its own
    communicator (Megatron creates each group with its own `new_group`, so groups over the same ranks do not share
    one). torch connects a group at its first collective (megatron/initialize.py binds no device), so the groups
    Megatron creates and this trainer never uses (context-parallel, TP x DP, the expert-TP x EP x PP one, ...) cost
    nothing. A group of one rank is listed where something still runs a collective on it (DDP's gradient reduce,
    the gradient norm)."""
    etp = etp or tp
    dp = world // (tp * pp)
    groups = []
    if tp > 1:  # Megatron's TP mappings skip a one-rank group
        groups.append(("tensor-parallel: layers, vocab-parallel log-probs, weight-sync gather", tp))
    groups.append(("data-parallel with CP: DDP gradients, distributed-optimizer all-gather", dp))
    if dp > 1:  # the trainer's own reductions skip a one-rank group
        groups.append(("data-parallel: token counts, loss sums, advantages", dp))
    if distributed_optimizer:  # Megatron's DistributedOptimizer: grad-norm statistics over its instance, the world
        groups.append(("distributed-optimizer instance: gradient norm", world))
    else:
        groups.append(("model-parallel: gradient norm", tp * pp))
    if world > 1:
        groups.append(("default (world): metrics", world))
    if pp > 1:  # torch gives each pair of p2p peers a communicator of its own
        groups += [("pipeline p2p, previous stage (1F1B)", 2), ("pipeline p2p, next stage (1F1B)", 2),
                   ("pipeline: weight-sync broadcast", pp)]
        if tied:
            groups.append(("embedding: tied-weight gradients", 2))
    if moe:
        if tp > 1:
            groups.append(("TP x CP: router aux-loss token counts (sequence parallel)", tp))
        if ep > 1:
            groups.append(("expert-parallel: token all-to-all", ep))
        if etp > 1:
            groups.append(("expert-tensor-parallel", etp))
        if etp * ep > 1:
            groups.append(("expert-TP x EP: tokens per expert", etp * ep))
        groups.append(("expert-data-parallel: expert gradients", world // (ep * etp * pp)))
    return groups


def nccl_bytes(groups: list[tuple[str, int]]) -> int:
    return sum(NCCL_GROUP_BYTES if size > 1 else NCCL_SINGLE_RANK_BYTES for _, size in groups)


def vllm_residue(rollout_cfg) -> int:
    """vLLM memory outside its sleep pools: buffers, plus its CUDA graphs unless enforce_eager."""
    return VLLM_BUFFERS + (0 if rollout_cfg.enforce_eager else VLLM_CUDA_GRAPHS)


# ----------------------------------------------------------------------------------------------------------------
# Per-token formulas
# ----------------------------------------------------------------------------------------------------------------
def optimizer_bytes_per_param(dtype: str) -> int:
    """Adam's m and v in fp32, plus the fp32 master weight of a bf16/fp16 model (megatron/optimizer.py)."""
    return 8 if dtype == "float32" else 12


def activation_bytes_per_token_layer(dims, tp: int, *, sequence_parallel: bool, recompute: str, a_bytes: int,
                                     etp: Optional[int] = None) -> int:
    """Saved activations of one layer per token (module docstring for the formula); full recompute: the layer input."""
    sp = tp if sequence_parallel else 1
    h, d = dims.hidden_size, dims.head_dim
    if recompute == "full":
        return a_bytes * h // sp
    qkv = (dims.num_heads // tp + 2 * math.ceil(dims.num_kv_heads / tp)) * d
    return a_bytes * (4 * h // sp + qkv + dims.num_heads * d // tp) + mlp_bytes_per_token(dims, tp, a_bytes, etp)


def mlp_bytes_per_token(dims, tp: int, a_bytes: int, etp: Optional[int] = None) -> int:
    """The MLP's saved activations per token: a dense layer's 3F/tp (fc1's [gate; up] output, fc2's input); an MoE
    layer's (the largest layer of a mixed model) per routed copy, topk of them with balanced routing: the permuted
    input h (fc1's weight gradient) and the expert output h (kept for the probabilities' gradient) plus 3 fm/etp,
    the shared expert's 3 S/tp, and the router's fp32 logits and probabilities (8E bytes). Under EP a rank
    receives, on average, topk copies of each of its micro-batch's tokens (the all-to-all swaps tokens between EP
    ranks, each with a micro-batch of its own)."""
    moe = dims.moe
    if moe is None or not moe.layers:
        return a_bytes * 3 * dims.ffn_hidden_size // tp
    routed = moe.topk * (2 * dims.hidden_size + 3 * moe.ffn_hidden_size // (etp or tp))
    return a_bytes * (routed + 3 * moe.shared_expert_size // tp) + 8 * moe.num_experts


def head_bytes_per_token(dims, tp: int, entropy: bool) -> int:
    """The log-probs head per token: 12 (24 with entropy) bytes per local vocab column (module docstring)."""
    from megatron_searchr1.models.config import padded_vocab_size

    return padded_vocab_size(dims.vocab_size, tp) // tp * (24 if entropy else 12)


def head_forward_bytes_per_token(dims, tp: int) -> int:
    """The log-probs head of a forward without gradients: bf16 logits and two fp32 temporaries per column."""
    from megatron_searchr1.models.config import padded_vocab_size

    return padded_vocab_size(dims.vocab_size, tp) // tp * 10


# ----------------------------------------------------------------------------------------------------------------
# Phases
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Phase:
    """One phase's memory on one GPU: (item, bytes) in print order."""

    name: str
    items: dict = field(default_factory=dict)
    role: str = ""
    """"" (colocated: every rank), "trainer" or "rollout" (parallel.rollout_placement=disaggregated)."""

    @property
    def total(self) -> int:
        return sum(self.items.values())


@dataclass
class Plan:
    """The planner's answer for one config on one cluster shape."""

    world: int
    dp: int
    gpu_bytes: int
    """Usable bytes of one GPU (`usable_bytes`)."""
    stage: int
    """The pipeline stage with the largest update peak (the one reported)."""
    phases: list
    kv_bytes: int
    kv_bytes_per_token: int
    trajectories_per_engine: int
    full_length: int
    host_bytes_per_node: int
    sync_buckets: int
    sync_extra_bytes: int
    notes: list
    nccl: list = field(default_factory=list)
    """nccl_groups(): the trainer's communicators on one rank."""
    vllm_batch: tuple = (0, 0)
    """vLLM's (max_num_batched_tokens, max_num_seqs)."""
    rollout_ranks: int = 0
    """Disaggregated placement: the ranks that only generate (the rest, world - rollout_ranks, only train)."""

    @property
    def kv_tokens(self) -> int:
        return max(0, self.kv_bytes) // self.kv_bytes_per_token

    @property
    def worst(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)

    @property
    def fits(self) -> bool:
        return self.kv_bytes > 0 and all(p.total <= self.gpu_bytes for p in self.phases)

    def phase(self, name: str) -> Phase:
        """The phase of that name; disaggregated, the larger of the trainer's and the rollout ranks'."""
        return max((p for p in self.phases if p.name == name), key=lambda p: p.total)

    @property
    def roles(self) -> list[str]:
        return list(dict.fromkeys(p.role for p in self.phases))


def expert_tp_of(cfg) -> Optional[int]:
    """parallel.expert_tp as the config gives it (None: not set; models/config.default_expert_tp resolves it)."""
    return getattr(cfg.parallel, "expert_tp", None) or None


def plan_memory(cfg, counts: ModelCounts, *, world: int, gpu_bytes: int, gpus_per_node: int = 8,
                gpu_name: str = "H100") -> Plan:
    """Every phase's bytes on one GPU (the pipeline stage with the largest update peak) for `cfg`; `gpu_bytes`: the
    GPU's usable total (`usable_bytes`), `gpu_name` for vLLM's batch defaults. With
    parallel.rollout_placement=disaggregated (`world` counts every rank) two kinds of rank, each with its phases:
    the trainer ranks (the first world - parallel.rollout_ranks) hold the actor, the reference, the critic and their
    optimizers and never an engine, so nothing is offloaded (GenerationOffload is the colocated trainer's); the
    rollout ranks hold one vLLM engine each, awake for the whole run (start-up; a weight load between two generate
    calls; generating)."""
    m, p, r, a, o, d = cfg.model, cfg.parallel, cfg.rollout, cfg.algo, cfg.optim, cfg.data
    dims, tp, pp, ep, etp = counts.dims, counts.tp, counts.pp, counts.ep, counts.expert_tp
    disagg = p.rollout_placement == "disaggregated"
    rollout_ranks = p.rollout_ranks if disagg else 0
    trainers = world - rollout_ranks
    dp = trainers // (tp * pp)
    edp = trainers // (etp * pp * ep)  # expert-DP: the ranks holding the same expert shards
    wb = DTYPE_BYTES[m.dtype]
    eb = DTYPE_BYTES[m.dtype if r.dtype == "auto" else r.dtype]
    shard, e_shard = (dp, edp) if p.use_distributed_optimizer else (1, 1)

    def sharded(per_param: float, n: int, n_experts: int) -> int:
        """Optimizer bytes of n params (n_experts of them routed experts, sharded over expert-DP only)."""
        return int((n - n_experts) * per_param / shard + n_experts * per_param / e_shard)

    opt_bytes = optimizer_bytes_per_param(m.dtype)
    master_bytes = 0 if m.dtype == "float32" else 4  # allocated at start-up; Adam's m, v at the first step
    has_ref = (a.use_kl_loss or a.use_kl_in_reward) and not m.lora.enabled  # LoRA: the actor without adapters
    tokens = o.max_tokens_per_micro_batch
    notes = []
    if dims.moe is not None:
        notes.append(f"MoE: {dims.moe.num_experts} experts over EP {ep} x expert-TP {etp}; their optimizer state is "
                     f"sharded over expert-DP {edp}, the rest over DP {dp}; vLLM (no expert parallelism in our "
                     f"engine config) holds every expert at 1/{r.engine_tp} of its width on each engine rank")

    # vLLM: one engine per engine_tp GPUs, its share of the GPU = weights + activations + residue + KV cache
    etp_v = r.engine_tp
    batched, seqs = vllm_batch_defaults(gpu_bytes, gpu_name)
    vllm_weights = ((counts.hf_params - counts.hf_replicated) // etp_v + counts.hf_replicated) * eb
    mlp_width = dims.ffn_hidden_size if dims.moe is None else max(
        dims.ffn_hidden_size, dims.moe.topk * dims.moe.ffn_hidden_size + dims.moe.shared_expert_size)
    vllm_act = batched * (3 * mlp_width // etp_v + 4 * dims.hidden_size) * eb + seqs * dims.vocab_size * 4 * 2
    vllm_share = int(r.gpu_memory_utilization * gpu_bytes)
    residue = vllm_residue(r)
    kv = vllm_share - vllm_weights - vllm_act - residue
    kv_per_token = 2 * dims.num_layers * math.ceil(dims.num_kv_heads / etp_v) * dims.head_dim * eb
    # colocated: a step's trajectories over every engine; disaggregated: a rollout rank generates whole batches
    per_engine = d.train_batch_size * r.n if disagg else math.ceil(d.train_batch_size * r.n / (world // etp_v))
    buckets, sync_extra = sync_plan(counts, r.sync_bucket_mb << 20, eb)
    vllm_nccl = NCCL_GROUP_BYTES if etp_v > 1 else 0  # its TP group, connected before its memory snapshot
    # the trainer's passes: vLLM asleep leaves its residue; awake (sleep_between_steps off) it keeps its whole share
    asleep = {"vLLM outside its pools": residue} if r.sleep_between_steps else {"vLLM share (awake)": vllm_share}
    groups = nccl_groups(trainers, tp, pp, ep, etp, moe=dims.moe is not None, tied=dims.tie_embeddings,
                         distributed_optimizer=p.use_distributed_optimizer)
    fixed = {"CUDA context": CUDA_CONTEXT, "NCCL (trainer groups)": nccl_bytes(groups),
             "NCCL (vLLM TP group)": 0 if disagg else vllm_nccl}

    best = None
    for s, st in enumerate(counts.stages):
        state = {"actor weights": st.actor * wb, "actor gradients (fp32)": st.actor * 4,
                 "actor optimizer": sharded(opt_bytes, st.actor, st.actor_experts),
                 "reference weights": st.actor * wb if has_ref else 0}
        if a.uses_critic:
            state.update({"critic weights": st.critic * wb, "critic gradients (fp32)": st.critic * 4,
                          "critic optimizer": sharded(opt_bytes, st.critic, st.critic_experts)})

        def held(phase: str, **override) -> dict:
            kinds = frozenset(STATE_KINDS) if disagg else resident_states(phase, m)
            return {k: override.get(k, state.get(k, 0)) if k in kinds else 0 for k in STATE_KINDS}

        in_flight = (pp - s) * st.layers  # 1F1B: stage s holds up to pp - s micro-batches
        layer = dict(sequence_parallel=p.sequence_parallel, a_bytes=wb, etp=etp)
        acts = tokens * activation_bytes_per_token_layer(dims, tp, recompute=m.recompute, **layer) * in_flight
        one_layer = tokens * activation_bytes_per_token_layer(dims, tp, recompute="none", **layer)
        if m.recompute == "full":  # one layer's activations while it is re-run in backward
            acts += one_layer
        head = tokens * head_bytes_per_token(dims, tp, a.entropy_coeff > 0) if st.last else 0
        head_fwd = tokens * head_forward_bytes_per_token(dims, tp) if st.last else 0
        start = Phase("start-up", {
            **held("start-up", **{"actor optimizer": sharded(master_bytes, st.actor, st.actor_experts),
                                  "critic optimizer": sharded(master_bytes, st.critic, st.critic_experts)
                                  if a.uses_critic else 0}),
            **fixed, "vLLM share (must be free)": vllm_share})
        sync = Phase("weight sync", {**held("weight sync"), **fixed, "vLLM weights": vllm_weights,
                                     "vLLM outside its pools": residue, "sync buckets": sync_extra})
        roll = Phase("rollout", {**held("rollout"), **fixed, "vLLM weights": vllm_weights,
                                 "vLLM outside its pools": residue, "vLLM activations": vllm_act,
                                 "vLLM KV cache": max(kv, 0)})
        fwd = Phase("log-prob passes", {**held("log-prob passes"), **fixed, **asleep,
                                        "forward (one micro-batch)": one_layer + head_fwd})
        update = Phase("update peak", {**held("update peak"), **fixed, **asleep,
                                       "activations": acts, "log-prob head": head})
        if disagg:  # a trainer rank: no engine, no rollout phase
            start.items.pop("vLLM share (must be free)")
            sync.items = {k: v for k, v in sync.items.items() if not k.startswith("vLLM")}
            fwd.items = {k: v for k, v in fwd.items.items() if not k.startswith("vLLM")}
            update.items = {k: v for k, v in update.items.items() if not k.startswith("vLLM")}
            mine = [start, sync, fwd, update]
            for ph in mine:
                ph.role = "trainer"
        else:
            mine = [start, sync, roll, fwd, update]
        if best is None or update.total > best[1][-1].total:
            best = (s, mine, state)
    s, phases, state = best
    if disagg:
        phases = phases + rollout_rank_phases(vllm_share=vllm_share, vllm_weights=vllm_weights, residue=residue,
                                              vllm_act=vllm_act, kv=kv, bucket=r.sync_bucket_mb << 20)
        # the bridge moves host memory: trainer rank 0 keeps the version it sends and the newest one queued behind
        # it; a rollout rank its two reused slots, the newest version it holds and the one it receives
        version = counts.hf_params * eb
        rollout_node = BRIDGE_HOST_VERSIONS * version * min(gpus_per_node, rollout_ranks)
        host_node = max(BRIDGE_HOST_VERSIONS * version, rollout_node)
        notes.append(f"disaggregated: {trainers} trainer ranks (TPxPPxDP {tp}x{pp}x{dp}) hold no engine and offload "
                     f"nothing; {rollout_ranks} rollout ranks hold one vLLM engine each, awake all run. Host memory "
                     f"of the weights in flight: {BRIDGE_HOST_VERSIONS * version / GiB:.0f} GiB on trainer rank 0, "
                     f"{BRIDGE_HOST_VERSIONS * version / GiB:.0f} GiB per rollout rank ({rollout_node / GiB:.0f} GiB "
                     "on a rollout node)")
        notes.append(f"disaggregated: a rollout rank generates a whole batch ({per_engine} trajectories) on its "
                     f"engine, and at most rollout.max_staleness + 2 = {r.max_staleness + 2} batches are in "
                     f"flight, so {min(rollout_ranks, r.max_staleness + 2)} of the {rollout_ranks} rollout ranks "
                     "work at once")
    else:
        away = [k for k in STATE_KINDS if k not in resident_states("rollout", m)]
        host = sum(state.get(k, 0) for k in away)
        host += vllm_weights if (r.sleep_level == 1 and r.sleep_between_steps) else 0  # vLLM's pinned weights
        host_node = host * gpus_per_node
    if kv <= 0:
        notes.append(f"vLLM has no room for a KV cache: its share {vllm_share / GiB:.1f} GiB holds weights "
                     f"{vllm_weights / GiB:.1f} GiB + activations {vllm_act / GiB:.1f} GiB + "
                     f"{residue / GiB:.1f} GiB outside its pools; raise rollout.gpu_memory_utilization or "
                     "rollout.engine_tp")
    return Plan(world=world, dp=dp, gpu_bytes=gpu_bytes, stage=s, phases=phases, kv_bytes=kv,
                kv_bytes_per_token=kv_per_token, trajectories_per_engine=per_engine,
                full_length=d.max_prompt_length + r.max_response_length, host_bytes_per_node=host_node,
                sync_buckets=buckets, sync_extra_bytes=sync_extra, notes=notes, nccl=groups,
                vllm_batch=(batched, seqs), rollout_ranks=rollout_ranks)


def rollout_rank_phases(*, vllm_share: int, vllm_weights: int, residue: int, vllm_act: int, kv: int,
                        bucket: int) -> list[Phase]:
    """A disaggregated rollout rank's phases: vLLM's share must be free at start-up; a weight load (between two
    generate calls, the engine awake: its KV cache stays) adds one received bucket on the GPU; generating holds the
    share. No trainer state, no NCCL (the bridge is gloo, in host memory; one engine per rank, no TP group)."""
    engine = {"CUDA context": CUDA_CONTEXT, "vLLM weights": vllm_weights, "vLLM outside its pools": residue,
              "vLLM activations": vllm_act, "vLLM KV cache": max(kv, 0)}
    return [Phase("start-up", {"CUDA context": CUDA_CONTEXT, "vLLM share (must be free)": vllm_share}, "rollout"),
            Phase("weight sync", {**engine, "received bucket": bucket}, "rollout"),
            Phase("rollout", dict(engine), "rollout")]


# ----------------------------------------------------------------------------------------------------------------
# The verdict: what would make it fit
# ----------------------------------------------------------------------------------------------------------------
def with_overrides(cfg, overrides: dict):
    """A copy of cfg with {"section.field": value} applied (sections are re-validated by their __post_init__)."""
    sections: dict = {}
    for key, value in overrides.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    return dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **kw) for s, kw in sections.items()})


def candidate_knobs(cfg) -> list[dict]:
    """Config changes that lower the peak, cheapest first (each only where it changes something)."""
    m, p, r, a = cfg.model, cfg.parallel, cfg.rollout, cfg.algo
    knobs: list[dict] = []
    colocated = p.rollout_placement != "disaggregated"  # disaggregated: nothing offloads, no engine sleeps
    if colocated and not r.sleep_between_steps:
        knobs.append({"rollout.sleep_between_steps": True})
    if p.tp > 1 and not p.sequence_parallel:
        knobs.append({"parallel.sequence_parallel": True})
    if colocated and (a.use_kl_loss or a.use_kl_in_reward) and not m.ref_offload:
        knobs.append({"model.ref_offload": True})
    if colocated and not m.optimizer_offload:
        knobs.append({"model.optimizer_offload": True})
    if colocated and not m.grad_offload:
        knobs.append({"model.grad_offload": True})
    if m.recompute != "full":
        knobs.append({"model.recompute": "full"})
    least = cfg.data.max_prompt_length + r.max_response_length
    if cfg.optim.max_tokens_per_micro_batch > least:
        knobs.append({"optim.max_tokens_per_micro_batch": least})
    if colocated and not m.param_offload:
        knobs.append({"model.param_offload": True})
    if not p.use_distributed_optimizer:
        knobs.append({"parallel.use_distributed_optimizer": True})
    for util in (0.6, 0.5, 0.4, 0.3):
        if util < r.gpu_memory_utilization:
            knobs.append({"rollout.gpu_memory_utilization": util})
    return knobs


def find_fix(cfg, counts: ModelCounts, **plan_kw) -> Optional[dict]:
    """The first single knob that makes every phase fit, else the knobs together in order up to the first set that
    does; None when nothing in `candidate_knobs` is enough."""
    knobs = candidate_knobs(cfg)
    for knob in knobs:
        if plan_memory(with_overrides(cfg, knob), counts, **plan_kw).fits:
            return knob
    together: dict = {}
    for knob in knobs:
        together.update(knob)
        if plan_memory(with_overrides(cfg, together), counts, **plan_kw).fits:
            return together
    return None
