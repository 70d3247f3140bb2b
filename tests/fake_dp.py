"""Data parallelism without processes: run one function per fake DP rank in threads whose `reduce` sums in lock step.

    outs = run_ranks([lambda reduce: f(shard0, reduce), lambda reduce: f(shard1, reduce)])

Each `reduce(t)` call waits for every rank's call of the same number and returns the sum of their tensors (what
an all-reduce over the DP group gives), so code that takes an `algo.Reduce` can be checked against one process
holding the whole batch, and a rank that skips a call shows up as a timeout instead of a silent pass.
"""
from __future__ import annotations

import threading


def run_ranks(fns, timeout: float = 30.0) -> list:
    n = len(fns)
    barrier = threading.Barrier(n, timeout=timeout)
    box: dict = {}
    outs: list = [None] * n
    errors: list = []

    def make_reduce(rank):
        calls = [0]

        def reduce(t):
            box[rank, calls[0]] = t.clone()
            barrier.wait()
            total = sum(box[q, calls[0]] for q in range(n))
            barrier.wait()
            calls[0] += 1
            return total

        return reduce

    def run(rank):
        try:
            outs[rank] = fns[rank](make_reduce(rank))
        except BaseException as e:  # noqa: BLE001 - reported in the caller's thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return outs
