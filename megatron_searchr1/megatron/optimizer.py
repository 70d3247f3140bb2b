"""Megatron DDP, the Adam optimizer and the LR schedule for a trainable model (actor, critic, SFT model).

    model = build_gpt_model(hf_config)                 # + load weights into the bare model here
    model = wrap_ddp(model)                            # grads in fp32 buffers, DP all-reduce after each step
    optimizer, scheduler = build_optimizer(model, lr=1e-6, clip_grad=1.0, warmup_steps=10, decay_steps=1000)

Order matters: load weights *before* `build_optimizer`, which copies the parameters into fp32 master weights
when the model is bf16 (`params_dtype=torch.bfloat16`, GPU): the optimizer then steps the fp32 copies and
writes them back into the bf16 parameters. fp32 models (the CPU) train their parameters directly.

`wrap_ddp` also installs the hooks Megatron's pipeline schedule calls (`config.no_sync_func`,
`config.finalize_model_grads_func`): without `finalize_model_grads` the schedule would never all-reduce the
gradients over DP (nor the tied-embedding gradients over the first and last pipeline stages).
`build_optimizer` installs `config.grad_scale_func` (loss scaling; a no-op factor for bf16/fp32).

Gradient arithmetic (schedule.py's train step relies on it): DDP scales each gradient by 1/DP before the
all-reduce (Megatron's default, `average_in_collective=False`), i.e. the DP ranks' gradients are *averaged*.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

DECAY_STYLES = ("constant", "linear", "cosine")


def wrap_ddp(model: torch.nn.Module, *, use_distributed_optimizer: bool = False,
             overlap_grad_reduce: Optional[bool] = None) -> DistributedDataParallel:
    """Megatron DDP around a bare GPTModel/CriticModel stage, gradients reduced in fp32.

    `overlap_grad_reduce` (None: on with CUDA, off on the CPU) overlaps the DP all-reduce with backward.
    `use_distributed_optimizer` must match build_optimizer's (the gradient buffers are laid out for it).
    """
    if overlap_grad_reduce is None:
        overlap_grad_reduce = torch.cuda.is_available()
    config = model.config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    ddp = DistributedDataParallel(config, ddp_config, model)
    # Hooks the pipeline schedule calls: skip DP grad sync inside the micro-batch loop (with overlap) and
    # finish it (DP all-reduce, tied embeddings across PP, layernorm grads under sequence parallel) at the end.
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return ddp


def build_optimizer(
    model: DistributedDataParallel,
    *,
    lr: float,
    min_lr: float = 0.0,
    weight_decay: float = 0.0,
    adam_betas: tuple[float, float] = (0.9, 0.999),
    adam_eps: float = 1e-8,
    clip_grad: float = 1.0,
    warmup_steps: int = 0,
    decay_steps: Optional[int] = None,
    decay_style: str = "constant",
):
    """(optimizer, scheduler): Megatron's Adam(W) over the DDP model and an LR schedule.

    Precision follows the model: bf16 parameters get fp32 master weights (Megatron's Float16Optimizer, or the
    distributed optimizer's fp32 shards when wrap_ddp(use_distributed_optimizer=True)); fp32 trains directly.
    clip_grad: max global grad norm (0 disables). The schedule is linear warmup from 0 to `lr` over
    `warmup_steps` scheduler steps, then `constant`, or `linear`/`cosine` decay to `min_lr` at `decay_steps`.
    A scheduler step is whatever the caller counts: schedule.train_step steps it once per optimizer step
    when given it; pass scheduler=None there and call `scheduler.step(1)` once per RL step to count RL steps.
    """
    if decay_style not in DECAY_STYLES:
        raise ValueError(f"decay_style={decay_style!r}: choose one of {DECAY_STYLES}")
    if not 0.0 <= min_lr <= lr:
        raise ValueError(f"need 0 <= min_lr <= lr, got min_lr={min_lr}, lr={lr}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if decay_style != "constant" and (decay_steps is None or decay_steps <= warmup_steps):
        raise ValueError(f"decay_style={decay_style!r} needs decay_steps > warmup_steps (got decay_steps="
                         f"{decay_steps}, warmup_steps={warmup_steps}): set it to the total number of steps")
    config = model.config
    ddp_config = model.ddp_config
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=min_lr,
        weight_decay=weight_decay,
        adam_beta1=adam_betas[0],
        adam_beta2=adam_betas[1],
        adam_eps=adam_eps,
        clip_grad=clip_grad,
        bf16=bool(config.bf16),
        fp16=bool(config.fp16),
        params_dtype=config.params_dtype,
        use_distributed_optimizer=ddp_config.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, [model])
    config.grad_scale_func = optimizer.scale_loss
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup_steps > 0 else lr,
        max_lr=lr,
        min_lr=min_lr,
        lr_warmup_steps=warmup_steps,
        # Megatron wants decay steps > warmup steps even when the LR is constant afterwards.
        lr_decay_steps=decay_steps if decay_style != "constant" else max(decay_steps or 0, warmup_steps + 1),
        lr_decay_style=decay_style,
        start_wd=weight_decay,
        end_wd=weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def current_lr(optimizer) -> float:
    """The learning rate of the first parameter group (all groups share it here)."""
    return float(optimizer.param_groups[0]["lr"])
