"""Start torch.distributed and Megatron's parallel state from torchrun's environment.

    torchrun --nproc_per_node 4 my_entry.py      # each rank calls initialize_megatron(tp=2, pp=2)

Without torchrun's variables (a plain `python` run, a notebook, a unit test) we start a 1-process world on a free
loopback port, so the same code path serves both. NCCL (and gloo beside it for CPU tensors) with CUDA, gloo
without; on the CPU the compatibility layer in `compat.py` is installed first.

CPU mode is never a silent fallback: it is chosen when the machine has no GPU at all. When the launch says GPUs are
expected (`MEGATRON_SEARCHR1_DEVICE=cuda` or `device="cuda"`, `CUDA_VISIBLE_DEVICES` naming devices, `/dev/nvidia*`
present) but torch sees no CUDA (a broken driver, a CPU-only torch, a wrong `CUDA_VISIBLE_DEVICES`), we refuse with the
reasons instead of training on CPUs over gloo; `MEGATRON_SEARCHR1_DEVICE=cpu` (or `device="cpu"`) says CPU on purpose.
"""
from __future__ import annotations

import glob
import os
import random
import socket
import warnings
from datetime import timedelta
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_searchr1.megatron.child_processes import tie_checkpoint_writer_to_rank
from megatron_searchr1.megatron.compat import install_cpu_compat


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# torchrun-style variables we set ourselves for a world of one; removed again by destroy_megatron so that a
# subprocess started later (a converter, a server) does not inherit a rendezvous that no longer exists.
_ENV_WE_SET: list[str] = []


DEVICE_ENV = "MEGATRON_SEARCHR1_DEVICE"


def gpu_expected_reasons(env: Optional[dict] = None, nvidia_devices: Optional[list] = None) -> list[str]:
    """Why this launch looks like a GPU job (empty when nothing says so): CUDA_VISIBLE_DEVICES naming devices, or
    NVIDIA device files present."""
    env = os.environ if env is None else env
    nvidia_devices = glob.glob("/dev/nvidia[0-9]*") if nvidia_devices is None else nvidia_devices
    reasons = []
    visible = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible and visible not in ("-1", "none", "NoDevFiles"):
        reasons.append(f"CUDA_VISIBLE_DEVICES={visible}")
    if nvidia_devices:
        reasons.append(f"{', '.join(sorted(nvidia_devices)[:2])} present")
    return reasons


def resolve_device(device: Optional[str] = None, *, cuda_available: Optional[bool] = None,
                   env: Optional[dict] = None, nvidia_devices: Optional[list] = None) -> str:
    """'cuda' or 'cpu' for this process: `device` if given, else $MEGATRON_SEARCHR1_DEVICE, else what the machine
    has. Refuses (RuntimeError) a GPU launch that finds no CUDA unless CPU mode is asked for explicitly."""
    env = os.environ if env is None else env
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    wanted = (device or env.get(DEVICE_ENV, "") or "").strip().lower() or None
    if wanted not in (None, "cpu", "cuda"):
        raise ValueError(f"device={wanted!r} (or ${DEVICE_ENV}) must be 'cpu' or 'cuda'")
    if cuda:
        if wanted == "cpu":
            raise RuntimeError(f"CPU mode was asked for (device='cpu' / {DEVICE_ENV}=cpu) but CUDA is available: "
                               "hide the GPUs (CUDA_VISIBLE_DEVICES=) for a CPU run, or unset it")
        return "cuda"
    if wanted == "cpu":
        return "cpu"
    reasons = ([f"device='cuda' / {DEVICE_ENV}=cuda was asked for"] if wanted == "cuda" else []) + \
        gpu_expected_reasons(env, nvidia_devices)
    if reasons:
        raise RuntimeError(
            f"this launch expects GPUs ({'; '.join(reasons)}) but torch.cuda.is_available() is False (CPU-only torch "
            "build, broken driver, or wrong CUDA_VISIBLE_DEVICES?): fix the CUDA setup, or set "
            f"{DEVICE_ENV}=cpu (initialize_megatron(device='cpu')) to run on CPUs over gloo on purpose")
    return "cpu"


def process_group_kwargs(device: str, local_rank: int, timeout_minutes: int) -> dict:
    """`init_process_group` arguments.

    CUDA: NCCL for CUDA tensors and gloo beside it for CPU tensors (`cpu:gloo,cuda:nccl`): an NCCL-only group refuses
    a CPU tensor ("No backend type associated with device type cpu"), and metrics, counts and pickled objects are
    CPU tensors. Megatron's TP/PP/DP groups are made with `backend=None`, so they inherit both. CPU: gloo alone.

    No `device_id`: a bound default group makes torch connect every later `new_group` eagerly (an ncclCommSplit per
    group at creation), so each of Megatron's ~20 groups this rank is in, used or not, holds NCCL buffers from
    start-up. Unbound, a communicator is created at a group's first collective (verl binds no device either);
    `_init_process_group` calls `torch.cuda.set_device(local_rank)` first, so NCCL picks this rank's GPU.
    """
    timeout = timedelta(minutes=timeout_minutes)
    if device == "cuda":
        return dict(backend="cpu:gloo,cuda:nccl", timeout=timeout)
    return dict(backend="gloo", timeout=timeout)


MAX_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"


def cuda_env(device: str, tp: int, sequence_parallel: bool = False) -> dict[str, str]:
    """Environment variables Megatron needs set before CUDA starts: `CUDA_DEVICE_MAX_CONNECTIONS=1` on GPUs with
    TP > 1 (sequence parallelism implies it).

    Megatron issues a TP layer's communication before the compute it should overlap with (the async input-grad
    all-reduce, SP's reduce-scatter) and relies on one hardware queue to run them in that order
    (tensor_parallel/layers.py, which warns without it); verl sets it for its Megatron workers as well.
    """
    if device == "cuda" and (tp > 1 or sequence_parallel):
        return {MAX_CONNECTIONS: "1"}
    return {}


def _apply_cuda_env(wanted: dict[str, str]) -> None:
    """Set `wanted` in os.environ unless the user set the variable (a UCC pipeline backend needs it > 1); say so
    when CUDA already started, since the driver reads it only when the context is created."""
    for key, value in wanted.items():
        if key in os.environ:
            if os.environ[key] != value:
                warnings.warn(f"{key}={os.environ[key]} is kept as set; Megatron's TP overlap expects {value}")
            continue
        if torch.cuda.is_initialized():
            warnings.warn(f"{key}={value} is set after CUDA started, so this process does not use it: export it "
                          "before launching (torchrun inherits it)")
        os.environ[key] = value


apply_cuda_env = _apply_cuda_env
"""Public name: trainer/async_rl.py sets the environment before its role world's first CUDA call."""


def _init_process_group(timeout_minutes: int, device: str) -> None:
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:  # not under torchrun: a world of one
        own = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        for key, value in own.items():
            if key not in os.environ:
                os.environ[key] = value
                _ENV_WE_SET.append(key)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(**process_group_kwargs(device, local_rank, timeout_minutes))


def seed_everything(seed: int) -> int:
    """Seed python, numpy, torch and Megatron's model-parallel RNG tracker (needs parallel state); returns the seed
    used on this rank.

    Megatron-LM's rule: `seed + 100 * pp_rank`, so pipeline stages initialise their (different) layers from
    different streams; the same on every DP replica (identical replicas), and the tracker offsets it per TP rank
    for TP-region dropout.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    seed = seed + 100 * mpu.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return seed


def initialize_megatron(tp: int = 1, pp: int = 1, seed: int = 1234, timeout_minutes: int = 30,
                        device: Optional[str] = None, sequence_parallel: bool = False, ep: int = 1,
                        expert_tp: Optional[int] = None) -> None:
    """Initialise torch.distributed and Megatron's TP/PP/DP groups; DP = world_size / (tp * pp).

    `ep`: expert-parallel size (parallel.ep, MoE models): the experts of a layer are split over `ep` ranks of one
    data-parallel group, so the world must be a multiple of tp * pp * ep. `expert_tp`: expert tensor-parallel size
    (parallel.expert_tp; None = Megatron's default, tp): each expert's linears are split over that many ranks, so
    the world must also be a multiple of expert_tp * pp * ep; expert parameters are all-reduced over
    world / (expert_tp * pp * ep) ranks.

    `timeout_minutes`: the collective timeout (parallel.timeout_minutes). `sequence_parallel`: with `tp`, decides
    the CUDA environment Megatron needs (`cuda_env`), set before the first CUDA call.

    `device`: 'cuda', 'cpu' or None (= $MEGATRON_SEARCHR1_DEVICE, else what the machine has; see the module doc:
    a GPU launch without CUDA is refused, not run on CPUs). Idempotent for the same sizes, so a test or tool may
    call it more than once.
    """
    from megatron.core import parallel_state as mpu

    if tp < 1 or pp < 1 or ep < 1:
        raise ValueError(f"tensor/pipeline/expert parallel sizes must be >= 1, got tp={tp}, pp={pp}, ep={ep}")
    device = resolve_device(device)
    _apply_cuda_env(cuda_env(device, tp, sequence_parallel))
    _init_process_group(timeout_minutes, device)
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(
            f"world size {world} is not divisible by tp*pp = {tp}*{pp} = {tp * pp}: launch "
            f"`torchrun --nproc_per_node {tp * pp}` (or a multiple of it), or change parallel.tp / parallel.pp"
        )
    if world % (tp * pp * ep):
        raise ValueError(
            f"world size {world} is not divisible by tp*pp*ep = {tp}*{pp}*{ep} = {tp * pp * ep}: launch "
            f"`torchrun --nproc_per_node {tp * pp * ep}` (or a multiple of it), or change parallel.ep"
        )
    etp = tp if expert_tp is None else expert_tp
    if etp < 1 or world % (etp * pp * ep):
        raise ValueError(f"world size {world} is not divisible by expert_tp*pp*ep = {etp}*{pp}*{ep}: change "
                         "parallel.expert_tp (1, or a divisor of the world size over pp*ep)")
    install_cpu_compat()
    if mpu.model_parallel_is_initialized():
        have = (mpu.get_tensor_model_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size(),
                mpu.get_expert_model_parallel_world_size(), mpu.get_expert_tensor_parallel_world_size())
        if have != (tp, pp, ep, etp):
            raise RuntimeError(f"Megatron is already initialised with (tp, pp, ep, expert_tp)={have}; call "
                               "destroy_megatron() first")
    else:
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=expert_tp,
            distributed_timeout_minutes=timeout_minutes,
        )
    install_cpu_compat()  # again: initialize_model_parallel may import more megatron modules
    tie_checkpoint_writer_to_rank()  # a SIGKILLed rank must not leave the writer's manager process behind
    seed_everything(seed)


def destroy_megatron() -> None:
    """Tear down Megatron's groups and the process group (tests call it between cases)."""
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    while _ENV_WE_SET:
        os.environ.pop(_ENV_WE_SET.pop(), None)
