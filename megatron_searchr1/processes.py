"""A child process that must not outlive the process that started it.

A rank that is SIGKILLed (an out-of-memory kill, torchrun tearing down a failed job, a user's `kill -9`) runs no
clean-up of its own, so whatever it started (a retrieval server, a multiprocessing manager) would keep running,
holding memory and ports. Linux lets a child ask, once started, for a signal when its parent goes: the kernel
delivers it however the parent dies. Standard library only, so that any layer may use it.
"""
from __future__ import annotations

import ctypes
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """In a child process: ask the kernel to send `sig` when the parent thread exits (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
