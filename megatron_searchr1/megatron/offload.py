"""Opt-in offload of the trainer's GPU memory to host memory while the rollout engine generates (verl's
`param_offload`, `grad_offload`, `optimizer_offload`; here `model.param_offload`, `grad_offload`,
`optimizer_offload`, `ref_offload`).

    offload = GenerationOffload(cfg.model, actor=rt.actor, actor_opt=rt.actor_opt, ref=rt.ref, ...)
    offload.before_wake()      # gradients, optimizer state, reference (and critic) weights: nothing reads them
    wake_and_sync(engine, sync, after_sync=offload.after_sync)   # the sync reads the actor's weights, then they go
    ...generate...; engine.sleep(level=2)
    offload.reload()           # everything back where it was, before the log-prob passes and the update

How a tensor moves: its storage's bytes are copied to host memory (pinned on CUDA) and the storage is resized to
0 bytes; reload resizes it back and copies the bytes in. The tensor objects, their views and everything that
refers to them stay as they are: Megatron's parameters are views of DDP's parameter buffer (distributed
optimizer), `main_grad` views of its gradient buffer, the optimizer's state keyed by parameter. Megatron's own
`_ParamAndGradBuffer.offload_to_cpu` and verl's `offload_megatron_model_to_cpu` do the same for DDP's buffers.

- params: the storages of a model's parameters (one per DDP buffer under the distributed optimizer, else one per
  parameter; shared ones once). An fp32 model's parameters are also its optimizer's master weights.
- grads: DDP's gradient buffers are freed, not copied: train_step zeroes them before the next backward anyway
  (`zero_grad_buffer`), and reload allocates them zeroed (as Megatron's `restore_grad_buffers` and verl do).
- optimizer: Adam's state tensors (exp_avg, exp_avg_sq) and the fp32 master copies of bf16 parameters
  (Megatron's Float16Optimizer `fp32_from_float16_groups`, DistributedOptimizer `shard_fp32_from_float16_groups`).

On the CPU the host copy lives in the same memory: the path is exercised (tests/megatron/test_offload.py), it
saves nothing. On GPUs it frees, for a 7B actor at TP=4 without the distributed optimizer, ~3.5 GiB of bf16
weights, ~7 GiB of fp32 gradients and ~21 GiB of Adam state + master weights per GPU while vLLM holds its KV cache.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Iterable

import torch


@dataclass
class Stash:
    """What offload_* emptied; reload() puts it back. Several offloads can share one stash."""

    copies: list[tuple[torch.UntypedStorage, torch.Tensor]] = field(default_factory=list)
    """(emptied storage, its bytes in host memory)."""
    freed: list[tuple[torch.UntypedStorage, int]] = field(default_factory=list)
    """(emptied storage, its size in bytes): reallocated zeroed."""
    moved_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes emptied per kind (params, grads, optimizer, ref, critic)."""

    def reload(self) -> None:
        """Reallocate every emptied storage and copy its bytes back (zeros for freed gradients)."""
        for storage, host in self.copies:
            storage.resize_(host.numel())
            _as_bytes(storage).copy_(host, non_blocking=host.is_pinned())
        for storage, nbytes in self.freed:
            storage.resize_(nbytes)
            _as_bytes(storage).zero_()
        if self.copies and torch.cuda.is_available():
            torch.cuda.synchronize()  # the host copies may be reused or freed right after
        self.copies, self.freed, self.moved_bytes = [], [], {}

    @property
    def empty(self) -> bool:
        return not self.copies and not self.freed

    def _add(self, kind: str, nbytes: int) -> None:
        self.moved_bytes[kind] = self.moved_bytes.get(kind, 0) + nbytes


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (to copy it whatever the dtypes of its views)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """Each live storage under `tensors` once (views share one); empty (already offloaded) ones are skipped."""
    seen, out = set(), []
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        out.append(storage)
    return out


def _copy_out(storages: list[torch.UntypedStorage], stash: Stash, kind: str) -> None:
    pin = torch.cuda.is_available()
    for storage in storages:
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin and storage.device.type == "cuda")
        host.copy_(_as_bytes(storage), non_blocking=host.is_pinned())
        stash.copies.append((storage, host))
        stash._add(kind, storage.nbytes())
    if pin:
        torch.cuda.synchronize()  # the copies must be done before the storages are freed
    for storage in storages:
        storage.resize_(0)


def _ddp_buffers(model: torch.nn.Module) -> list:
    """Megatron DDP's parameter-and-gradient buffers (an attribute `buffers`, which shadows Module.buffers())."""
    buffers = getattr(model, "buffers", None)
    if not isinstance(buffers, list):
        return []
    return buffers + list(getattr(model, "expert_parallel_buffers", []) or [])


def offload_params(model: torch.nn.Module, stash: Stash, kind: str = "params") -> None:
    """Move a model's parameters (DDP-wrapped or bare) to host memory (module doc)."""
    _copy_out(_unique_storages(p.data for p in model.parameters()), stash, kind)


def offload_grads(model: torch.nn.Module, stash: Stash) -> None:
    """Free a DDP model's gradient buffers; reload() reallocates them zeroed (module doc)."""
    for storage in _unique_storages(b.grad_data for b in _ddp_buffers(model) if b.grad_data is not None):
        stash.freed.append((storage, storage.nbytes()))
        stash._add("grads", storage.nbytes())
        storage.resize_(0)


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """Adam's state tensors and the fp32 master copies of low-precision parameters, of a Megatron optimizer
    (chained or not). The parameters of an fp32 model are their own master weights: left to offload_params.

    The inner optimizer is torch's Adam(W) on the CPU and Transformer Engine's FusedAdam on GPUs (megatron-core picks
    TE's when it imports). Their state differs: torch keeps {step, exp_avg, exp_avg_sq} per parameter; TE keeps
    {exp_avg, exp_avg_sq} (+ master_param with its master weights) per parameter, the step in the param groups, and
    the scales of low-precision states in `_scales[param][name]` beside the state; an fp8 state is a Float8Tensor,
    a wrapper whose bytes live in its `_data` (its storage is not the bytes: `_state_tensors`)."""
    tensors = []
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        for groups in (getattr(opt, "fp32_from_float16_groups", None), getattr(opt, "shard_fp32_from_float16_groups",
                                                                                 None)):
            for group in groups or []:
                tensors += [p for p in group if p is not None]
        inner = getattr(opt, "optimizer", None)
        if inner is not None:
            for state in inner.state.values():
                tensors += [t for v in state.values() if isinstance(v, torch.Tensor) for t in _state_tensors(v)]
            for scales in (getattr(inner, "_scales", None) or {}).values():  # TE FusedAdam
                tensors += [v for v in scales.values() if isinstance(v, torch.Tensor)]
    return tensors


def _state_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold `t`'s bytes: `t` itself, or a quantized wrapper's inner data and scales (TE's
    Float8Tensor keeps them in `_data`, `_scale_inv` and, once made, `_transpose`)."""
    if type(t) in (torch.Tensor, torch.nn.Parameter) or not hasattr(t, "_data"):
        return [t]
    return [v for v in (getattr(t, name, None) for name in ("_data", "_scale_inv", "_transpose"))
            if isinstance(v, torch.Tensor)]


def offload_optimizer(optimizer, stash: Stash) -> None:
    """Move a Megatron optimizer's state and master weights to host memory (module doc)."""
    _copy_out(_unique_storages(_optimizer_tensors(optimizer)), stash, "optimizer")


class GenerationOffload:
    """The `model.*_offload` flags around generation, in verl's order: before the engine wakes, what the weight
    sync does not read (gradients, optimizer state, reference and critic weights); after the sync, the actor's
    weights; everything back after generation (the log-prob passes and the update need it). With no flag set
    every call does nothing."""

    def __init__(self, model_cfg, *, actor, actor_opt, critic=None, critic_opt=None, ref=None):
        self.params, self.grads = model_cfg.param_offload, model_cfg.grad_offload
        self.optimizer, self.ref_flag = model_cfg.optimizer_offload, model_cfg.ref_offload
        self.actor, self.actor_opt, self.critic, self.critic_opt, self.ref = actor, actor_opt, critic, critic_opt, ref
        self.stash = Stash()
        self._reported: dict[str, int] = {}

    @property
    def enabled(self) -> bool:
        return self.params or self.grads or self.optimizer or self.ref_flag

    def before_wake(self) -> None:
        if not self.enabled:
            return
        for model in (self.actor, self.critic):
            if model is not None and self.grads:
                offload_grads(model, self.stash)
        for opt in (self.actor_opt, self.critic_opt):
            if opt is not None and self.optimizer:
                offload_optimizer(opt, self.stash)
        if self.critic is not None and self.params:
            offload_params(self.critic, self.stash, "critic")
        if self.ref is not None and self.ref_flag:
            offload_params(self.ref, self.stash, "ref")
        _release()

    def after_sync(self) -> None:
        if self.params:
            offload_params(self.actor, self.stash)
            _release()

    def reload(self) -> dict[str, int]:
        """Bring everything back; returns the bytes that were offloaded, per kind."""
        moved = dict(self.stash.moved_bytes)
        if not self.stash.empty:
            self.stash.reload()
        if moved and moved != self._reported:  # rank 0, when it changes (Adam's state exists after step 1)
            self._reported = moved
            if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
                print("offloaded to host memory while generating (rank 0): "
                      + ", ".join(f"{k} {v / 2 ** 20:.1f} MiB" for k, v in sorted(moved.items())), flush=True)
        return moved


def _release() -> None:
    """Return the freed blocks to the driver, so vLLM can take them (verl: gc + empty_cache after offloading)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
