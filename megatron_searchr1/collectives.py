"""Where a tensor made for a collective lives: the package's one rule for all_reduce / broadcast / all_gather.

    t = torch.zeros(n, device=collective_device())
    dist.all_reduce(t, group=group)

Every collective's tensor is on `collective_device()` (or is a model tensor, on it already). The default process
group also carries gloo for CPU tensors (megatron/initialize.py: `process_group_kwargs`), but a group made with an
explicit NCCL backend would not; tests/test_collectives.py lists every call site. A leaf (torch only), so metrics and
other small modules can follow the rule without importing Megatron.
"""
from __future__ import annotations

import torch


def collective_device() -> torch.device:
    """The current GPU when there is one, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
