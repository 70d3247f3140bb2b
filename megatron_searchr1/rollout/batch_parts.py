"""One batch from K rollout ranks: who generates which prompts, and how trainer rank 0 puts the parts together.

    share(n=5, part=1, parts=2)                      # range(2, 5): rollout rank 2 of 2 takes prompts 2..4
    contributors(n=1, parts=3)                       # [2]: with fewer prompts than ranks, some get none
    asm = PartAssembler(first_batch=0, parts=[0, 1])
    asm.add(part)                                    # a GeneratedBatch with extra["part"] (any arrival order)
    asm.pop_ready()                                  # the whole batches complete so far, in index order
    report = assemble_report([val_part_0, val_part_1], n_samples=4)

In the disaggregated placement every rollout rank generates a share of every batch: the batch's prompts (GRPO groups:
a prompt's rollout.n samples stay on one rank) are cut into K contiguous shares in draw order, one per rollout rank,
sizes differing by at most one (`share`; validation rows are split the same way). Each rank works through its shares
batch after batch, at its own pace within the staleness bound, and sends each to trainer rank 0 as a part.
`assemble` concatenates a batch's parts in rank order (so the batch is the same, prompt for prompt, whatever order
the parts arrived in) and stamps it with its OLDEST part's version: the bound must hold for every sample, and each
sample keeps its own stamp (loop.Trajectory.versions). The rollout metrics are merged as what they are: counts and
token totals add up, per-trajectory means are recomputed over the whole batch (RolloutStats.as_metrics over every
trajectory), times that run in parallel on separate ranks take the longest, the search error rate is summed
failures over summed searches, the weights check takes the worst part.

Pure logic: no torch.distributed; tests/rollout/test_batch_parts.py tests it directly.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Sequence

from megatron_searchr1.rollout.async_buffer import GeneratedBatch
from megatron_searchr1.rollout.loop import RolloutStats


def share(n: int, part: int, parts: int) -> range:
    """The items (prompts of a batch, validation rows) rollout rank `part` (0-based) of `parts` takes: contiguous
    shares in order, sizes differing by at most one, empty for some ranks when n < parts.

    >>> [share(5, p, 2) for p in range(2)], [len(share(1, p, 3)) for p in range(3)]
    ([range(0, 2), range(2, 5)], [0, 0, 1])
    """
    return range(n * part // parts, n * (part + 1) // parts)


def contributors(n: int, parts: int) -> list[int]:
    """The rollout ranks (0-based) whose share of `n` items is not empty: the parts a batch is assembled from.

    >>> contributors(4, 2), contributors(2, 4)
    ([0, 1], [1, 3])
    """
    return [p for p in range(parts) if len(share(n, p, parts))]


def _finite_max(values: Sequence[float]) -> float:
    """The largest of the values that are not nan; nan when there are none."""
    finite = [v for v in values if not math.isnan(v)]
    return max(finite) if finite else float("nan")


def merge_stats(stats: Sequence[RolloutStats]) -> RolloutStats:
    """One batch's counters from its parts': finish reasons and tokens add up; the generate / search seconds are the
    longest part's (the parts ran at once on separate ranks, so the longest is the batch's generation time).

    >>> s = merge_stats([RolloutStats(Counter(answer=2), 3, 10, 4, 1.5, 0.5), RolloutStats(Counter(answer=1), 2, 6,
    ...                  2, 2.5, 0.1)])
    >>> s.finish["answer"], s.turns, s.generated_tokens, s.prefill_tokens, s.gen_seconds, s.search_seconds
    (3, 5, 16, 6, 2.5, 0.5)
    """
    return RolloutStats(finish=sum((s.finish for s in stats), Counter()), turns=sum(s.turns for s in stats),
                        generated_tokens=sum(s.generated_tokens for s in stats),
                        prefill_tokens=sum(s.prefill_tokens for s in stats),
                        gen_seconds=max((s.gen_seconds for s in stats), default=0.0),
                        search_seconds=max((s.search_seconds for s in stats), default=0.0))


def merge_sync(parts: Sequence[dict]) -> dict:
    """The parts' weights checks (`sync/remote_*` without the prefix) as one: the largest engine-vs-sent difference
    (nan parts ignored), the fewest tensors any part compared, the oldest version any part's engine held.

    >>> merge_sync([{"remote_check_max_diff": 0.0, "remote_check_tensors": 4.0, "remote_applied_version": 3.0},
    ...             {"remote_check_max_diff": 1e-3, "remote_check_tensors": 2.0, "remote_applied_version": 2.0}])
    {'remote_check_max_diff': 0.001, 'remote_check_tensors': 2.0, 'remote_applied_version': 2.0}
    """
    return {"remote_check_max_diff": _finite_max([p["remote_check_max_diff"] for p in parts]),
            "remote_check_tensors": min(p["remote_check_tensors"] for p in parts),
            "remote_applied_version": min(p["remote_applied_version"] for p in parts)}


def assemble(parts: Sequence[GeneratedBatch]) -> GeneratedBatch:
    """One batch from its parts (module doc): trajectories and scores concatenated in rank order, version = the
    oldest part's, generation from the first part's start to the last part's end, merged metrics. Each part's
    payload holds trajs, scores, stats (RolloutStats), search ((failed, searched) counts) and sync; its `extra`
    its share index ("part"; a streamed group: its position in the batch, plus "in_flight" and "wait_s"). The
    result's extra["parts"] lists (global rank, version, samples, gen_start, gen_end) per part, in part order;
    streamed groups add extra["in_flight"] (per group) and extra["wait_s"] (summed)."""
    if not parts:
        raise ValueError("assemble: no parts")
    parts = sorted(parts, key=lambda p: p.extra["part"])
    index = {p.index for p in parts}
    if len(index) != 1:
        raise ValueError(f"assemble: parts of batches {sorted(index)}, expected one batch")
    trajs = [tr for p in parts for tr in p.payload["trajs"]]
    scores = [sc for p in parts for sc in p.payload["scores"]]
    failed = sum(p.payload["search"][0] for p in parts)
    searched = sum(p.payload["search"][1] for p in parts)
    metrics = {**merge_stats([p.payload["stats"] for p in parts]).as_metrics(trajs),
               "rollout/search_error_rate": failed / max(searched, 1)}
    extra = {"parts": [(p.rank, p.version, len(p.payload["trajs"]), p.gen_start, p.gen_end) for p in parts]}
    if all("in_flight" in p.extra for p in parts):  # streamed groups (trainer/rollout_stream.py)
        extra["in_flight"] = [p.extra["in_flight"] for p in parts]
        extra["wait_s"] = sum(p.extra["wait_s"] for p in parts)
    return GeneratedBatch(
        index=parts[0].index, version=min(p.version for p in parts),
        payload={"trajs": trajs, "scores": scores, "metrics": metrics,
                 "sync": merge_sync([p.payload["sync"] for p in parts])},
        gen_start=min(p.gen_start for p in parts), gen_end=max(p.gen_end for p in parts), rank=-1, extra=extra)


def assemble_report(parts: Sequence[dict], n_samples: int) -> dict:
    """One validation report from the rollout ranks' parts ({val, part, records, samples}): records in rank order
    (the rows' order, since the shares are contiguous), the first `n_samples` sampled trajectories.

    >>> assemble_report([{"val": 2, "part": 1, "records": ["c"], "samples": ["z"]},
    ...                  {"val": 2, "part": 0, "records": ["a", "b"], "samples": ["x", "y"]}], n_samples=2)
    {'val': 2, 'records': ['a', 'b', 'c'], 'samples': ['x', 'y']}
    """
    parts = sorted(parts, key=lambda p: p["part"])
    versions = {p["val"] for p in parts}
    if len(versions) != 1:
        raise ValueError(f"assemble_report: parts of versions {sorted(versions)}, expected one")
    return {"val": parts[0]["val"], "records": [r for p in parts for r in p["records"]],
            "samples": [s for p in parts for s in p["samples"]][:n_samples]}


class PartAssembler:
    """Parts in, whole batches out, in index order: batch b is ready once every rank in `parts` (0-based share
    indices: `contributors`) sent its part of b. Not thread-safe (its owner holds a lock)."""

    def __init__(self, first_batch: int, parts: Sequence[int]):
        if not parts:
            raise ValueError("PartAssembler: no contributing rollout ranks")
        self.next = first_batch
        """The index of the next batch to complete."""
        self.parts = frozenset(parts)
        self._pending: dict[int, dict[int, GeneratedBatch]] = {}

    def add(self, part: GeneratedBatch) -> None:
        """Keep `part` until its batch is complete; refuses a part of a batch already out, from a rank that has no
        share, or twice."""
        j = part.extra.get("part")
        if j not in self.parts:
            raise ValueError(f"a part from share {j}, expected one of {sorted(self.parts)}")
        if part.index < self.next:
            raise ValueError(f"a part of batch {part.index} (share {j}), which was already assembled")
        got = self._pending.setdefault(part.index, {})
        if j in got:
            raise ValueError(f"batch {part.index}: share {j} sent its part twice")
        got[j] = part

    def ready(self) -> bool:
        """Whether the next batch is complete."""
        return set(self._pending.get(self.next, {})) == self.parts

    def pop_ready(self) -> list[GeneratedBatch]:
        """The batches complete so far, assembled, in index order (each only once)."""
        out = []
        while self.ready():
            out.append(assemble(list(self._pending.pop(self.next).values())))
            self.next += 1
        return out
