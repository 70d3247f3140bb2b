"""tools/benchmarks/bench_tree_pack.py: its counts on hand-built leaves, and a small run of the token columns (the
timed forward's exactness and speed are tests/megatron/test_tree_packing.py's and the benchmark's own)."""
from __future__ import annotations

import importlib.util
import sys

from megatron_searchr1.megatron.batching import TrainSequence
from tests.dist_utils import REPO


def _bench():
    spec = importlib.util.spec_from_file_location("bench_tree_pack",
                                                  REPO / "tools" / "benchmarks" / "bench_tree_pack.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_tree_pack"] = mod
    spec.loader.exec_module(mod)
    return mod


bench = _bench()


def _seq(prompt, response):
    import torch

    return TrainSequence(prompt_ids=prompt, response_ids=response, loss_mask=torch.ones(len(response)))


def test_counts_by_hand():
    # tree t: [1 2 | 3 4 5] and [1 2 | 3 6]: 5 + 1 packed tokens of 9; tree u alone: 3 of 3
    seqs = [_seq([1, 2], [3, 4, 5]), _seq([1, 2], [3, 6]), _seq([7], [8, 9])]
    c = bench.counts(seqs, ["t", "t", "u"], 64)
    assert c == {"leaves": 3, "per_leaf": 12, "packed": 9, "scores_per_leaf": 15 + 10 + 6,
                 "scores_packed": 36 + 9}


def test_a_small_run_prints_fewer_packed_tokens_per_leaf(capsys):
    assert bench.main(["--prompts", "2", "--shapes", "demo", "--time-trees", "0"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("demo"))
    leaves, per_leaf, packed = (float(x) for x in row.split()[1:4])
    assert leaves == 16 and 0 < packed < per_leaf
