"""Seconds per SFT optimizer step, and where they go: the trainer's real `step()` on a real SFT data set.

    torchrun --nproc_per_node 2 tools/benchmarks/bench_sft_step.py runs/cpu_demo/sft_data \
        --datasets gold_world_sft_100003 --model runs/cpu_demo/tiny_model --steps 30
    ... --profile            # rank 0's cProfile of the timed steps (top 25 by cumulative time)
    ... --set optim.max_tokens_per_micro_batch=8192    # any SFT config override (repeatable), e.g. A/B settings

Builds `SFTTrainer` (trainer/sft.py) with examples/sft_tiny_cpu.yaml and the overrides, runs `--warmup` untimed
steps, then `--steps` timed ones, and prints the median step, its split into the phases of a step (micro-batch
packing, forward+backward, gradient all-reduce, optimizer, the per-step metric all-reduce) and the examples and
tokens per second, and rank 0's CPU seconds per step (on a shared machine the wall time moves with the load, CPU time
much less). A paired comparison of two settings is two runs of this script with different `--set`s, timed in turn
(`farm-bench --vs`).
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

from megatron_searchr1.cli import ArgumentParser, at_least  # stdlib-only: no heavy import

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dataset_dir", help="a directory with dataset_info.json (the demo's <work>/sft_data)")
    p.add_argument("--datasets", required=True, help="comma-separated dataset names of dataset_info.json")
    p.add_argument("--model", required=True, help="HF model directory (the demo's <work>/tiny_model)")
    p.add_argument("--steps", type=at_least(1), default=30, help="timed steps")
    p.add_argument("--warmup", type=at_least(0), default=3, help="untimed steps before them")
    p.add_argument("--batch", type=at_least(1), default=16, help="examples per optimizer step (all ranks)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an SFT config override")
    p.add_argument("--profile", action="store_true", help="cProfile rank 0's timed steps")
    a = p.parse_args(argv)
    if not os.path.isfile(os.path.join(a.dataset_dir, "dataset_info.json")):
        print(f"error: {a.dataset_dir} has no dataset_info.json", file=sys.stderr)
        raise SystemExit(2)
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch  # noqa: F401  (after the arguments)
    import torch.distributed as dist

    from megatron_searchr1.config import SFTConfig, load_config
    from megatron_searchr1.console import quiet_third_party_warnings
    from megatron_searchr1.trainer import sft as sft_mod

    quiet_third_party_warnings()
    out = tempfile.mkdtemp(prefix="bench_sft_")
    cfg = load_config(os.path.join(EXAMPLES, "sft_tiny_cpu.yaml"), [
        f"model.path={a.model}", f"data.dataset_dir={a.dataset_dir}", f"data.datasets=[{a.datasets}]",
        f"trainer.output_dir={out}", f"data.batch_size={a.batch}", "trainer.total_steps=100000",
        "logging.tensorboard=false", "logging.progress_bar=false", "trainer.export_hf=false", *a.set],
        cls=SFTConfig)
    cfg.validate(world_size=int(os.environ.get("WORLD_SIZE", "1")))
    trainer = sft_mod.SFTTrainer(cfg)
    rank = dist.get_rank()

    # phase timers: wrap the functions a step calls (module attributes, so the wrappers are what step() calls)
    from megatron_searchr1.megatron import schedule

    phases: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0
        return wrapper

    sft_mod.make_micro_batches = timed("pack", sft_mod.make_micro_batches)
    sft_mod.mean_over_ranks = timed("metrics_allreduce", sft_mod.mean_over_ranks)
    schedule.forward_backward = timed("forward_backward", schedule.forward_backward)  # incl. the DDP all-reduce
    opt = trainer.policy.optimizer
    opt.step = timed("optimizer", opt.step)
    for _ in range(a.warmup):
        trainer.step()
    phases.clear()
    prof = None
    if a.profile and rank == 0:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    times, cpu, tokens = [], [], []
    for _ in range(a.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        m = trainer.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        tokens.append(m["perf/tokens_per_s"] * m["time/step"])
    if prof is not None:
        prof.disable()
        import pstats

        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    if rank == 0:
        med = statistics.median(times)
        print(f"{a.steps} steps of {a.batch} examples, world {dist.get_world_size()}, torch threads "
              f"{torch.get_num_threads()}: median {med:.3f} s/step (min {min(times):.3f}, max {max(times):.3f}), "
              f"{a.batch / med:.1f} examples/s, {statistics.mean(tokens) * dist.get_world_size() / med:.0f} tokens/s; "
              f"rank 0's CPU time median {statistics.median(cpu):.3f} s/step (the figure a loaded machine moves "
              "least)")
        for k, v in sorted(phases.items(), key=lambda kv: -kv[1]):
            print(f"  {k:<20}{v / a.steps:.3f} s/step ({100 * v / sum(times):.0f}%)")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
