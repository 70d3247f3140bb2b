"""Rank arithmetic the configuration checks: Megatron's model replicas, vLLM's engine groups, and the rule that
lets one engine serve one replica.

    check_engine_layout(world=8, tp=2, pp=2, engine_tp=2)     # raises LayoutError where no engine can serve
    replicas(8, tp=2, pp=2)                                   # [[0, 1, 4, 5], [2, 3, 6, 7]]

Two facts meet here. vLLM's `external_launcher` builds its TP groups from *consecutive* global ranks
(``arange(world).reshape(-1, engine_tp)``). Megatron orders ranks tp-cp-ep-dp-pp (tp varies fastest; cp = ep = 1
here), so a model replica (model-parallel group, one DP rank) is *not* contiguous once PP > 1 and DP > 1: with
tp=2, pp=2, dp=2 the replicas are [0, 1, 4, 5] and [2, 3, 6, 7]. An engine must hold one replica's trajectories
(all its ranks send the same prompts), so an engine group that straddles two replicas would receive two
different prompt lists: a hang or garbage. With DP > 1 every step from one rank to the next that leaves a
tensor-parallel group also leaves the replica, so the rule is: ``engine_tp`` divides ``parallel.tp``, or DP = 1.

Pure arithmetic, no torch or megatron import: `Config.validate` runs it before anything heavy is loaded, and
rollout/engine_groups.py (which engine serves which replica, how trajectories are split) builds on it; the tests
check it against megatron.core's own RankGenerator for every layout up to 64 ranks.
"""
from __future__ import annotations

import glob
import os
from typing import Optional


class LayoutError(ValueError):
    """An engine layout that cannot serve Megatron's replicas; the message names the fields to change."""


def replicas(world: int, tp: int, pp: int) -> list[list[int]]:
    """Megatron's model-parallel groups (one per DP rank), ranks ascending: rank = t + tp * d + tp * dp * p.

    >>> replicas(8, tp=2, pp=2)
    [[0, 1, 4, 5], [2, 3, 6, 7]]
    """
    dp = world // (tp * pp)
    return [sorted(t + tp * d + tp * dp * p for p in range(pp) for t in range(tp)) for d in range(dp)]


def engine_groups(world: int, engine_tp: int) -> list[list[int]]:
    """vLLM's TP groups under `external_launcher`: consecutive blocks of `engine_tp` global ranks.

    >>> engine_groups(4, 2)
    [[0, 1], [2, 3]]
    """
    return [list(range(start, start + engine_tp)) for start in range(0, world, engine_tp)]


def replica_of(world: int, tp: int, pp: int) -> list[int]:
    """DP rank (replica) of every global rank.

    >>> replica_of(8, tp=2, pp=2)
    [0, 0, 1, 1, 0, 0, 1, 1]
    """
    out = [0] * world
    for d, ranks in enumerate(replicas(world, tp, pp)):
        for r in ranks:
            out[r] = d
    return out


def check_engine_layout(world: int, tp: int, pp: int, engine_tp: int) -> None:
    """Raise LayoutError unless every vLLM engine group lies inside one Megatron replica (the module doc's rule).

    >>> check_engine_layout(8, tp=2, pp=2, engine_tp=2)
    >>> check_engine_layout(8, tp=2, pp=2, engine_tp=4)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    megatron_searchr1.config.layout.LayoutError: rollout.engine_tp=4 puts ranks [0, 1, 2, 3] in one vLLM engine ...
    """
    w, e = world, engine_tp
    if w % (tp * pp):
        raise LayoutError(f"world size {w} is not a multiple of parallel.tp * parallel.pp = {tp * pp}")
    if e < 1 or w % e:
        raise LayoutError(f"rollout.engine_tp={e} must divide the world size {w}")
    owner = replica_of(w, tp, pp)
    for group in engine_groups(w, e):
        spanned = sorted({owner[r] for r in group})
        if len(spanned) > 1:
            first = replicas(w, tp, pp)[spanned[0]]
            raise LayoutError(
                f"rollout.engine_tp={e} puts ranks {group} in one vLLM engine (vLLM groups consecutive ranks), "
                f"but with parallel.tp={tp}, parallel.pp={pp} and DP={w // (tp * pp)} Megatron places them in "
                f"{len(spanned)} model replicas (rank order tp-dp-pp; replica {spanned[0]} = ranks {first}). "
                f"With DP > 1 an engine must fit in one tensor-parallel group: set rollout.engine_tp to a divisor "
                f"of parallel.tp={tp}, or raise parallel.tp / parallel.pp until DP = 1")


def no_cuda_reason(env: Optional[dict] = None, nvidia_devices: Optional[list] = None) -> Optional[str]:
    """Why this launch certainly has no CUDA device, read without torch (None when it may have one): CPU mode
    asked for, every GPU hidden, or no NVIDIA device file. Lets `parallel.bridge_backend=nccl` be refused before
    anything heavy loads; the device resolved at start-up decides the rest (rollout/remote_sync.py bridge_backend).

    >>> no_cuda_reason({"MEGATRON_SEARCHR1_DEVICE": "cpu"}, ["/dev/nvidia0"])
    'MEGATRON_SEARCHR1_DEVICE=cpu'
    >>> no_cuda_reason({}, []), no_cuda_reason({"CUDA_VISIBLE_DEVICES": "0,1"}, ["/dev/nvidia0"])
    ('no /dev/nvidia* device here', None)
    """
    env = os.environ if env is None else env
    nvidia_devices = glob.glob("/dev/nvidia[0-9]*") if nvidia_devices is None else nvidia_devices
    if env.get("MEGATRON_SEARCHR1_DEVICE", "").strip().lower() == "cpu":
        return "MEGATRON_SEARCHR1_DEVICE=cpu"
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    return None if nvidia_devices else "no /dev/nvidia* device here"
