"""The weight buckets over NCCL between trainer rank 0 and the rollout ranks (`parallel.bridge_backend` nccl): the
staging buffer on the GPU, the thread's device and stream, and the polled broadcast. The bridge itself (groups,
headers, STOP, the sender and receiver threads) is rollout/remote_sync.py; this module is the part only the NCCL path
runs, so the gloo path never reads it.

    staging = Staging(device)                          # one per thread, grown to the largest bucket
    use_device(device)                                  # first thing in the thread that broadcasts
    send_bucket(group, staging, flat, check)            # trainer rank 0: host bytes -> device -> every rollout rank
    receive_bucket(group, staging, flat, check)         # a rollout rank: device -> `flat` in host memory

Each bucket is one NCCL broadcast from bridge rank 0 to all K rollout ranks, in the header's order (NCCL has no tags:
both sides issue the same broadcasts in the same order). Each side moves a bucket through one reused device buffer:
trainer rank 0 keeps queued versions in pinned host memory and copies each bucket in before broadcasting; a rollout
rank copies it out to pinned host memory (one of its two reused slots, rollout/host_slots.py), where the version waits
for the main thread's load. Host memory, because a version waits there while the engine generates, each the whole
model, and vLLM holds most of the rollout GPU.

NCCL does not notice a dead peer (a broadcast waits for the group's timeout), so both sides poll their broadcast and
call a `check` between polls that raises to give up: the sender's when close() was given an error, a receiver's when
trainer rank 0 wrote STOP into torchrun's store or its heartbeat stood still (remote_receiver.WeightReceiver). What that
check raises passes through `receive_bucket`; any other failure there is the receiving rank's own (`LocalFailure`),
not a gone trainer.

A broadcast given up is still queued on the GPU: its kernel waits for peers that will never join, and anything that
synchronises the device afterwards (vLLM's shutdown, the trainer's last CUDA calls, process exit) waits with it until
the group's watchdog fires (`parallel.timeout_minutes`, 30 by default). So giving up also aborts the communicator
(`abort`: ProcessGroupNCCL.abort(), i.e. ncclCommAbort, which kills the pending kernel and returns; torch's own
`_abort_process_group` and destroy_process_group's shutdown do the same for groups it registered). The group is
unusable afterwards, which is fine: the run is ending.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch

POLL_SECONDS = 0.002
"""How often a thread looks whether its NCCL broadcast finished (it sleeps in between, releasing the GIL)."""


class StoppedInBroadcast(Exception):
    """Trainer rank 0 wrote STOP into the store while this rank waited in an NCCL broadcast."""

    def __init__(self, reason: Optional[str]):
        super().__init__(reason)
        self.reason = reason


class TrainerSilent(RuntimeError):
    """Trainer rank 0's heartbeat stood still while this rank waited in an NCCL broadcast."""


class LocalFailure(RuntimeError):
    """The receiving rank's own failure in the NCCL path (its message says so; not reported as a gone trainer)."""


def device_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """The staging buffer: flat bytes on this rank's GPU."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def use_device(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device, and a stream of its own the thread's current stream.
    The device: it is per thread, and a new thread starts on GPU 0, where NCCL would make its communicator. The
    stream: NCCL's stream waits for the caller's current stream and work.wait() makes that stream wait for NCCL; on
    the default stream (shared with the main thread) a broadcast would queue behind training or generation kernels
    and block the ones after it for the whole transfer, or for ever when a peer is dead. Nothing on a CPU device."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.set_stream(torch.cuda.Stream(device))


def abort(group) -> None:
    """Abort `group`'s NCCL communicators (module doc): the kernel of a broadcast given up stops waiting for its peers.
    Best effort: the run is already stopping, and a failed abort must not hide why."""
    fn = getattr(group, "abort", None)
    if fn is None:
        return
    try:
        fn()
    except Exception:  # noqa: BLE001 (the watchdog still ends the communicator, later)
        pass


def await_work(work, check: Callable[[], None], every: float = 1.0, group=None) -> None:
    """Wait for an NCCL work (a broadcast) by polling it, calling `check()` every `every` seconds, which raises to
    stop waiting (NCCL itself would wait for a dead peer until the group's timeout). When `check` raises, `group`'s
    communicator is aborted first (module doc), then the error passes on."""
    last = time.monotonic()
    while not work.is_completed():
        time.sleep(POLL_SECONDS)
        if time.monotonic() - last >= every:
            last = time.monotonic()
            try:
                check()
            except BaseException:
                if group is not None:
                    abort(group)
                raise
    work.wait()


class Staging:
    """One reused device buffer for the buckets (grown to the largest bucket seen); views of it are the broadcast
    tensors, so sender and receivers hand NCCL tensors of the same byte count."""

    def __init__(self, device: torch.device):
        self.device, self.buf = device, None

    def view(self, nbytes: int) -> torch.Tensor:
        if self.buf is None or self.buf.numel() < nbytes:
            self.buf = None  # the old buffer goes back to the allocator first
            self.buf = device_buffer(nbytes, self.device)
        return self.buf[:nbytes]


def send_bucket(group, staging: Staging, flat: torch.Tensor, check: Callable[[], None]) -> None:
    """Trainer rank 0: broadcast the host bytes `flat` (one bucket) to every rollout rank of `group` through the
    staging buffer; `check` raises to abandon the broadcast."""
    # slime and verl broadcast from trainer rank 0 to every engine rank of one group (verl: 2 GiB buckets in a
    # double device buffer; slime: 512 MiB); ours waits by polling so close() can abandon it
    view = staging.view(flat.numel())
    view.copy_(flat, non_blocking=True)  # NCCL's stream waits for this thread's stream: ordered
    await_work(group.broadcast(view, 0), check, group=group)


def receive_bucket(group, staging: Staging, flat: torch.Tensor, check: Callable[[], None]) -> None:
    """A rollout rank: take part in the broadcast trainer rank 0 issues for this bucket, then copy it into `flat`
    (host memory, the bucket's byte count). StoppedInBroadcast and TrainerSilent (from `check`) pass through; any
    other failure (out of memory, NCCL) is raised as LocalFailure."""
    try:
        view = staging.view(flat.numel())
        await_work(group.broadcast(view, 0), check, group=group)
        flat.copy_(view)
    except (StoppedInBroadcast, TrainerSilent):
        raise
    except Exception as e:  # this rank's own failure, not a gone peer
        raise LocalFailure(f"receiving weights over NCCL failed ({type(e).__name__}: {e})") from e
