"""Start torch.distributed and Megatron's parallel state from torchrun's environment.

    torchrun --nproc_per_node 4 my_entry.py      # each rank calls initialize_megatron(tp=2, pp=2)

Without torchrun's variables (a plain `python` run, a notebook, a unit test) we start a 1-process world on a free
loopback port, so the same code path serves both. NCCL with CUDA, gloo without; on the CPU the compatibility layer
in `compat.py` is installed first.
"""
from __future__ import annotations

import os
import random
import socket
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megatron_searchr1.megatron.compat import install_cpu_compat


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# torchrun-style variables we set ourselves for a world of one; removed again by destroy_megatron so that a
# subprocess started later (a converter, a server) does not inherit a rendezvous that no longer exists.
_ENV_WE_SET: list[str] = []


def _init_process_group(timeout_minutes: int) -> None:
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:  # not under torchrun: a world of one
        own = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        for key, value in own.items():
            if key not in os.environ:
                os.environ[key] = value
                _ENV_WE_SET.append(key)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=timedelta(minutes=timeout_minutes))


def seed_everything(seed: int) -> None:
    """Seed python, numpy, torch and Megatron's model-parallel RNG tracker (needs parallel state)."""
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # Same seed on every DP replica, offset per TP rank for TP-region dropout (Megatron's rule).
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def initialize_megatron(tp: int = 1, pp: int = 1, seed: int = 1234, timeout_minutes: int = 30) -> None:
    """Initialise torch.distributed and Megatron's TP/PP/DP groups; DP = world_size / (tp * pp).

    Idempotent for the same sizes, so a test or tool may call it more than once.
    """
    from megatron.core import parallel_state as mpu

    if tp < 1 or pp < 1:
        raise ValueError(f"tensor/pipeline parallel sizes must be >= 1, got tp={tp}, pp={pp}")
    _init_process_group(timeout_minutes)
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(
            f"world size {world} is not divisible by tp*pp = {tp}*{pp} = {tp * pp}: launch "
            f"`torchrun --nproc_per_node {tp * pp}` (or a multiple of it), or change parallel.tp / parallel.pp"
        )
    install_cpu_compat()
    if mpu.model_parallel_is_initialized():
        have = (mpu.get_tensor_model_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size())
        if have != (tp, pp):
            raise RuntimeError(f"Megatron is already initialised with (tp, pp)={have}; call destroy_megatron() first")
    else:
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            distributed_timeout_minutes=timeout_minutes,
        )
    install_cpu_compat()  # again: initialize_model_parallel may import more megatron modules
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
