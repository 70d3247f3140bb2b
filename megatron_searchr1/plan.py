"""Will this config fit: the GPU memory of every phase of an RL step, per GPU, from the model built on the meta device.

    python -m megatron_searchr1.plan examples/grpo_qwen2.5-7b.yaml --nodes 1 --gpus-per-node 8 --gpu-memory-gib 80
    python -m megatron_searchr1.plan examples/ppo_qwen2.5-3b.yaml parallel.sequence_parallel=true --nodes 2 \
        --model-config tests/models/real_configs/Qwen2.5-3B-Instruct.json    # model not downloaded yet

It prints, per GPU, what each phase of a step holds (start-up, weight sync, rollout, log-prob passes, update peak)
against the GPU's usable memory (with parallel.rollout_placement=disaggregated, one table for the trainer ranks and
one for the rollout ranks), and a verdict; when the config does not fit, the first config change that makes it
fit. The parts live in planner/: counts.py (parameters per rank from the model built on the meta device; the weight
sync's buckets), memory.py (the phases and their byte arithmetic, every assumption written down there), render.py
(the table, the summary row). This module is the command line and re-exports their names.
"""
from __future__ import annotations

import json
import os
from typing import Optional, Sequence

from megatron_searchr1.cli import ArgumentParser, UsageError, above, at_least, run_main
from megatron_searchr1.planner.counts import (ModelCounts, StageCounts, build_meta_stage,  # noqa: F401
                                              count_params, meta_world, read_dims_of, shard_numel,
                                              stage_param_numel, sync_plan)
from megatron_searchr1.planner.memory import (CUDA_CONTEXT, DTYPE_BYTES, GiB, NCCL_GROUP_BYTES, PHASES,  # noqa: F401
                                              STATE_KINDS, USABLE_FRACTION, VLLM_BUFFERS, VLLM_CUDA_GRAPHS, Phase, Plan,
                                              activation_bytes_per_token_layer, candidate_knobs, expert_tp_of,
                                              find_fix, head_bytes_per_token, head_forward_bytes_per_token,
                                              mlp_bytes_per_token, nccl_bytes, nccl_groups, optimizer_bytes_per_param,
                                              plan_memory, resident_states, usable_bytes, vllm_batch_defaults,
                                              vllm_residue, with_overrides)
from megatron_searchr1.planner.render import SUMMARY_HEADER, render, summary_row  # noqa: F401

# The config.json files shipped for planning before a download, named as the error message names them.
REAL_CONFIGS_DIR = "tests/models/real_configs"
REAL_CONFIGS = ("Qwen2.5-3B-Instruct.json", "Qwen2.5-7B-Instruct.json", "Qwen3-4B-Instruct-2507.json",
                "Qwen3-8B.json", "Qwen3-30B-A3B.json", "Llama-3.1-8B.json")


def load_plan_inputs(config_path: str, overrides: Sequence[str], world: int, model_config: Optional[str]):
    """(cfg, hf config dict): the run config validated for `world` GPUs and the model's config.json; UsageError
    naming what to change. Light: yaml and json only (no torch)."""
    from megatron_searchr1.config import ConfigError, load_config

    try:
        cfg = load_config(config_path, list(overrides))
        cfg.validate(world_size=world, check_files=False)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    path = model_config or os.path.join(cfg.model.path, "config.json")
    if not os.path.isfile(path):
        raise UsageError(f"model config {path!r} does not exist: download model.path={cfg.model.path!r}, or pass "
                         f"--model-config FILE (a config.json; {REAL_CONFIGS_DIR}/ holds "
                         f"{', '.join(REAL_CONFIGS)})")
    try:
        with open(path) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"--model-config {path!r} is not a JSON config: {e}") from None
    if not isinstance(hf, dict):
        raise UsageError(f"--model-config {path!r} must hold a JSON object (a config.json)")
    return cfg, hf


def plan_config(cfg, hf: dict, *, nodes: int = 1, gpus_per_node: int = 8, gpu_memory_gib: float = 80.0,
                gpu_name: str = "H100", expert_tp: Optional[int] = None) -> tuple[Plan, ModelCounts, Optional[dict]]:
    """(plan, counts, fix or None) for a validated config and its model's config.json dict; `gpu_memory_gib`: the
    GPU's nominal size; `expert_tp`: Megatron's expert-tensor-parallel size (None: parallel.expert_tp, whose null
    is 1 for an MoE model, as the trainer builds it: models/config.default_expert_tp)."""
    from megatron_searchr1.models.config import check_parallel_sizes, default_expert_tp
    from megatron_searchr1.models.families import read_dims

    p, world = cfg.parallel, nodes * gpus_per_node
    trainers = cfg.trainer_world(world)  # disaggregated: the Megatron layout spans the trainer ranks only
    try:
        dims = read_dims(hf)
        etp = default_expert_tp(dims, p.tp, expert_tp or expert_tp_of(cfg))
        check_parallel_sizes(dims, p.tp, p.pp, ep=p.ep, world_size=trainers, expert_tp=etp)
    except ValueError as e:
        raise UsageError(f"{e} (parallel.tp / parallel.pp / parallel.ep / parallel.expert_tp)") from None
    if trainers % (etp * p.ep * p.pp):
        raise UsageError(f"{'trainer ranks' if trainers < world else 'world size'} {trainers} is not a multiple of "
                         f"expert-TP x parallel.ep x parallel.pp = {etp} x {p.ep} x {p.pp}: change --expert-tp or "
                         "parallel.ep")
    counts = count_params(dims, p.tp, p.pp, ep=p.ep, etp=etp)
    kw = dict(world=world, gpu_bytes=usable_bytes(gpu_memory_gib), gpus_per_node=gpus_per_node, gpu_name=gpu_name)
    plan = plan_memory(cfg, counts, **kw)
    return plan, counts, None if plan.fits else find_fix(cfg, counts, **kw)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = ArgumentParser(prog="python -m megatron_searchr1.plan", description=__doc__.split("\n\n")[0],
                       epilog="Overrides: dotted KEY=VALUE as for train.py, e.g. parallel.sequence_parallel=true")
    p.add_argument("config", help="run config YAML (examples/*.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted KEY=VALUE overrides")
    p.add_argument("--nodes", type=at_least(1), default=1, help="nodes")
    p.add_argument("--gpus-per-node", type=at_least(1), default=8, help="GPUs per node")
    p.add_argument("--gpu-memory-gib", type=above(0), default=80.0,
                   help=f"nominal memory of one GPU in GiB ({USABLE_FRACTION * 100:.1f}%% of it is usable)")
    p.add_argument("--gpu-name", default="H100",
                   help="GPU model: vLLM picks its batch defaults by memory and name (A100 smaller)")
    p.add_argument("--expert-tp", type=at_least(1), default=None,
                   help="MoE: Megatron's expert-tensor-parallel size (default: parallel.expert_tp where the config "
                        "has it, else parallel.tp)")
    p.add_argument("--model-config", default=None,
                   help="the model's config.json (default: <model.path>/config.json)")
    p.add_argument("--summary", action="store_true", help="one markdown table row instead of the table")
    args = p.parse_args(argv)
    if not os.path.isfile(args.config):
        raise UsageError(f"config {args.config!r} does not exist (pass a run config YAML, e.g. "
                         "examples/grpo_qwen2.5-7b.yaml)")
    cfg, hf = load_plan_inputs(args.config, args.overrides, args.nodes * args.gpus_per_node, args.model_config)
    import warnings

    with warnings.catch_warnings():  # Megatron's CPU fallbacks (no Apex, no TE) say nothing about the planned run
        warnings.simplefilter("ignore")
        plan, counts, fix = plan_config(cfg, hf, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                                        gpu_memory_gib=args.gpu_memory_gib, gpu_name=args.gpu_name,
                                        expert_tp=args.expert_tp)
    print(summary_row(plan, cfg, counts, args.config, args.nodes) if args.summary
          else render(plan, cfg, counts, fix, args.gpu_memory_gib))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
