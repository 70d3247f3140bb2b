"""The storage side of checkpoints (checkpoint/__init__.py): what a full, read-only or forbidden output directory
becomes, and making room before a save.

A save that the filesystem refuses (no space, quota, read-only, permission) is not a bug of ours but a state of the
machine the user must change: CheckpointStorageError is a CheckpointError and a cli.UsageError, so the entry points'
`run_main` prints it as one `error:` line (exit 2) on every rank instead of the writers' nested tracebacks.

    room = make_room(root, keep_last)        # rank 0, before a save: prune early when the disk is short
    storage_cause(exc)                       # the errno behind an exception (or its causes), None if not storage
"""
from __future__ import annotations

import errno
import os
import shutil
from typing import Callable, Optional

from megatron_searchr1.checkpoint.optimizer import CheckpointError
from megatron_searchr1.cli import UsageError

# errno -> (short cause, what to do about it)
STORAGE_ERRNOS = {
    errno.ENOSPC: ("no space left on the device", "free space there, lower trainer.keep_last, or put "
                   "trainer.output_dir on a larger filesystem"),
    errno.EDQUOT: ("disk quota exceeded", "free space within the quota or put trainer.output_dir elsewhere"),
    errno.EROFS: ("the filesystem is read-only", "mount it read-write or put trainer.output_dir on a writable "
                  "filesystem"),
    errno.EACCES: ("permission denied", "give this user write access there or choose another trainer.output_dir"),
    errno.EPERM: ("operation not permitted", "give this user write access there or choose another "
                  "trainer.output_dir"),
}


class CheckpointStorageError(CheckpointError, UsageError):
    """The filesystem refused a checkpoint write (space, quota, read-only, permission); the message names the
    directory, the cause and, for space, how much was needed and how much is free."""


def storage_cause(exc: BaseException) -> Optional[int]:
    """The storage errno (STORAGE_ERRNOS) behind `exc`: the exception itself, its causes and contexts, and what a
    wrapper keeps of the real failures (torch.distributed.checkpoint's CheckpointException carries each rank's
    exception in `failures`), each by its errno or its message ("[Errno 28] ..."); None when it is no storage
    failure."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            return e.errno
        text = str(e)  # a writer's worker re-raised as "RuntimeError: Worker failure: [Errno 28] ..."
        for code in STORAGE_ERRNOS:
            if f"[Errno {code}]" in text:
                return code
        todo += [e.__cause__, e.__context__]
        for failure in (getattr(e, "failures", None) or {}).values():
            todo += [x for x in (failure if isinstance(failure, tuple) else (failure,)) if isinstance(x, BaseException)]
    return None


# Below this many free bytes a filesystem counts as full: torch.save's zip writer reports a full disk as a
# RuntimeError without the errno ("unexpected pos ..."), so a failed write next to a (nearly) full disk is read as
# one; a write fails with less than its own chunk left, which is well under this.
FULL_BELOW = 1 << 20


def looks_full(path: str) -> bool:
    """Whether the filesystem holding `path` has less than FULL_BELOW bytes free."""
    free = free_bytes(path)
    return free is not None and free < FULL_BELOW


def dir_size(path: str) -> int:
    """Bytes of the files under `path` (0 when it is gone)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def free_bytes(path: str) -> Optional[int]:
    """Bytes free to this user on the filesystem holding `path` (None when it cannot be asked)."""
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def human(n: Optional[int]) -> str:
    if n is None:
        return "unknown"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def resume_room_problem(ckpt_root: str, step: int, keep_last: Optional[int], complete: list[int],
                        step_size: Callable[[int], int]) -> Optional[CheckpointStorageError]:
    """Rank 0, at start-up of a resumed run: the error to raise when the next save cannot fit, or None. The next
    save needs about the size of the checkpoint resumed from; what `make_room` would prune before it counts as free.
    A disk still full would otherwise train a whole step (or more) before failing the same save again."""
    free = free_bytes(ckpt_root)
    if free is None or step not in complete:
        return None
    need = step_size(step)
    prunable = complete[:-max(keep_last - 1, 1)] if keep_last is not None else []
    room = free + sum(step_size(s) for s in prunable)
    if room >= need:
        return None
    return storage_error(f"resuming from checkpoint step {step} in {ckpt_root} (its next save will not fit)",
                         ckpt_root, errno.ENOSPC, need=need, need_from=f"the size of step {step}'s checkpoint",
                         free=free, keep_last=keep_last)


def make_room(ckpt_root: str, keep_last: Optional[int], complete: list[int], step_size: Callable[[int], int],
              remove: Callable[[int], None]) -> Optional[int]:
    """Rank 0, before a save: the size of the newest complete checkpoint (the estimate of what the save needs;
    None when there is none), pruned for first when the disk is short.

    With `keep_last` and less free space than that estimate, the oldest complete checkpoints beyond keep_last - 1
    are removed now rather than after the save (which could then not finish); the newest complete one is never
    removed here, so a failed save still leaves one to resume from. `complete`: the complete steps, oldest first.
    """
    if not complete:
        return None
    need = step_size(complete[-1])
    if keep_last is not None:
        free = free_bytes(ckpt_root)
        if free is not None and free < need:
            for step in complete[:-max(keep_last - 1, 1)]:
                remove(step)
    return need


_UNSET = object()


def space_advice(keep_last: Optional[int]) -> str:
    """What to do when checkpoints do not fit: lowering trainer.keep_last only where it can go lower.

    >>> space_advice(1)
    'free space there or put trainer.output_dir on a larger filesystem'
    >>> space_advice(3)
    'free space there, lower trainer.keep_last (now 3), or put trainer.output_dir on a larger filesystem'
    """
    if keep_last is None:
        return "free space there, set trainer.keep_last to keep fewer checkpoints, or put trainer.output_dir on a " \
               "larger filesystem"
    if keep_last > 1:
        return f"free space there, lower trainer.keep_last (now {keep_last}), or put trainer.output_dir on a larger " \
               "filesystem"
    return "free space there or put trainer.output_dir on a larger filesystem"  # keep_last=1: nothing to lower


def storage_error(what: str, path: str, code: int, *, need: Optional[int], need_from: str,
                  free: Optional[int] = None, keep_last=_UNSET) -> CheckpointStorageError:
    """One line: what failed where, the cause, the space needed and free (for space; `free`: as measured when it
    failed, else now), and what to do (with `keep_last`, the run's trainer.keep_last: whether lowering it helps)."""
    cause, todo = STORAGE_ERRNOS[code]
    if keep_last is not _UNSET and code in (errno.ENOSPC, errno.EDQUOT):
        todo = space_advice(keep_last)
    line = f"{what} failed: {cause} ({path}"
    if code in (errno.ENOSPC, errno.EDQUOT):
        if free is None:
            free = free_bytes(path) if os.path.exists(path) else None
        line += f": {human(free)} free, a checkpoint needs about {human(need)} ({need_from})"
    return CheckpointStorageError(f"{line}); {todo}")
