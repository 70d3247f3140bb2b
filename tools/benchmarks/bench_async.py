# PYTHONPATH=$PWD python tools/benchmarks/bench_async.py --work-dir /tmp/bench_async
# (~6-8 min on 2 cores: world + tiny model once, cached in --work-dir; then two torchrun runs of the RL trainer)
# PYTHONPATH=$PWD python tools/benchmarks/bench_async.py --rollout-ranks 2 --partial
#   (colocated vs 2 rollout ranks generating shares vs the same 2 streaming groups, side by side; ~10-12 min)
# PYTHONPATH=$PWD python tools/benchmarks/bench_async.py --rollout-ranks 2 --compare-code /work/main
#   (the disaggregated run with 2 rollout ranks, this checkout's trainer and another checkout's, side by side)
"""Samples per second of the synchronous colocated trainer vs the disaggregated asynchronous one, side by side.

The same RL work twice, one run after the other on this machine, the tiny recipe (`examples/grpo_tiny_cpu.yaml`
scaled down: the test suite's tiny Qwen2, 4 prompts x 2 samples per step, vLLM on the CPU, a live BM25 server):
  (a) colocated: `torchrun --nproc_per_node 2`, TP=2; every rank generates, then every rank trains;
  (b) disaggregated: `torchrun --nproc_per_node 3`, the same 2 trainer ranks at TP=2 plus 1 rollout rank,
      `rollout.max_staleness` k (default 1): the rollout rank generates batch t+1 while the trainer trains batch t.
      With --rollout-ranks K > 1: 1 trainer rank (TP=1) plus K rollout ranks, each generating a share of every batch.
  (b') the same ranks streaming GRPO groups (`rollout.async_granularity=group`): each rollout rank keeps a share's
      worth of groups in flight across batches and refills a finished group's slot at once.
      With --partial both (b) and (b') run with `rollout.partial=true` (new weights between turns).
  (c) with --compare-code DIR: (b) again with DIR's trainer (another checkout: PYTHONPATH=DIR for the ranks), so two
      versions of the runtime are measured one after the other on the same inputs.
Throughput = samples trained in steps 2..S over the sum of those steps' `time/step` (step 1 holds start-up costs
that differ between the two: the first weights, vLLM's warm-up).

The long tail. A multi-turn search step waits for its slowest trajectory (one question needs four searches,
another none); a random tiny model on the CPU has no such tail of its own. So every trajectory gets an extra time
drawn from a Pareto distribution (shape --tail-alpha, scale --tail-scale seconds), seeded by its prompt and sample
index, so a trajectory has the same tail in every run and wherever it is generated; every generate call (a colocated
rank's shard of a step, a rollout rank's share of a batch) is followed by a sleep of its longest trajectory's tail:
the time its slowest trajectory adds; a streamed group keeps its slot (and reaches the trainer) that much later than
its last turn (trainer/rollout_stream.py `release_time`), while the rank goes on with its other groups. A sleep
takes no CPU, which models what disaggregation has on real hardware and
this 2-core VM has not: generation on devices of its own. What the generation and the update really compute still
shares the two cores in (b), so the ratio is a lower bound of what separate devices give for the same tail.

Prints one table: per run the steps timed, mean step time, samples/s, and the ratio to (a).
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_MODEL = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=2, vocab_size=1000,
                  tie_embeddings=True)


def tail_delay(uid: str, sample: int, alpha: float, scale: float) -> float:
    """A trajectory's extra seconds: Pareto(alpha) x scale, seeded by its prompt and sample index.

    >>> d = [tail_delay(f"q{i}", 0, alpha=1.5, scale=0.5) for i in range(1000)]
    >>> min(d) >= 0.5, max(d) > 10 * sorted(d)[500], tail_delay("q1", 1, 1.5, 0.5) == tail_delay("q1", 1, 1.5, 0.5)
    (True, True, True)
    """
    return scale * random.Random(f"{uid}/{sample}").paretovariate(alpha)


def child() -> int:
    """Inside a torchrun rank: the trainer with the tail added after each generate call (module doc)."""
    from megatron_searchr1.rollout import loop

    alpha, scale = float(os.environ["BENCH_TAIL_ALPHA"]), float(os.environ["BENCH_TAIL_SCALE"])
    real = loop.run_rollout

    def slow_tail_run_rollout(engine, tokenizer, search, trajs, *args, **kw):
        out = real(engine, tokenizer, search, trajs, *args, **kw)
        import time

        time.sleep(max((tail_delay(tr.uid, tr.sample, alpha, scale) for tr in trajs), default=0.0))
        return out

    loop.run_rollout = slow_tail_run_rollout
    try:  # a --compare-code checkout may predate streamed groups
        from megatron_searchr1.trainer import rollout_stream
    except ImportError:
        rollout_stream = None
    if rollout_stream is not None:
        def slow_tail_release(group, finished: float) -> float:
            return finished + max((tail_delay(tr.uid, tr.sample, alpha, scale) for tr in group.trajs), default=0.0)

        rollout_stream.release_time = slow_tail_release
    from megatron_searchr1.train import cli

    sys.argv = [sys.argv[0], *sys.argv[2:]]  # drop --child
    return cli()


def build_inputs(work: str) -> tuple[str, str]:
    """(world dir, tiny model dir) under `work`, made once."""
    world, model = os.path.join(work, "world"), os.path.join(work, "tiny_model")
    if not os.path.isfile(os.path.join(world, "train.parquet")):
        subprocess.run([sys.executable, "-m", "megatron_searchr1.data.make_world", "--out-dir", world, "--template",
                        "short", "--oracle", "bm25", "--seed", "0"], check=True, cwd=REPO)
    if not os.path.isfile(os.path.join(model, "config.json")):
        from megatron_searchr1.demo import world_text
        from megatron_searchr1.models.tiny import TinyModelConfig, make_tiny_model

        text = os.path.join(work, "world_text.txt")
        world_text(world, text)
        make_tiny_model(TinyModelConfig(output_dir=model, text_files=[text], **TINY_MODEL))
    return world, model


def run(name: str, nproc: int, extra: list[str], world: str, model: str, url: str, out: str, steps: int,
        env: dict) -> dict:
    args = [os.path.join(REPO, "examples", "grpo_tiny_cpu.yaml"), f"model.path={model}", "model.megatron_ckpt=null",
            f"retrieval.url={url}", f"data.train_files=[{world}/train.parquet]", "data.val_files=[]",
            "data.train_batch_size=4", "algo.ppo_mini_batch_size=4", "rollout.temperature=1.0", "rollout.n=2",
            "rollout.max_turns=2", "rollout.max_tokens_per_turn=24", "rollout.max_response_length=160",
            "rollout.max_obs_length=64", "rollout.kv_cache_gib=0.25", "trainer.save_freq=0",
            "trainer.val_before_train=false", "trainer.export_hf=false", "logging.progress_bar=false",
            f"trainer.total_steps={steps}", f"trainer.output_dir={out}", *extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.abspath(__file__), "--child", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: the {name} run failed (rc {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    timed = [r for r in recs if "time/step" in r and r["step"] >= 2]
    seconds = sum(r["time/step"] for r in timed)
    samples = 4 * 2 * len(timed)
    return {"name": name, "steps": len(timed), "step_s": seconds / len(timed), "samples_per_s": samples / seconds,
            "lag": [r.get("async/lag") for r in timed], "parts": [r.get("async/parts") for r in timed],
            "in_flight": [r.get("async/groups_in_flight_mean") for r in timed]}


def main(argv=None) -> int:
    from megatron_searchr1.cli import ArgumentParser, above, at_least  # stdlib-only: no heavy import

    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", default="/tmp/bench_async", help="world, model and runs (world and model reused)")
    p.add_argument("--steps", type=at_least(2), default=5, help="RL steps per run (steps 2.. are timed)")
    p.add_argument("--max-staleness", type=at_least(0), default=1, help="rollout.max_staleness of the async run")
    p.add_argument("--rollout-ranks", type=at_least(1), default=1,
                   help="rollout ranks of the disaggregated run (> 1: with 1 trainer rank at TP=1)")
    p.add_argument("--partial", action="store_true",
                   help="rollout.partial=true in the disaggregated runs (new weights between two turns)")
    p.add_argument("--compare-code", default=None,
                   help="another checkout whose trainer also runs the disaggregated run (e.g. the main branch)")
    p.add_argument("--tail-alpha", type=above(0), default=1.5,
                   help="Pareto shape of the per-trajectory tail (smaller: longer)")
    p.add_argument("--tail-scale", type=at_least(0.0, float), default=1.0, help="Pareto scale: the shortest tail, seconds")
    args = p.parse_args(argv)
    if args.compare_code and not os.path.isdir(os.path.join(args.compare_code, "megatron_searchr1")):
        p.error(f"--compare-code {args.compare_code} has no megatron_searchr1 package: pass a checkout of this repo")
    from megatron_searchr1.search.launch import ServerProcess

    os.makedirs(args.work_dir, exist_ok=True)
    world, model = build_inputs(args.work_dir)
    def env(code: str) -> dict:
        return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                "PYTHONPATH": f"{os.path.abspath(code)}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                "BENCH_TAIL_ALPHA": str(args.tail_alpha), "BENCH_TAIL_SCALE": str(args.tail_scale)}

    k = args.rollout_ranks
    trainers = 2 if k == 1 else 1  # TP=2 as the colocated run; with more rollout ranks 1 (3 processes for K=2)
    disagg = [f"parallel.tp={trainers}", "parallel.rollout_placement=disaggregated", f"parallel.rollout_ranks={k}",
              f"rollout.max_staleness={args.max_staleness}", f"rollout.partial={str(args.partial).lower()}"]
    async_name = (f"disaggregated, async k={args.max_staleness}{', partial' if args.partial else ''} ({trainers} "
                  f"trainer + {k} rollout ranks)")
    plan = [("colocated, synchronous (2 ranks, TP=2)", "colocated", 2, ["parallel.tp=2"], REPO),
            (f"{async_name}, shares", "disaggregated", trainers + k, disagg, REPO),
            (f"{async_name}, streamed groups", "streamed", trainers + k,
             disagg + ["rollout.async_granularity=group"], REPO)]
    if args.compare_code:
        plan.append((f"the same with {args.compare_code}'s trainer", "compared", plan[1][2], disagg,
                     args.compare_code))
    with ServerProcess(["--index-dir", os.path.join(world, "index_bm25")]) as server:
        runs = []
        for name, dirname, nproc, extra, code in plan:
            out = os.path.join(args.work_dir, dirname)
            subprocess.run(["rm", "-rf", out], check=True)
            runs.append(run(name, nproc, extra, world, model, server.url, out, args.steps, env(code)))
            print(f"{name}: done", flush=True)
    base = runs[0]["samples_per_s"]
    print("\n| run | steps timed | mean step (s) | samples/s | vs colocated |\n|---|---|---|---|---|")
    for r in runs:
        print(f"| {r['name']} | {r['steps']} | {r['step_s']:.2f} | {r['samples_per_s']:.3f} | "
              f"{r['samples_per_s'] / base:.2f}x |")
    for r in runs[1:]:
        print(f"{r['name']}: lags {r['lag']}, parts {r['parts']}, groups in flight {r['in_flight']} per timed step")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.exit(child())
    sys.exit(main())
