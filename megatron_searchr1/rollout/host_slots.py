"""Where a rollout rank keeps the weight versions it received: two host buffers, reused version after version (double
buffering), for rollout/remote_sync.py's WeightReceiver.

    slots = HostSlots(device, alloc=host_buffer)      # pinned when device is a GPU
    s = slots.pick(latest_slot)                      # under the receiver's lock: a slot nobody reads, or None: wait
    buckets = slots.fill(s, layouts)                 # views of that slot, one per bucket, to receive into
    slots.holds[s] += 1 ... slots.holds[s] -= 1       # the main thread reads it (a load, a validation's load)

Why two. The receiving thread runs while the engine generates, so a version waits in host memory until the main
thread loads it between two generate calls: one slot holds the newest complete version, the other receives the next.
A fresh buffer per version (what this replaced) left up to three versions alive per rank, each the whole model: at
7B x 8 rollout ranks a node held about 360 GB of pinned memory at a peak, and pinned memory is the slowest kind to get
back (PyTorch's pinned-memory cache keeps it). Two slots per rank bound it at 2 x the version's bytes, the figure the
planner counts (planner/memory.py, HOST_SLOTS).

The hand-off rule, the only thing that makes reuse safe: the receiving thread writes only into a slot that no reader
holds (`holds`: a load in progress) and no version marked for validation still needs (`due`); of two such slots it
takes the one that is not the newest version's. When the newest version's slot is the only one it may take, that
version is superseded by the one arriving (a rollout rank wants the newest weights), so the receiver forgets it before
writing. When neither slot may be taken (one holds a version still to validate, the other is being loaded or holds
another one to validate), the receiving thread waits; the main thread frees a slot by finishing its load or by
validating (WeightReceiver.wait_for serves due validations while it waits, so the two never wait on each other).
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

HOST_SLOTS = 2
"""Host buffers per rollout rank for received weight versions (module doc)."""

ALIGN = 64
"""Byte alignment of each bucket inside a slot (a bucket's tensors are views of it at their own dtype)."""


class Version(NamedTuple):
    """A received version: its number, its buckets ((layout, flat uint8 view into the slot)), and the slot."""

    version: int
    buckets: list
    slot: int


def version_bytes(layouts) -> int:
    """The bytes one slot needs for a version of these bucket layouts (each bucket aligned).

    >>> from types import SimpleNamespace as L
    >>> version_bytes([L(nbytes=100), L(nbytes=64)])
    192
    """
    return sum(-(-lay.nbytes // ALIGN) * ALIGN for lay in layouts)


class HostSlots:
    """HOST_SLOTS reused host buffers (module doc). Not thread-safe on its own: the receiver calls it under its lock,
    except `fill`, which touches only a slot `pick` gave the receiving thread."""

    def __init__(self, device: torch.device, alloc: Callable[[int, torch.device], torch.Tensor]):
        self.device, self.alloc = device, alloc
        self.buffers: list[Optional[torch.Tensor]] = [None] * HOST_SLOTS
        self.holds = [0] * HOST_SLOTS
        """Readers of each slot now (the main thread loading from it)."""
        self.due = [0] * HOST_SLOTS
        """Versions in each slot still to validate (0 or 1)."""
        self.allocations = 0
        """Buffers allocated so far: HOST_SLOTS for a run whose versions keep their size."""

    def free(self, slot: int) -> bool:
        return self.holds[slot] == 0 and self.due[slot] == 0

    def pick(self, latest_slot: Optional[int]) -> Optional[int]:
        """A slot the receiving thread may write into, the newest version's last; None when it must wait."""
        ok = [s for s in range(HOST_SLOTS) if self.free(s)]
        ok.sort(key=lambda s: s == latest_slot)
        return ok[0] if ok else None

    def fill(self, slot: int, layouts) -> list:
        """Views of `slot` for a version of `layouts`: [(layout, flat uint8 of layout.nbytes)]; the slot's buffer is
        allocated the first time (or grown, when a version is larger than the one before)."""
        need = version_bytes(layouts)
        buf = self.buffers[slot]
        if buf is None or buf.numel() < need:
            self.buffers[slot] = None  # the old buffer goes first
            self.buffers[slot] = buf = self.alloc(need, self.device)
            self.allocations += 1
        out, offset = [], 0
        for lay in layouts:
            out.append((lay, buf[offset: offset + lay.nbytes]))
            offset += -(-lay.nbytes // ALIGN) * ALIGN
        return out

    @property
    def nbytes(self) -> int:
        """Host bytes the slots hold now."""
        return sum(b.numel() for b in self.buffers if b is not None)
