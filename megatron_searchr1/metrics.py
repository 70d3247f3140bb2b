"""Metrics out of a run: TensorBoard scalars, one console line per step, sampled trajectories as JSONL.

    logger = RunLogger(output_dir, enabled=rank == 0, tensorboard=True)
    logger.log(step, metrics)                      # scalars + console line
    logger.histogram(step, "async/staleness", values)  # a TensorBoard histogram (nothing in metrics.jsonl)
    logger.trajectories(step, records)             # appended to <output_dir>/trajectories.jsonl
    logger.resume_at(step)                         # after a resume: rows of later (lost) steps are dropped

Metrics are reduced over ranks with `mean_over_ranks` before logging: every rank passes the same keys.
"""
from __future__ import annotations

import json
import os
import time
from typing import Optional

import torch
import torch.distributed as dist

from megatron_searchr1 import collectives  # collectives.collective_device: tests replace it

# Shown on the console line, in this order, when present (everything goes to TensorBoard).
CONSOLE_KEYS = ("reward/mean", "rollout/finish_answer", "rollout/searches_mean", "rollout/response_length_mean",
                "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "critic/vf_loss",
                "train/logprob_gap_engine", "rollout/search_error_rate", "train/dropped_trajectories", "time/step")


def mean_over_ranks(metrics: dict[str, float], group=None) -> dict[str, float]:
    """Average each metric over the ranks of `group` (all ranks if None); one all_reduce for all keys.

    Keys are sorted so every rank packs the same order; a rank missing a key is a bug (raised, not averaged).
    The packed tensor goes through the current GPU when there is one (`collective_device`): an NCCL group refuses
    CPU tensors.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return dict(metrics)
    keys = sorted(metrics)
    key_lists = [None] * dist.get_world_size(group)
    dist.all_gather_object(key_lists, keys, group=group)
    if any(k != keys for k in key_lists):
        raise RuntimeError(f"ranks log different metric keys: {sorted(set(map(tuple, key_lists)))[:2]}")
    t = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=collectives.collective_device())
    dist.all_reduce(t, group=group)
    t /= dist.get_world_size(group)
    return dict(zip(keys, t.cpu().tolist()))


class RunLogger:
    """Rank 0 writes; other ranks hold a disabled logger so call sites need no `if rank == 0`."""

    def __init__(self, output_dir: str, enabled: bool, tensorboard: bool = True, console_every: int = 1):
        self.enabled, self.output_dir, self.console_every = enabled, output_dir, console_every
        self.tb_dir = os.path.join(output_dir, "tensorboard")
        self._writer = None
        self._t0 = time.time()
        if enabled:
            os.makedirs(output_dir, exist_ok=True)
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter(self.tb_dir)

    def log(self, step: int, metrics: dict[str, float], prefix: str = "") -> None:
        if not self.enabled:
            return
        if self._writer is not None:
            for k, v in metrics.items():
                self._writer.add_scalar(prefix + k, v, step)
            self._writer.flush()
        with open(os.path.join(self.output_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, **{prefix + k: v for k, v in metrics.items()}}) + "\n")

    def histogram(self, step: int, tag: str, values) -> None:
        """A TensorBoard histogram of `values` at `step` (the per-sample spread behind a mean, e.g. staleness)."""
        if not self.enabled or self._writer is None or len(values) == 0:
            return
        self._writer.add_histogram(tag, torch.as_tensor(values, dtype=torch.float64), step)
        self._writer.flush()

    def console(self, step: int, total: int, metrics: dict[str, float], write=print) -> None:
        if not self.enabled or step % self.console_every:
            return
        shown = " ".join(f"{_label(k)}={metrics[k]:.4g}" for k in CONSOLE_KEYS if k in metrics)
        write(f"step {step}/{total} {shown} elapsed={time.time() - self._t0:.0f}s")

    def trajectories(self, step: int, records: list[dict], name: str = "trajectories.jsonl") -> None:
        if not self.enabled or not records:
            return
        with open(os.path.join(self.output_dir, name), "a", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps({"step": step, **r}, ensure_ascii=False) + "\n")

    def resume_at(self, step: int) -> None:
        """The run resumed from its checkpoint of `step`: rows a killed run logged after that step (it died after
        its last complete checkpoint, perhaps during the next save) are dropped from every JSONL log of the run,
        and TensorBoard hides their events (purge_step), so the steps that are run again appear once."""
        if not self.enabled:
            return
        for name in sorted(os.listdir(self.output_dir)):
            if name.endswith(".jsonl"):
                truncate_jsonl_after(os.path.join(self.output_dir, name), step)
        if self._writer is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer.close()
            self._writer = SummaryWriter(self.tb_dir, purge_step=step + 1)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def truncate_jsonl_after(path: str, step: int) -> int:
    """Keep the rows of a JSONL log whose "step" is <= `step` (and rows without one); returns how many went.
    The file is rewritten through a temporary file and a rename, so a crash leaves the old or the new one."""
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            row_step = json.loads(line).get("step")
        except (ValueError, AttributeError):  # a torn last line of a killed run
            continue
        if not isinstance(row_step, (int, float)) or row_step <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    if len(kept) != len(lines):
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(tmp, path)
    return len(lines) - len(kept)


def _label(key: str) -> str:
    """Console name of a metric: its last part, or its first for `reward/mean` (`reward=`, not `mean=`)."""
    parts = key.split("/")
    return parts[0] if parts[-1] == "mean" else parts[-1]


def read_scalars(tb_dir: str) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] from the TensorBoard event files of a run (tests and reports read curves back)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(tb_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_histograms(tb_dir: str) -> dict[str, list[tuple[int, float, float, float]]]:
    """tag -> [(step, count, min, max)] of the TensorBoard histograms of a run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(tb_dir, size_guidance={"histograms": 0})
    acc.Reload()
    return {tag: [(e.step, e.histogram_value.num, e.histogram_value.min, e.histogram_value.max)
                  for e in acc.Histograms(tag)] for tag in acc.Tags()["histograms"]}


def timer():
    """`with timer() as t: ...; t.seconds` — wall time of a phase."""
    return _Timer()


class _Timer:
    seconds: Optional[float] = None

    def __enter__(self):
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self._start
