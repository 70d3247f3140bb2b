# PYTHONPATH=$PWD OMP_NUM_THREADS=2 python tools/benchmarks/bench_rollout_seeds.py --work-dir /tmp/bench_seeds
# (~1-2 min on 2 cores; --prompts 256 --max-tokens 64 --rounds 6 for a bigger batch)
"""vLLM's sampling with a seed per request vs one seeded random stream per generate() call, side by side.

One vLLM engine (`make_engine("vllm", ...)`, a tiny random Qwen2 model, float32) runs the same generate() workload
(`--prompts` distinct prompts, `--max-tokens` tokens each, temperature 1, no stop: every request decodes to the
limit) in both seeding modes, alternating A B, B A, ... for `--rounds` rounds on the same engine, so a drift of the
machine's speed hits both alike:
  (a) `seed_per_request=True`: each request carries its own seed, and vLLM's sampler draws each request's noise
      from its own generator, one call per request at every decode step;
  (b) the default: no request has a seed; the engine seeds the global RNG once per call and vLLM draws the noise
      of the whole batch in one call.
Printed for each: milliseconds per decode step (vLLM's engine step, timed around `llm_engine.step`; each call's
first step, the prefill, left out) and per sampler call (`Sampler.sample`), min / median / max over every step of
every round, and the ratio (a) / (b) of the medians, per round and overall. The sampler row isolates the part that
differs; the step row is what a rollout feels. The per-request path exists in vLLM's V1 model runner (the CPU
backend, measured here: a small random draw per request per step; on a GPU under V1, a kernel launch each). vLLM
0.32's Model Runner V2, its default on GPUs, samples seeded and unseeded requests in one kernel, so there the two
modes should cost the same.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Optional, Sequence

from megatron_searchr1.cli import ArgumentParser, UsageError, run_main


def parse_args(argv: Optional[Sequence[str]]):
    p = ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--work-dir", default="/tmp/bench_rollout_seeds", help="where the tiny model is written")
    p.add_argument("--prompts", type=int, default=128, help="requests per generate() call")
    p.add_argument("--prompt-len", type=int, default=16, help="tokens per prompt")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens decoded per request")
    p.add_argument("--rounds", type=int, default=4, help="A/B pairs")
    p.add_argument("--hidden", type=int, default=128, help="tiny model width (smaller: the sampler's share grows)")
    args = p.parse_args(argv)
    for name in ("prompts", "prompt_len", "max_tokens", "rounds"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_tokens < 3:
        raise UsageError("--max-tokens must be >= 3 (the first step is the prefill)")
    return args


def summary(ms: list[float]) -> str:
    return f"{min(ms):7.2f} {statistics.median(ms):7.2f} {max(ms):7.2f}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from vllm.v1.sample.sampler import Sampler

    from megatron_searchr1.models.tiny import TinyModelConfig, make_tiny_model
    from megatron_searchr1.rollout.engine import SamplingParams
    from megatron_searchr1.rollout.engines import make_engine

    model_dir = os.path.join(args.work_dir, f"tiny_h{args.hidden}")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        make_tiny_model(TinyModelConfig(output_dir=model_dir, hidden_size=args.hidden,
                                        intermediate_size=2 * args.hidden, init_std=0.1))
    engine = make_engine("vllm", model_dir, dtype="float32", kv_cache_gib=0.5, kv_sessions=False,
                         max_model_len=args.prompt_len + args.max_tokens + 8,
                         max_num_seqs=max(args.prompts, 8))
    gen = torch.Generator().manual_seed(0)
    vocab = engine.llm.get_tokenizer().vocab_size
    prompts = [torch.randint(5, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=1234)

    steps: list[float] = []
    sampler: list[float] = []
    llm_engine = engine.llm.llm_engine
    step = llm_engine.step

    def timed_step(*a, **kw):
        t = time.perf_counter()
        out = step(*a, **kw)
        steps.append(time.perf_counter() - t)
        return out

    sample = Sampler.sample

    def timed_sample(self, *a, **kw):
        t = time.perf_counter()
        out = sample(self, *a, **kw)
        sampler.append(time.perf_counter() - t)
        return out

    llm_engine.step = timed_step
    Sampler.sample = timed_sample

    def run(per_request: bool) -> tuple[list[float], list[float]]:
        engine.seed_per_request = per_request
        steps.clear()
        sampler.clear()
        outs = engine.generate(prompts, params)
        assert all(len(g.token_ids) == args.max_tokens for g in outs)
        return [1e3 * s for s in steps[1:]], [1e3 * s for s in sampler[1:]]  # the first: the prefill

    names = {True: "seed per request", False: "one stream per call"}
    run(True), run(False)  # warm-up, not counted
    got: dict[bool, tuple[list, list]] = {True: ([], []), False: ([], [])}
    rounds = []
    for r in range(args.rounds):
        med = {}
        for per_request in ((True, False) if r % 2 == 0 else (False, True)):
            st, sa = run(per_request)
            got[per_request][0].extend(st)
            got[per_request][1].extend(sa)
            med[per_request] = (statistics.median(st), statistics.median(sa))
        rounds.append((med[True][0] / med[False][0], med[True][1] / med[False][1]))
    llm_engine.step = step
    Sampler.sample = sample
    engine.close()

    print(f"{args.prompts} requests x {args.max_tokens} tokens, prompt {args.prompt_len} tokens, tiny Qwen2 "
          f"hidden {args.hidden}, vocab {vocab}, float32, {args.rounds} rounds (A B / B A), torch threads "
          f"{torch.get_num_threads()}")
    print(f"{'':22} {'decode step ms (min med max)':>30} {'sampler ms (min med max)':>28}")
    for per_request in (True, False):
        st, sa = got[per_request]
        print(f"{names[per_request]:22} {summary(st):>30} {summary(sa):>28}")
    step_ratio = statistics.median(got[True][0]) / statistics.median(got[False][0])
    sample_ratio = statistics.median(got[True][1]) / statistics.median(got[False][1])
    print(f"per round, seed per request / one stream: step {', '.join(f'{a:.3f}' for a, _ in rounds)}; "
          f"sampler {', '.join(f'{b:.3f}' for _, b in rounds)}")
    print(f"ratio of the medians, seed per request / one stream: decode step {step_ratio:.3f}x, "
          f"sampler {sample_ratio:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
