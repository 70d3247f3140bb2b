"""A CPU stand-in for Transformer Engine's FusedAdam (the optimizer megatron-core builds on GPUs), with its state
layout, read from TE's sources (transformer_engine/pytorch/optimizers/fused_adam.py): the step is a counter in each
param group (bumped only for groups that hold parameters), the per-parameter state holds exp_avg and exp_avg_sq
(and master_param with master_weights=True), never a step; low-precision states keep a scale per parameter and name
in `_scales`, beside the state. It takes TE's constructor arguments (adam_w_mode, master_weights, ...). The update is
AdamW's arithmetic, so training through it is real.

    with te_layout_adam(monkeypatch): ...build_optimizer(...)...   # megatron-core then builds this one

Code that reads optimizer state (the offload, checkpoints) and only ever saw torch's Adam on the CPU breaks here the
way it would on a GPU."""
from __future__ import annotations

import torch


class TeLayoutAdam(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, master_weights=False, **_ignored):
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode, self.master_weights = adam_w_mode, master_weights
        self._scales = {}

    def initialize_state(self, p, store_param_remainders=False):
        self.state[p]["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
        self.state[p]["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        if self.master_weights:
            self.state[p]["master_param"] = p.detach().clone().float()

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if not group["params"]:  # TE: no step counter for an empty group
                continue
            group["step"] = group.get("step", 0) + 1
            t, (b1, b2) = group["step"], group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    self.initialize_state(p)
                g = p.grad.float()
                if not self.adam_w_mode and group["weight_decay"]:
                    g = g + group["weight_decay"] * p.float()
                state["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                c1, c2 = (1 - b1 ** t, 1 - b2 ** t) if group["bias_correction"] else (1.0, 1.0)
                update = (state["exp_avg"] / c1) / ((state["exp_avg_sq"] / c2).sqrt() + group["eps"])
                if self.adam_w_mode and group["weight_decay"]:
                    update = update + group["weight_decay"] * p.float()
                p.add_((-group["lr"] * update).to(p.dtype))


class te_layout_adam:
    """Make megatron-core build TeLayoutAdam where it would build TE's FusedAdam (a context manager over pytest's
    monkeypatch)."""

    def __init__(self, monkeypatch):
        self.mp = monkeypatch

    def __enter__(self):
        import megatron.core.optimizer as mco
        import megatron.core.optimizer.distrib_optimizer as mdo

        self.mp.setattr(mco, "Adam", TeLayoutAdam)
        self.mp.setattr(mdo, "Adam", TeLayoutAdam)  # its isinstance check (which optimizers it can checkpoint)
        self.mp.setattr(mdo, "HAVE_APEX_OR_TE", True)  # where it looks for the step: the param groups
        self.mp.setattr(mdo, "USING_TE_OPTIMIZER", True)
        self.mp.setattr(mco, "USING_PYTORCH_OPTIMIZER", False)
        return self

    def __exit__(self, *exc):
        self.mp.undo()
