"""Flat byte buckets: many tensors packed at aligned offsets in one uint8 buffer, so that a weight sync moves one
buffer per collective (or per message) instead of one per tensor.

    layout = layout_bucket([(name, shape, dtype), ...])   # where each tensor goes
    flat = pack_bucket(tensors, layout)                    # (layout.nbytes,) uint8
    pairs = unpack_bucket(flat, layout)                    # [(name, view into flat)]: no copies
    plan_buckets(sizes, bucket_bytes)                      # which consecutive tensors share a bucket

Pure functions over torch tensors, no torch.distributed: the colocated sync (weight_sync.py), the disaggregated
one (remote_sync.py: buckets are what crosses the bridge) and the planner's byte counts all use them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

ALIGN = 64
"""Byte alignment of every tensor inside a flat bucket (any dtype can be viewed at such an offset)."""


def aligned(n: int) -> int:
    """`n` bytes rounded up to the bucket alignment (the planner counts bucket bytes with it too)."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Slot:
    """One tensor inside a flat bucket."""

    name: str
    """HF (or Megatron) name."""
    shape: tuple[int, ...]
    """Tensor shape."""
    dtype: torch.dtype
    """Element type."""
    offset: int
    """Byte offset in the bucket (a multiple of ALIGN)."""

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class BucketLayout:
    """Where each tensor of a bucket lives in its flat uint8 buffer."""

    slots: tuple[Slot, ...]
    """Tensors in order."""
    nbytes: int
    """Buffer size in bytes."""


def layout_bucket(specs: Sequence[tuple[str, Sequence[int], torch.dtype]]) -> BucketLayout:
    """(name, shape, dtype) of each tensor -> their slots, packed in order at ALIGN-ed offsets."""
    slots, offset = [], 0
    for name, shape, dtype in specs:
        slot = Slot(name, tuple(int(s) for s in shape), dtype, offset)
        slots.append(slot)
        offset += aligned(slot.nbytes)
    return BucketLayout(tuple(slots), offset)


def plan_buckets(sizes: Sequence[int], bucket_bytes: int) -> list[range]:
    """Split items of `sizes` bytes, in order, into consecutive runs of at most `bucket_bytes` (ALIGN-ed sizes).

    An item larger than `bucket_bytes` gets a bucket of its own (never split, never dropped).
    >>> plan_buckets([64, 64, 64, 200, 64], 128)
    [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    runs, start, used = [], 0, 0
    for i, size in enumerate(sizes):
        size = aligned(size)
        if i > start and used + size > bucket_bytes:
            runs.append(range(start, i))
            start, used = i, 0
        used += size
    if start < len(sizes):
        runs.append(range(start, len(sizes)))
    return runs


def pack_bucket(tensors: Sequence[torch.Tensor], layout: BucketLayout,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Copy `tensors` (matching `layout` in shape and dtype) into a flat uint8 buffer (nbytes,)."""
    if len(tensors) != len(layout.slots):
        raise ValueError(f"{len(tensors)} tensors for a bucket of {len(layout.slots)} slots")
    device = tensors[0].device if tensors else "cpu"
    flat = out if out is not None else torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    for t, slot in zip(tensors, layout.slots):
        if tuple(t.shape) != slot.shape or t.dtype != slot.dtype:
            raise ValueError(f"{slot.name}: got {tuple(t.shape)} {t.dtype}, the plan says {slot.shape} {slot.dtype}")
        dst = flat[slot.offset: slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
        dst.copy_(t)
    return flat


def unpack_bucket(flat: torch.Tensor, layout: BucketLayout) -> list[tuple[str, torch.Tensor]]:
    """A flat uint8 buffer -> (name, view) per slot: no copies; the views share `flat`'s memory."""
    return [(s.name, flat[s.offset: s.offset + s.nbytes].view(s.dtype).view(s.shape)) for s in layout.slots]
