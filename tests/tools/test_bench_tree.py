"""tools/benchmarks/bench_tree.py's simulated engine counts what vLLM would compute (a session's new tokens; a new
request's context in whole prefix-cache blocks), checked by hand, and the benchmark's run at a small size."""
from __future__ import annotations

import importlib.util
import sys

from megatron_searchr1.rollout.engine import SamplingParams
from tests.dist_utils import REPO


def _bench():
    spec = importlib.util.spec_from_file_location("bench_tree", REPO / "tools" / "benchmarks" / "bench_tree.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_tree"] = mod
    spec.loader.exec_module(mod)
    return mod


bench = _bench()
P = SamplingParams(max_tokens=200, stop=("</search>", "</answer>"))


def _engine(prompt):
    shape = bench.Shape("t", len(prompt), 40, 100, 20, (2,), 4)
    e = bench.SimEngine(shape, block=32, hops={tuple(prompt): 2}, stop_early=0.0)
    e.prompt_lens = [len(prompt)]
    return e


def test_sessions_compute_only_new_tokens_and_a_fork_reuses_whole_blocks():
    prompt = list(range(1000, 1050))  # 50 tokens
    e = _engine(prompt)
    (g,) = e.generate([prompt], P, sessions=["a"])
    assert g.num_cached_tokens == 0 and e.prefill == 50 and e.decode == len(g.token_ids)
    ctx = prompt + g.token_ids + list(range(2000, 2100))  # + an observation
    (g2,) = e.generate([ctx], P, sessions=["a"])
    # the session held prompt + turn; vLLM had not computed the turn's last token
    assert g2.num_cached_tokens == 50 + len(g.token_ids) - 1
    assert e.prefill == 50 + 1 + 100
    # a fork at the node `ctx` (a new session): the prefix cache serves its full 32-token blocks, not the tail
    before = e.prefill
    (g3,) = e.generate([ctx], P, sessions=["b"])
    assert g3.num_cached_tokens == (len(ctx) - 1) // 32 * 32
    assert e.prefill - before == len(ctx) - g3.num_cached_tokens < 32 + 1
    # a second chain of the prompt is served the prompt's one full block; the benchmark adds it back
    (g4,) = e.generate([prompt], P, sessions=["c"])
    assert g4.num_cached_tokens == 32 and e.prompt_hits == 32


def test_the_benchmark_runs_both_shapes_and_trees_compute_less_per_leaf(capsys):
    rc = bench.main(["--prompts", "2"])
    out = capsys.readouterr().out
    rows = {tuple(line.split()[:2]): line.split() for line in out.splitlines() if line.startswith(("demo", "search"))}
    assert set(rows) == {("demo", "chains"), ("demo", "trees"), ("search-r1", "chains"), ("search-r1", "trees")}
    ratio = {k: float(v[9].rstrip("x")) for k, v in rows.items()}
    # chains with KV sessions cost their lower bound (+1 token per turn); trees less than chains
    assert 1.0 <= ratio[("demo", "chains")] < 1.02 and ratio[("demo", "trees")] < 0.9
    assert ratio[("search-r1", "trees")] < ratio[("search-r1", "chains")]
    assert rc in (0, 1) and ("met" in out or "MISSED" in out)
