"""The memory planner's output: the per-phase table with its verdict, and one markdown row per recipe."""
from __future__ import annotations

import os
from typing import Optional

from megatron_searchr1.planner.counts import ModelCounts
from megatron_searchr1.planner.memory import GiB, PHASES, Plan

SUMMARY_HEADER = ("| recipe | nodes | TPxPPxDP | " + " | ".join(PHASES) + " | KV tokens per engine "
                  "| full-length trajectories at once, of per engine | host GiB per node | verdict |\n"
                  "|" + "---|" * (len(PHASES) + 7))


def _gib(n: int) -> str:
    return f"{n / GiB:.1f}" if n else "-"


def _layout(plan: Plan, counts: ModelCounts) -> str:
    ep = f" (EP {counts.ep}" + (f", expert-TP {counts.expert_tp}" if counts.expert_tp != counts.tp else "") + ")"
    rollout = f" + {plan.rollout_ranks} rollout" if plan.rollout_ranks else ""
    return f"{counts.tp}x{counts.pp}x{plan.dp}" + (ep if counts.ep > 1 else "") + rollout


def summary_row(plan: Plan, cfg, counts: ModelCounts, config_path: str, nodes: int) -> str:
    """One markdown table row (the README's table of the shipped recipes)."""
    return (f"| {os.path.basename(config_path)} | {nodes} | {_layout(plan, counts)} | "
            + " | ".join(f"{plan.phase(n).total / GiB:.1f}" for n in PHASES)
            + f" | {plan.kv_tokens // 1000}k | {plan.kv_tokens // plan.full_length} of "
            f"{plan.trajectories_per_engine} | {plan.host_bytes_per_node / GiB:.0f} | "
            + ("fits" if plan.fits else "does NOT fit") + " |")


def _role(phase) -> str:
    return f"{phase.role} " if phase.role else ""


def _knobs(fix: dict) -> str:
    return " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in fix.items())


def _table(plan: Plan, phases: list) -> list[str]:
    rows: list[str] = []
    for ph in phases:  # rows in first-seen order; a row that is zero everywhere (no critic) is left out
        rows += [k for k, v in ph.items.items() if k not in rows and any(p.items.get(k) for p in phases)]
    width = max(len(k) for k in rows) + 2
    col = max(len(ph.name) for ph in phases) + 2
    head = "GiB per GPU".ljust(width) + "".join(ph.name.rjust(col) for ph in phases)
    out = [head, "-" * len(head)]
    for k in rows:
        out.append(k.ljust(width) + "".join(_gib(ph.items.get(k, 0)).rjust(col) for ph in phases))
    out.append("-" * len(head))
    out.append("total".ljust(width) + "".join(_gib(ph.total).rjust(col) for ph in phases))
    out.append("free".ljust(width) + "".join(f"{(plan.gpu_bytes - ph.total) / GiB:.1f}".rjust(col) for ph in phases))
    return out


def render(plan: Plan, cfg, counts: ModelCounts, fix: Optional[dict], nominal_gib: float) -> str:
    """The table and the verdict, as printed."""
    r = cfg.rollout
    out = [f"{cfg.model.path or 'model'}: {counts.hf_params / 1e9:.2f}B params; world {plan.world} = TPxPPxDP "
           f"{_layout(plan, counts)}; pipeline stage {plan.stage} shown ({nominal_gib:g} GiB GPUs, "
           f"{plan.gpu_bytes / GiB:.1f} GiB usable)"]
    for role in plan.roles:  # colocated: one table; disaggregated: the trainer ranks', then the rollout ranks'
        if role:
            ranks = plan.rollout_ranks if role == "rollout" else plan.world - plan.rollout_ranks
            out.append(f"{role} ranks ({ranks}):")
        out += _table(plan, [ph for ph in plan.phases if ph.role == role])
    kv_tokens = plan.kv_tokens
    fit_traj = kv_tokens // plan.full_length
    out.append(f"KV cache: {kv_tokens:,} tokens per engine ({plan.kv_bytes_per_token / 1024:.0f} KiB per token, "
               f"engine_tp {r.engine_tp}); {fit_traj} trajectories at the full {plan.full_length} tokens fit at once, "
               + (f"a batch gives its rollout rank {plan.trajectories_per_engine}" if plan.rollout_ranks else
                  f"a step gives each engine {plan.trajectories_per_engine}")
               + ("" if fit_traj >= plan.trajectories_per_engine else
                  " (sessions beyond that wait or are preempted and recomputed by vLLM: slower, not lost)"))
    out.append(f"vLLM: max_num_batched_tokens {plan.vllm_batch[0]}, max_num_seqs {plan.vllm_batch[1]} (its defaults "
               "for this GPU)")
    out.append(f"NCCL: {len(plan.nccl)} trainer communicators on this rank: "
               + "; ".join(f"{name} ({size})" for name, size in plan.nccl))
    out.append(f"weight sync: {plan.sync_buckets} buckets of <= {r.sync_bucket_mb} MiB, peak extra "
               f"{plan.sync_extra_bytes / GiB:.2f} GiB; host memory per node: {plan.host_bytes_per_node / GiB:.0f} GiB"
               + (" (the weights in flight between the roles: note below)" if plan.rollout_ranks else
                  (" (sleep_level 1 keeps a pinned copy of vLLM's weights)" if r.sleep_level == 1 else "")
                  + " pinned/offloaded"))
    out += [f"note: {n}" for n in plan.notes]
    worst = plan.worst
    if plan.kv_bytes <= 0 and worst.total <= plan.gpu_bytes:
        out.append("verdict: does NOT fit; vLLM has no room for its KV cache (note above)")
    elif plan.fits:
        out.append(f"verdict: fits; tightest phase {_role(worst)}{worst.name} with {(plan.gpu_bytes - worst.total) / GiB:.1f} GiB "
                   "free")
    else:
        short = worst.total - plan.gpu_bytes
        line = f"verdict: does NOT fit; {_role(worst)}{worst.name} needs {worst.total / GiB:.1f} GiB, {short / GiB:.1f} GiB over"
        line += ("; fits with " + _knobs(fix)) if fix else \
            "; no config knob is enough: more GPUs or a larger parallel.tp"
        out.append(line)
    return "\n".join(out)
