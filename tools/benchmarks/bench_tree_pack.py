# PYTHONPATH=$PWD python tools/benchmarks/bench_tree_pack.py            # ~2 min on 2 cores
"""Forward tokens per leaf of training on tree rollouts, each leaf its own sequence against a tree's leaves packed
into one row (megatron/tree_packing.py, rollout.tree.pack_forward), side by side in one run, at the CPU demo's
shape and at Search-R1's; with the measured wall time of the forward (Policy.log_probs: what the old-log-prob and
reference passes run) on a model of the demo's size.

The trees are bench_tree.py's: the trainer's own rollout/tree.py on its simulated engine (demo: prompt 50, turns ~24
tokens, observations ~200, 1-3 searches; Search-R1: prompt ~250, 3 searches, 500-token turns and observations), M
trees per prompt of 1 + L*N leaves. `tokens/leaf` counts what the model computes (padding left out of both arms).
`scores` counts attention score entries: per leaf, a causal kernel needs about L^2 / 2 per leaf of length L; packed,
the dense [S, S] mask of a row of length S is computed whole (S^2), which is what can make packing slower than the
token count says. The wall-time ratio is the answer for this machine (CPU, fp32, the local attention spec: PyTorch's
SDPA with a boolean mask); `--time-trees` limits the timed trees per shape (Search-R1's rows are long).
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time
from typing import Optional, Sequence

from megatron_searchr1.cli import ArgumentParser, at_least, run_main

HERE = os.path.dirname(os.path.abspath(__file__))


def _bench_tree():
    spec = importlib.util.spec_from_file_location("bench_tree", os.path.join(HERE, "bench_tree.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_tree"] = mod
    spec.loader.exec_module(mod)
    return mod


def grow(bt, shape, prompts: int, trees: int, rounds: int, samples: int, seed: int) -> list:
    """The leaves of prompts x trees trees (bench_tree.py's simulated engine and policy), tree by tree."""
    from megatron_searchr1.rollout.loop import LoopSettings, Trajectory
    from megatron_searchr1.rollout.tree import TreeSettings, grow_trees

    rows = bt._world(shape, prompts, seed)
    engine = bt.SimEngine(shape, 32, {tuple(ids): h for ids, h in rows}, 0.2)
    engine.prompt_lens = sorted({len(ids) for ids, _ in rows})
    budget = (shape.max_turns + 1) * (shape.turn + shape.obs) * 2 + shape.answer * 2
    s = LoopSettings(max_turns=shape.max_turns, max_tokens_per_turn=max(shape.turn, shape.answer) * 2,
                     max_response_length=budget, max_obs_length=shape.obs + 64, seed=seed)
    roots = [Trajectory(prompt_ids=list(ids), uid=str(q), sample=k) for q, (ids, _) in enumerate(rows)
             for k in range(trees)]
    out, _ = grow_trees(engine, bt.CharTokenizer(), bt._searcher(shape), roots, s,
                        TreeSettings(rounds, samples, "random"))
    return [t for tr in out for t in tr]


def counts(seqs, keys, budget: int) -> dict:
    from megatron_searchr1.megatron import tree_packing

    rows = tree_packing.plan_packs(seqs, keys, budget)
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in seqs]
    return {"leaves": len(seqs), "per_leaf": sum(lengths), "packed": sum(len(r.tokens) for r in rows),
            "scores_per_leaf": sum(n * (n + 1) // 2 for n in lengths),
            "scores_packed": sum(len(r.tokens) ** 2 for r in rows)}


def timed(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=at_least(1), default=8, help="questions per shape")
    p.add_argument("--trees", type=at_least(1), default=2, help="M: trees per prompt")
    p.add_argument("--rounds", type=at_least(0), default=1, help="L: expansion rounds")
    p.add_argument("--samples", type=at_least(1), default=3,
                   help="N: forks per tree per round (leaves per tree: 1 + L*N)")
    p.add_argument("--shapes", default="demo,search-r1", help="comma-separated: demo, search-r1")
    p.add_argument("--time-trees", type=at_least(0), default=4, help="trees per shape whose forward is timed (0: none)")
    p.add_argument("--max-tokens", type=at_least(1), default=16384, help="max_tokens_per_micro_batch of both arms")
    p.add_argument("--layers", type=at_least(1), default=4,
                   help="layers of the timed model (the demo's sizes otherwise)")
    p.add_argument("--repeats", type=at_least(1), default=3, help="timed repeats (the fastest counts)")
    p.add_argument("--seed", type=int, default=1, help="world and sampling seed")
    a = p.parse_args(argv)
    bt = _bench_tree()
    names = [x for x in a.shapes.split(",") if x]
    bad = [x for x in names if x not in bt.SHAPES]
    if bad:
        p.error(f"--shapes: unknown {', '.join(bad)} (choose from {', '.join(bt.SHAPES)})")

    import torch

    from megatron_searchr1.trainer import losses

    model = None
    if a.time_trees:
        from transformers import Qwen2Config

        from megatron_searchr1.demo_sizes import MODEL_ARGS
        from megatron_searchr1.megatron.initialize import initialize_megatron
        from megatron_searchr1.models.gpt import build_gpt_model
        from megatron_searchr1.trainer.roles import Policy

        initialize_megatron(tp=1, pp=1)
        torch.manual_seed(0)
        m = MODEL_ARGS
        cfg = Qwen2Config(vocab_size=m["vocab_size"], hidden_size=m["hidden_size"],
                          intermediate_size=m["intermediate_size"], num_hidden_layers=a.layers,
                          num_attention_heads=m["num_heads"], num_key_value_heads=m["num_kv_heads"],
                          tie_word_embeddings=m["tie_embeddings"], max_position_embeddings=32768)
        model = Policy(build_gpt_model(cfg).eval())

    per_tree = 1 + a.rounds * a.samples
    print(f"{a.prompts} prompts x {a.trees} trees x {per_tree} leaves (L={a.rounds}, N={a.samples}); timed: "
          f"{a.time_trees} trees per shape, {a.layers}-layer model of the demo's width, fp32, "
          f"{torch.get_num_threads()} threads")
    print(f"{'shape':<10} {'leaves':>6} {'tokens/leaf':>11} {'packed':>7} {'ratio':>6} {'scores ratio':>12} "
          f"{'timed':>5} {'forward s':>9} {'packed s':>8} {'ratio':>6} {'max diff':>8}")
    for name in names:
        leaves = grow(bt, bt.SHAPES[name], a.prompts, a.trees, a.rounds, a.samples, a.seed)
        seqs = losses.to_sequences(leaves)
        keys = [t.meta["tree"].tree for t in leaves]
        c = counts(seqs, keys, a.max_tokens)
        n = c["leaves"]
        line = (f"{name:<10} {n:>6} {c['per_leaf'] / n:>11.0f} {c['packed'] / n:>7.0f} "
                f"{c['packed'] / c['per_leaf']:>5.3f}x {c['scores_packed'] / c['scores_per_leaf']:>11.2f}x")
        if model is not None:
            picked = sorted(set(keys), key=keys.index)[: a.time_trees]
            idx = [i for i, k in enumerate(keys) if k in picked]
            sub, sub_keys = [seqs[i] for i in idx], [keys[i] for i in idx]
            ref = model.log_probs(sub, a.max_tokens)  # also warms up
            packed = model.log_probs(sub, a.max_tokens, pack_keys=sub_keys)
            diff = max(float((x - y).abs().max()) for x, y in zip(ref, packed))
            t_leaf = timed(lambda: model.log_probs(sub, a.max_tokens), a.repeats)
            t_pack = timed(lambda: model.log_probs(sub, a.max_tokens, pack_keys=sub_keys), a.repeats)
            line += f" {len(picked):>5} {t_leaf:>9.3f} {t_pack:>8.3f} {t_pack / t_leaf:>5.2f}x {diff:>8.1e}"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
