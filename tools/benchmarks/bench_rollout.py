# PYTHONPATH=$PWD OMP_NUM_THREADS=2 python tools/benchmarks/bench_rollout.py --work-dir /tmp/bench_rollout
# (first run ~2-3 min on 2 cores: world + tokenizer + a short fit of the tiny model, cached in --work-dir;
#  later runs ~1 min. --prompts 32 --max-tokens-per-turn 500 for a bigger run; --block-size to vary vLLM's KV block
#  (the CPU backend takes multiples of 32; the engine's default is 32); --no-kv-sessions for the loop without KV sessions)
"""Tokens computed per trajectory by our rollout loop, by a Search-R1-style loop and the lower bound, side by side.

The same prompts go through the same vLLM engine (`make_engine("vllm", ...)`, float32, greedy) twice:
  (a) ours: `rollout/loop.py:run_rollout` as the trainer runs it: stop strings at `</search>` / `</answer>`, token
      ids kept as generated, each trajectory one KV session (its KV cache stays in vLLM between turns; prefix
      caching alone, `--no-kv-sessions`, recomputes the last partial KV block every turn). Computed = context tokens
      the engine did not hold or serve from its prefix cache (`Generation.num_cached_tokens`) + decoded tokens,
      checked against what vLLM's scheduler actually ran. Prefix hits on a trajectory's FIRST turn can only
      come from other trajectories (the shared instruction): they are added back (`ours`), so the ratio measures
      what one trajectory costs alone; `ours (engine)` is the engine's raw count with that sharing.
  (b) Search-R1-style: the same state machine (`run_rollout`: same actions, observations, invalid-action text,
      final turn, budgets) on an engine adapter that generates the way Search-R1 does: no stop strings, every turn
      decodes until eos or the per-turn limit, then the turn is cut after its first `</search>` / `</answer>`;
      the decoded tokens past that tag are waste. Every turn re-prefills the whole context with no prefix-cache
      credit (Search-R1 hands the full context to generate each turn and counts on nothing being reused).
      Kinder than Search-R1 in one way: the cut keeps token ids (Search-R1 decodes, cuts text and re-tokenizes).
  (c) lower bound: every token of the final trajectory computed once (prompt + generated + observations).
Targets: ours <= 1.05 x the lower bound; 0 tokens decoded past a stop tag by ours. Exit 1 if one is missed.

The policy. A random tiny model almost never writes `</search>`, so there would be no second turn to measure. We
fit the tiny model (plain PyTorch, a few hundred steps, loss on the assistant's tokens only) on a handful of the
synthetic world's gold trajectories (`sft/train.jsonl`) and ask it exactly those questions, with the same BM25
index served by a real retrieval server (`ServerProcess`), so it replays the gold turns: think, search, read,
search again, answer. The questions are in the training set on purpose: the benchmark measures compute per
trajectory, not accuracy; a memorised policy gives multi-turn trajectories of realistic shape on the REAL engine
(its prefix cache, its stop-string handling), which a scripted-logits `hf` engine could not show. The fitted
model is cached in --work-dir. After `</search>` a model trained this way goes on to write an `<information>`
block of its own, as real models do: that is the text Search-R1 decodes and throws away.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

from megatron_searchr1.cli import ArgumentParser, UsageError, run_main

TARGET_RATIO = 1.05


# ----------------------------------------------------------------------------------------------------------------
# Counting (pure: tested in tests/tools/test_bench_rollout.py with a scripted engine)
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Counts:
    """Token accounting of one loop over a whole rollout."""

    requests: int = 0
    """Prompts sent to the engine (one per active sample per turn)."""
    prompt_tokens: int = 0
    """Context tokens sent with those prompts."""
    prefill: int = 0
    """Context tokens computed (not served from a prefix cache, or not credited as served)."""
    first_turn_cached: int = 0
    """Prefix-cache hits on a trajectory's first turn (only other trajectories can supply them)."""
    decoded: int = 0
    """Tokens the engine decoded."""
    past_stop: int = 0
    """Decoded tokens after the first stop tag of their turn: computed, then thrown away."""
    per_request: list = field(default_factory=list)
    """(context tokens, prefill, decoded, past_stop) per request, in order."""

    @property
    def computed(self) -> int:
        return self.prefill + self.decoded


def stop_cut(tokenizer, ids: Sequence[int], stops: Sequence[str]) -> Optional[int]:
    """Number of leading ids whose text first contains a stop tag (the turn up to and including the tag); None if none.

    Binary search over prefixes: `decode(ids[:k])` contains a tag for every k past the first one that does.
    """
    if not stops or not any(s in tokenizer.decode(list(ids), skip_special_tokens=False) for s in stops):
        return None
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in tokenizer.decode(list(ids[:mid]), skip_special_tokens=False) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    return lo


class MeteredEngine:
    """Our loop's engine, counted: prefill = context - the engine's `num_cached_tokens`; past_stop checked, not assumed."""

    def __init__(self, engine, tokenizer, first_prompts: Sequence[Sequence[int]]):
        self.engine, self.tok = engine, tokenizer
        self.first_prompts = {tuple(p) for p in first_prompts}
        self.counts = Counts()

    def generate(self, prompts, params, **sessions):
        from megatron_searchr1.data.prompts import STOP_STRINGS

        outs = self.engine.generate(prompts, params, **sessions)
        c = self.counts
        for p, g in zip(prompts, outs):
            cut = stop_cut(self.tok, g.token_ids, STOP_STRINGS)
            past = 0 if cut is None else len(g.token_ids) - cut
            prefill = len(p) - g.num_cached_tokens
            c.requests += 1
            c.prompt_tokens += len(p)
            c.prefill += prefill
            c.decoded += len(g.token_ids)
            c.past_stop += past
            if tuple(p) in self.first_prompts:
                c.first_turn_cached += g.num_cached_tokens
            c.per_request.append((len(p), prefill, len(g.token_ids), past))
        return outs

    def __getattr__(self, name):  # load_weights, sleep, ...: the wrapped engine's
        return getattr(self.engine, name)


class SearchR1StyleEngine:
    """Generates a turn the way Search-R1 does, so `run_rollout` over it is a Search-R1-style loop.

    The caller's stop strings are dropped (Search-R1 sets none; eos still ends a sample), the turn decodes to eos or
    `max_tokens`, and what the loop gets back is cut after the first stop tag, as Search-R1 cuts its responses.
    Counted: the whole context as prefill on every turn (no prefix-cache credit), every decoded token, and the
    decoded tokens past the tag (`past_stop`).
    """

    keeps_sessions = False  # a new request with the whole context every turn

    def __init__(self, engine, tokenizer):
        self.engine, self.tok = engine, tokenizer
        self.counts = Counts()

    def generate(self, prompts, params):
        from megatron_searchr1.rollout.engine import Generation

        outs = self.engine.generate(prompts, replace(params, stop=()))
        cut_outs = []
        c = self.counts
        for p, g in zip(prompts, outs):
            cut = stop_cut(self.tok, g.token_ids, params.stop)
            keep = len(g.token_ids) if cut is None else cut
            c.requests += 1
            c.prompt_tokens += len(p)
            c.prefill += len(p)
            c.decoded += len(g.token_ids)
            c.past_stop += len(g.token_ids) - keep
            c.per_request.append((len(p), len(p), len(g.token_ids), len(g.token_ids) - keep))
            if cut is None:
                cut_outs.append(g)
            else:
                text = self.tok.decode(g.token_ids[:cut], skip_special_tokens=False)
                tag = min(params.stop, key=lambda s: text.find(s) if s in text else len(text) + 1)
                cut_outs.append(Generation(token_ids=g.token_ids[:cut], logprobs=g.logprobs[:cut],
                                           finish_reason="stop", stop_reason=tag))
        return cut_outs

    def __getattr__(self, name):
        return getattr(self.engine, name)


def lower_bound(trajs) -> int:
    """Every token of every final trajectory computed once: prompt + response (generated + observations)."""
    return sum(len(t.prompt_ids) + len(t.response_ids) for t in trajs)


# ----------------------------------------------------------------------------------------------------------------
# Setup: world, tokenizer + tiny model fitted on gold trajectories, retrieval server
# ----------------------------------------------------------------------------------------------------------------
def sft_example(tok, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of one gold trajectory, tokenized segment by segment as the rollout builds it."""
    from megatron_searchr1.data.prompts import render_prompt

    ids = tok.encode(render_prompt(messages[:1], tok), add_special_tokens=False)
    mask = [0] * len(ids)
    for m in messages[1:]:
        seg = tok.encode(m["content"], add_special_tokens=False)
        ids += seg
        mask += [1 if m["role"] == "assistant" else 0] * len(seg)
    ids.append(tok.eos_token_id)  # the model ends its last turn (Search-R1-style decoding then stops at eos too)
    mask.append(1)
    return ids, mask


def fit_policy(model_dir: str, examples: list[tuple[list[int], list[int]]], steps: int, seed: int, log=print) -> dict:
    """A few hundred AdamW steps on the examples (loss on mask-1 tokens), saved in place; returns the losses."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / steps))
    pad = max(len(ids) for ids, _ in examples)
    x = torch.zeros(len(examples), pad, dtype=torch.long)
    y = torch.full((len(examples), pad), -100, dtype=torch.long)
    for i, (ids, mask) in enumerate(examples):
        x[i, :len(ids)] = torch.tensor(ids)
        lab = torch.tensor([t if m else -100 for t, m in zip(ids, mask)])
        y[i, :len(ids) - 1] = lab[1:]  # position j predicts token j+1
    attn = (torch.arange(pad)[None, :] < torch.tensor([len(i) for i, _ in examples])[:, None]).long()
    losses = []
    batch = min(4, len(examples))
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        idx = torch.randperm(len(examples), generator=g)[:batch]
        logits = model(input_ids=x[idx], attention_mask=attn[idx]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y[idx].flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if (step + 1) % 25 == 0:
            log(f"fit step {step + 1}/{steps}: loss {sum(losses[-10:]) / 10:.3f}")
    model.save_pretrained(model_dir)
    return {"first_loss": losses[0], "last_loss": sum(losses[-10:]) / len(losses[-10:])}


def prepare(a, log) -> tuple[str, str, list[list[dict]]]:
    """World, tokenizer and fitted model in --work-dir (reused when present); returns (model_dir, index_dir, gold)."""
    world = os.path.join(a.work_dir, "world")
    index_dir = os.path.join(world, "index_bm25")
    sft = os.path.join(world, "sft", "train.jsonl")
    if not os.path.isfile(sft):
        import subprocess

        t0 = time.perf_counter()
        cmd = [sys.executable, os.path.join(os.path.dirname(__file__), "..", "make_synthetic_world.py"),
               "--out-dir", world, "--seed", str(a.seed), "--oracle", "bm25", "--n-train", "400",
               "--n-validation", "20", "--n-test", "20"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        log(f"world: {world} ({time.perf_counter() - t0:.1f}s)")
    with open(sft) as f:
        rows = [json.loads(line)["messages"] for line in f]
    # Multi-turn trajectories first (2+ searches), then fill with the rest, in file order (deterministic).
    n_search = [sum(m["role"] == "observation" for m in msgs) for msgs in rows]
    order = sorted(range(len(rows)), key=lambda i: (-min(n_search[i], 3), i))
    gold = [rows[i] for i in order[:a.prompts]]

    tag = f"h{a.hidden_size}_l{a.num_layers}_n{a.prompts}_s{a.fit_steps}_seed{a.seed}"
    model_dir = os.path.join(a.work_dir, f"policy_{tag}")
    if not os.path.isfile(os.path.join(model_dir, "fitted.json")):
        from transformers import AutoTokenizer

        from megatron_searchr1.models.tiny import TinyModelConfig, make_tiny_model

        t0 = time.perf_counter()
        text = os.path.join(a.work_dir, "tokenizer_text.txt")
        with open(text, "w") as f:
            for msgs in rows:
                for m in msgs:
                    f.write(m["content"].replace("\n", " ") + "\n")
        make_tiny_model(TinyModelConfig(output_dir=model_dir, text_files=[text], vocab_size=2000,
                                        hidden_size=a.hidden_size, intermediate_size=2 * a.hidden_size,
                                        num_layers=a.num_layers, num_heads=a.hidden_size // 32, num_kv_heads=a.hidden_size // 32,
                                        max_position_embeddings=8192, seed=a.seed))
        tok = AutoTokenizer.from_pretrained(model_dir)
        examples = [sft_example(tok, msgs) for msgs in gold]
        log(f"policy: fitting on {len(examples)} gold trajectories of {sum(len(i) for i, _ in examples) / len(examples):.0f} tokens")
        info = fit_policy(model_dir, examples, a.fit_steps, a.seed, log)
        info["seconds"] = round(time.perf_counter() - t0, 1)
        with open(os.path.join(model_dir, "fitted.json"), "w") as f:
            json.dump(info, f)
        log(f"policy: fitted {model_dir} in {info['seconds']}s (loss {info['first_loss']:.2f} -> {info['last_loss']:.3f})")
    return model_dir, index_dir, gold


# ----------------------------------------------------------------------------------------------------------------
# The benchmark
# ----------------------------------------------------------------------------------------------------------------
def _row(name: str, c: Optional[Counts], n: int, lb: int, computed: Optional[int] = None, calls: str = "",
         secs: str = "") -> str:
    if c is None:
        return (f"{name:<22}{'':>9}{'':>9}{lb / n:>10.1f}{1.0:>8.3f}{'-':>12}{'':>10}{'':>8}")
    comp = c.computed if computed is None else computed
    pref = comp - c.decoded
    return (f"{name:<22}{pref / n:>9.1f}{c.decoded / n:>9.1f}{comp / n:>10.1f}{comp / lb:>8.3f}{c.past_stop / n:>12.1f}"
            f"{calls:>10}{secs:>8}")


class ScheduledTokens:
    """What vLLM's scheduler actually ran: the sum of `total_num_scheduled_tokens` over its steps (in-process engine).

    The loop's count of a request (context not cached + tokens decoded) is this plus one: a request's last sampled
    token is decoded but computed only as part of the next turn's input, where the loop counts it again."""

    def __init__(self, engine):
        self.scheduler = engine.llm.llm_engine.engine_core.engine_core.scheduler
        self.original = self.scheduler.schedule
        self.total = 0

        def counted(*args, **kwargs):
            out = self.original(*args, **kwargs)
            self.total += out.total_num_scheduled_tokens
            return out

        self.scheduler.schedule = counted

    def close(self):
        self.scheduler.schedule = self.original


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", default="/tmp/bench_rollout", help="world, tokenizer and fitted policy (reused)")
    p.add_argument("--prompts", type=int, default=16, help="questions (the policy is fitted on exactly these)")
    p.add_argument("--max-turns", type=int, default=4, help="search turns before the final answer turn")
    p.add_argument("--max-tokens-per-turn", type=int, default=256,
                   help="per-turn decode limit (Search-R1's default is 500; what its loop decodes to)")
    p.add_argument("--max-obs-length", type=int, default=500, help="tokens of one observation at most")
    p.add_argument("--topk", type=int, default=3, help="passages per search")
    p.add_argument("--hidden-size", type=int, default=128, help="tiny model width (head_dim 32: width/32 heads)")
    p.add_argument("--num-layers", type=int, default=2, help="tiny model layers")
    p.add_argument("--fit-steps", type=int, default=150, help="optimizer steps fitting the policy to the gold turns")
    p.add_argument("--block-size", type=int, default=0, help="vLLM KV block size (0: the engine's default)")
    p.add_argument("--no-kv-sessions", action="store_true",
                   help="ours without KV sessions: a new request every turn, reusing the prefix cache only")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.prompts < 1 or a.max_turns < 1 or a.max_tokens_per_turn < 8 or a.topk < 1 or a.fit_steps < 1:
        raise UsageError("--prompts >= 1, --max-turns >= 1, --max-tokens-per-turn >= 8, --topk >= 1, --fit-steps >= 1")
    if a.hidden_size < 32 or a.hidden_size % 32 or a.num_layers < 1:
        raise UsageError(f"--hidden-size must be a multiple of 32 (vLLM's CPU attention needs head_dim 32), "
                         f"got {a.hidden_size}; --num-layers >= 1")
    if a.block_size < 0:
        raise UsageError(f"--block-size must be >= 0 (0: the engine's default), got {a.block_size}")
    if os.path.exists(a.work_dir) and not os.path.isdir(a.work_dir):
        raise UsageError(f"--work-dir {a.work_dir!r} is a file: pass a directory")
    os.makedirs(a.work_dir, exist_ok=True)

    def log(msg):
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    t_start = time.perf_counter()
    model_dir, index_dir, gold = prepare(a, log)

    from transformers import AutoTokenizer

    from megatron_searchr1.data.prompts import render_prompt
    from megatron_searchr1.rollout.engine import SamplingParams
    from megatron_searchr1.rollout.engines import make_engine
    from megatron_searchr1.rollout.loop import LoopSettings, Trajectory, run_rollout
    from megatron_searchr1.search.client import RetrievalClient
    from megatron_searchr1.search.launch import ServerProcess

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok.encode(render_prompt(msgs[:1], tok), add_special_tokens=False) for msgs in gold]
    settings = LoopSettings(max_turns=a.max_turns, max_tokens_per_turn=a.max_tokens_per_turn,
                            max_response_length=(a.max_turns + 1) * (a.max_tokens_per_turn + a.max_obs_length),
                            max_obs_length=a.max_obs_length, temperature=0.0, stop_token_ids=(tok.eos_token_id,),
                            seed=a.seed)
    max_len = max(map(len, prompts)) + settings.max_response_length + 8
    kw = {"block_size": a.block_size} if a.block_size else {}
    with ServerProcess(["--index-dir", index_dir]) as server:
        log(f"retrieval server: {server.url} ({index_dir})")
        client = RetrievalClient(server.url, topk=a.topk)
        t0 = time.perf_counter()
        engine = make_engine("vllm", model_dir, dtype="float32", kv_cache_gib=1, max_model_len=max_len, seed=a.seed,
                             kv_sessions=not a.no_kv_sessions, **kw)
        block = engine.llm.llm_engine.vllm_config.cache_config.block_size
        log(f"vLLM engine up ({time.perf_counter() - t0:.1f}s; KV block {block} tokens; KV sessions "
            f"{'on' if engine.keeps_sessions else 'off'})")
        engine.generate([prompts[0]], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up, out of the timings
        scheduled = ScheduledTokens(engine)

        runs, ran = {}, {}
        for name, wrap in (("searchr1", lambda e: SearchR1StyleEngine(e, tok)),
                           ("ours", lambda e: MeteredEngine(e, tok, prompts))):
            engine.finish_weight_sync()  # empty prefix cache: neither run inherits the other's KV blocks
            metered = wrap(engine)
            trajs = [Trajectory(prompt_ids=list(ids), uid=str(i)) for i, ids in enumerate(prompts)]
            t0 = time.perf_counter()
            ran_before = scheduled.total
            stats = run_rollout(metered, tok, client.search, trajs, settings)
            runs[name] = (metered.counts, trajs, stats, time.perf_counter() - t0)
            ran[name] = scheduled.total - ran_before
            log(f"{name}: {stats.turns} generate calls, finish {dict(stats.finish)}, {runs[name][3]:.1f}s")
        scheduled.close()
        client.close()

    ours, ours_trajs, ours_stats, ours_s = runs["ours"]
    sr1, sr1_trajs, sr1_stats, sr1_s = runs["searchr1"]
    n = len(prompts)
    lb = lower_bound(ours_trajs)
    lb_sr1 = lower_bound(sr1_trajs)
    same = sum(x.response_ids == y.response_ids for x, y in zip(ours_trajs, sr1_trajs))
    assert ours_stats.prefill_tokens + ours_stats.generated_tokens == ours.computed, "loop and meter disagree"
    ours_alone = ours.computed + ours.first_turn_cached

    print()
    print(f"{n} trajectories, per-turn limit {a.max_tokens_per_turn}, vLLM KV block {block}; "
          f"searches/trajectory {sum(t.n_searches for t in ours_trajs) / n:.2f}, "
          f"turns {sum(t.turns for t in ours_trajs) / n:.2f}, prompt {sum(map(len, prompts)) / n:.1f} tokens, "
          f"response {sum(len(t.response_ids) for t in ours_trajs) / n:.1f} tokens; "
          f"identical trajectories in (a) and (b): {same}/{n}")
    print("tokens per trajectory")
    print(f"{'':<22}{'prefill':>9}{'decode':>9}{'computed':>10}{'x LB':>8}{'past stop':>12}{'requests':>10}{'wall s':>8}")
    print(_row("(a) ours", ours, n, lb, ours_alone, str(ours.requests), f"{ours_s:.1f}"))
    print(_row("    ours (engine)", ours, n, lb, None, "", ""))
    print(_row("(b) Search-R1-style", sr1, n, lb_sr1, None, str(sr1.requests), f"{sr1_s:.1f}"))
    print(_row("(c) lower bound", None, n, lb))
    print(f"Search-R1-style / ours: {sr1.computed / ours_alone:.2f}x computed; Search-R1-style decoded "
          f"{sr1.past_stop / max(sr1.decoded, 1):.0%} of its tokens past a stop tag")
    print(f"vLLM's scheduler ran {ran['ours'] / n:.1f} tokens per trajectory for (a) (+1 per request = "
          f"{(ran['ours'] + ours.requests) / n:.1f}, the count of 'ours (engine)')")

    checks = [
        (f"ours <= {TARGET_RATIO:.2f}x lower bound", ours_alone / lb <= TARGET_RATIO, f"{ours_alone / lb:.3f}x"),
        ("ours decodes 0 tokens past a stop tag", ours.past_stop == 0, f"{ours.past_stop} tokens"),
        ("ours' count = what vLLM's scheduler ran + 1 per request", ours.computed == ran["ours"] + ours.requests,
         f"{ours.computed} = {ran['ours']} + {ours.requests}"),
        ("multi-turn trajectories (>= 1 search/trajectory)", sum(t.n_searches for t in ours_trajs) >= n,
         f"{sum(t.n_searches for t in ours_trajs) / n:.2f}"),
    ]
    for what, ok, value in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {what}: {value}")
    log("done")
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(run_main(main))
