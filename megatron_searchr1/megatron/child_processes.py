"""Helper processes that Megatron starts must die with the rank that started them.

Megatron's checkpoint writer (dist_checkpointing.strategies.filesystem_async) keeps one results queue per process,
served by a `multiprocessing` manager: a separate server process, started at the first save. A rank that exits
normally shuts it down; a rank that is SIGKILLed (an out-of-memory kill, torchrun tearing down a failed job, a user's
`kill -9`) leaves it running forever, ~275 MB each, one per rank and per restart. `tie_checkpoint_writer_to_rank()`
replaces Megatron's queue factory with one that starts the same manager at the same moment (the first save) with the
Linux parent-death signal set in its server process, so the kernel ends it when its rank dies, however it dies.
"""
from __future__ import annotations

import multiprocessing as mp
from multiprocessing.managers import SyncManager

from megatron_searchr1.processes import die_with_parent

_manager = None


def tie_checkpoint_writer_to_rank() -> bool:
    """Make Megatron's checkpoint writer start its results-queue manager (at the first save, as it would) with the
    parent-death signal set in the manager's process; idempotent. Returns False where this megatron-core has no
    such queue factory (nothing to tie)."""
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa
    except ImportError:
        return False
    if not hasattr(fsa, "_get_write_results_queue"):
        return False
    fsa._get_write_results_queue = _write_results_queue
    return True


def _write_results_queue():
    """Megatron's `_get_write_results_queue`, with the manager tied to this process."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa

    global _manager
    if fsa._results_queue is None:
        # The spawn context, as Megatron's own factory uses (fork is unsafe with CUDA and threads).
        _manager = SyncManager(ctx=mp.get_context("spawn"))
        _manager.start(initializer=die_with_parent)
        fsa._results_queue = _manager.Queue()
    return fsa._results_queue


def manager_pid() -> int | None:
    """The pid of the manager process this module started (tests watch it), or None."""
    return _manager._process.pid if _manager is not None else None
