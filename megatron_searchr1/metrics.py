"""Metrics out of a run: TensorBoard scalars, one console line per step, sampled trajectories as JSONL.

    logger = RunLogger(output_dir, enabled=rank == 0, tensorboard=True)
    logger.log(step, metrics)                      # scalars + console line
    logger.histogram(step, "async/staleness", values)  # a TensorBoard histogram (nothing in metrics.jsonl)
    logger.trajectories(step, records)             # appended to <output_dir>/trajectories.jsonl
    logger.resume_at(step)                         # after a resume: rows of later (lost) steps are dropped
    logger.raise_if_failed()                       # every rank, at one place per step: a full disk stops them all

Metrics are reduced over ranks with `mean_over_ranks` before logging: every rank passes the same keys.

A full disk (or quota, read-only, permission) under the logs is a state of the machine, as it is for checkpoints
(checkpoint/space.py): a write the filesystem refuses is remembered, nothing more is written, and
`raise_if_failed`, which every rank calls at the same point, raises LogStorageError (one `error:` line, exit 2) on
every rank together: rank 0 alone raising would leave the others in their next collective until the process group
reports "connection closed". A JSONL row is appended whole or not at all (a refused write is cut back off the
file), and opening a run's logs cuts a torn last line a killed run left, so the next rows never extend it.
"""
from __future__ import annotations

import errno
import json
import os
import time
from typing import Optional

import torch
import torch.distributed as dist

from megatron_searchr1 import collectives  # collectives.collective_device: tests replace it
from megatron_searchr1.cli import UsageError

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


class LogStorageError(UsageError):
    """The filesystem refused a write to the run's logs (space, quota, read-only, permission); the message names
    the file, the cause and what to do. A UsageError: the entry points print it as one `error:` line, exit 2."""


def storage_failure(exc: BaseException, path: str) -> Optional[str]:
    """One line for a log write the filesystem refused (naming `path`, the cause, the free space and what to do), or
    None when `exc` is no storage failure (a bug, whose traceback matters)."""
    from megatron_searchr1.checkpoint.space import STORAGE_ERRNOS, free_bytes, human, storage_cause

    code = storage_cause(exc)
    if code is None:
        return None
    cause, _ = STORAGE_ERRNOS[code]
    free = free_bytes(os.path.dirname(path) or ".")
    todo = ("free space there or put trainer.output_dir on a larger filesystem" if code in (errno.ENOSPC,
                                                                                          errno.EDQUOT)
            else STORAGE_ERRNOS[code][1])
    return f"writing the run's logs failed: {cause} ({path}: {human(free)} free); {todo}"


def append_jsonl(path: str, rows: list[dict]) -> None:
    """Append `rows` to a JSONL file whole or not at all: a write the filesystem refuses (a full disk mid-row) is cut
    back to the file's previous end before the error goes on, so the file never ends in half a row."""
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.fstat(fd).st_size
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view):]
        except OSError:
            os.ftruncate(fd, start)  # frees what the partial row took; needs no space
            raise
    finally:
        os.close(fd)


def cut_torn_last_line(path: str) -> bool:
    """Cut a last line without its newline (a run killed or out of space mid-row) off a JSONL file; True if cut.
    Reads only the file's tail."""
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return False
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return False
        end = size
        while end > 0:
            start = max(0, end - (1 << 16))
            f.seek(start)
            newline = f.read(end - start).rfind(b"\n")
            if newline >= 0:
                f.truncate(start + newline + 1)
                return True
            end = start
        f.truncate(0)
        return True


def _quiet_tensorboard_storage_errors() -> None:
    """TensorBoard writes from a thread that re-raises what its write or flush hit (and the writer re-raises it in
    the caller's next call, where RunLogger handles it): keep the thread's copy of a storage error off the console
    (Python prints an uncaught thread exception as a traceback). Other thread exceptions print as before."""
    import threading

    if getattr(threading.excepthook, "_searchr1_quiet", False):
        return
    previous = threading.excepthook

    def hook(args):
        from megatron_searchr1.checkpoint.space import storage_cause

        if type(args.thread).__name__ == "_AsyncWriterThread" and args.exc_value is not None \
                and storage_cause(args.exc_value) is not None:
            return
        previous(args)

    hook._searchr1_quiet = True
    threading.excepthook = hook


class RunLogger:
    """Rank 0 writes; other ranks hold a disabled logger so call sites need no `if rank == 0`."""

    def __init__(self, output_dir: str, enabled: bool, tensorboard: bool = True, console_every: int = 1):
        self.enabled, self.output_dir, self.console_every = enabled, output_dir, console_every
        self.tb_dir = os.path.join(output_dir, "tensorboard")
        self._writer = None
        self._t0 = time.time()
        self.failure: Optional[str] = None
        """The line of the first log write the filesystem refused (rank 0); nothing is written after it."""
        if enabled:
            os.makedirs(output_dir, exist_ok=True)
            for name in sorted(os.listdir(output_dir)):  # the rows this run appends must start on their own line
                if name.endswith(".jsonl") and os.path.isfile(os.path.join(output_dir, name)):
                    self.guarded(os.path.join(output_dir, name), cut_torn_last_line, os.path.join(output_dir, name))
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                _quiet_tensorboard_storage_errors()
                self._writer = self.guarded(self.tb_dir, SummaryWriter, self.tb_dir)

    def guarded(self, path: str, fn, *args):
        """fn(*args) (a write under `path`, e.g. a plot) unless a write already failed; a storage failure is
        remembered (see raise_if_failed), anything else raised."""
        if self.failure is not None:
            return None
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - TensorBoard re-raises its thread's OSError as is, others wrap it
            line = storage_failure(e, path)
            if line is None:
                raise
            self.failure = line
            return None

    def _tb(self, write) -> None:
        """write(SummaryWriter), then flush; a refused write stops TensorBoard for the rest of the run."""
        if self._writer is None:
            return

        def run():
            write(self._writer)
            self._writer.flush()

        self.guarded(self.tb_dir, run)
        if self.failure is not None:
            self._writer = None  # its file is in an unknown state and its close would raise again

    def log(self, step: int, metrics: dict[str, float], prefix: str = "") -> None:
        if not self.enabled:
            return

        def scalars(w):
            for k, v in metrics.items():
                w.add_scalar(prefix + k, v, step)

        self._tb(scalars)
        self.append("metrics.jsonl", [{"step": step, **{prefix + k: v for k, v in metrics.items()}}])

    def append(self, name: str, rows: list[dict]) -> None:
        """Append `rows` to `<output_dir>/<name>` (a JSONL log), each whole or none (`append_jsonl`)."""
        if self.enabled and rows:
            path = os.path.join(self.output_dir, name)
            self.guarded(path, append_jsonl, path, rows)

    def raise_if_failed(self, group=None) -> None:
        """Every rank of `group` (all ranks if None) calls this at the same point: when rank 0's logger failed to
        write, every rank raises LogStorageError with its line, together (a collective: rank 0 of the group
        broadcasts its state). With one rank, or no process group, this rank's own failure."""
        state = [self.failure]
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.broadcast_object_list(state, src=dist.get_global_rank(group, 0) if group is not None else 0,
                                       group=group)
        if state[0] is not None:
            raise LogStorageError(state[0])

    def histogram(self, step: int, tag: str, values) -> None:
        """A TensorBoard histogram of `values` at `step` (the per-sample spread behind a mean, e.g. staleness)."""
        if not self.enabled or self._writer is None or len(values) == 0:
            return
        self._tb(lambda w: w.add_histogram(tag, torch.as_tensor(values, dtype=torch.float64), step))

    def console(self, step: int, total: int, metrics: dict[str, float], write=print) -> None:
        if not self.enabled or step % self.console_every:
            return
        shown = " ".join(f"{_label(k)}={metrics[k]:.4g}" for k in CONSOLE_KEYS if k in metrics)
        write(f"step {step}/{total} {shown} elapsed={time.time() - self._t0:.0f}s")

    def trajectories(self, step: int, records: list[dict], name: str = "trajectories.jsonl") -> None:
        self.append(name, [{"step": step, **r} for r in records])

    def resume_at(self, step: int) -> None:
        """The run resumed from its checkpoint of `step`: rows a killed run logged after that step (it died after
        its last complete checkpoint, perhaps during the next save) are dropped from every JSONL log of the run,
        and TensorBoard hides their events (purge_step), so the steps that are run again appear once."""
        if not self.enabled:
            return
        for name in sorted(os.listdir(self.output_dir)):
            if name.endswith(".jsonl"):
                path = os.path.join(self.output_dir, name)
                self.guarded(path, truncate_jsonl_after, path, step)
        if self._writer is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.guarded(self.tb_dir, self._writer.close)
            self._writer = self.guarded(self.tb_dir, lambda: SummaryWriter(self.tb_dir, purge_step=step + 1))

    def close(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            self.guarded(self.tb_dir, writer.close)


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
