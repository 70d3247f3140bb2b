"""Faster forwards for Megatron's local-spec modules (the CPU path), swapped in after construction.

`use_fast_modules(model, use_te=...)` swaps in `SwiGLUMLP` (no gradient concat), `Fast{Column,Row}ParallelLinear`
(`F.linear` when a call needs no communication) and, on the last stage, `BatchFirstOutputLayer` (logits computed
[b, s, V], saving copies). Each computes what the Megatron module it replaces computes (tests compare each against
it); tools/benchmarks/bench_megatron_vs_hf.py measures what they buy.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.mlp import MLP


# ---------------------------------------------------------------------------------------------------------------
class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up over fc1's [..., 2F] output, whose backward writes [d_gate, d_up] into one buffer.

    Megatron's unfused path (`torch.chunk` + silu + mul) pays a `torch.cat` of the two [..., F] gradients in
    backward: a copy of the layer's largest activation. Same saved tensors, same kernels otherwise
    (aten.silu_backward), so gradients match autograd's bit for bit.
    """

    @staticmethod
    def forward(ctx, x):
        gate, up = x.chunk(2, dim=-1)
        act = F.silu(gate)
        ctx.save_for_backward(x, act)
        return act * up

    @staticmethod
    def backward(ctx, grad):
        x, act = ctx.saved_tensors
        gate, up = x.chunk(2, dim=-1)
        grad_x = torch.empty_like(x)
        d_gate, d_up = grad_x.chunk(2, dim=-1)  # views into grad_x: written in place, no concat
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=d_gate)
        torch.mul(grad, act, out=d_up)
        return grad_x


class SwiGLUMLP(MLP):
    """Megatron's MLP with `_SwiGLU` on the plain path (SwiGLU, no bias, no fusion, no clamp/offset/scales)."""

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        cfg = self.config
        plain = (
            per_token_scale is None
            and cfg.gated_linear_unit
            and self.activation_func is F.silu
            and not cfg.use_te_activation_func
            and not cfg.bias_activation_fusion
            and cfg.activation_func_clamp_value is None
            and cfg.glu_linear_offset == 0.0
        )
        if not plain:
            return super().forward(hidden_states, per_token_scale=per_token_scale, **kwargs)
        intermediate, bias = self.linear_fc1(hidden_states)  # [s, b, 2F/tp]
        if bias is not None:
            intermediate = intermediate + bias
        return self.linear_fc2(_SwiGLU.apply(intermediate))


class _NoCommLinear:
    """Mixin for Megatron's parallel linears: run `F.linear` when the call needs no communication.

    Megatron routes every linear through a Python autograd Function (for async TP all-reduce, sequence
    parallelism and fused gradient accumulation). When none of those apply (TP=1 column layers, row layers
    without SP, no fusion) it computes exactly `input @ weight.T + bias`; PyTorch's native op does the same
    without the Python autograd Function. Anything else goes to Megatron's path.
    """

    def _forward_impl(self, input, weight, *args, **kwargs):
        plain = (
            not args
            and weight.requires_grad
            and not kwargs.get("gradient_accumulation_fusion")
            and not kwargs.get("allreduce_dgrad")
            and not kwargs.get("sequence_parallel")
            and kwargs.get("grad_output_buffer") is None
        )
        if not plain:
            return super()._forward_impl(input, weight, *args, **kwargs)
        return F.linear(input, weight, kwargs.get("bias"))


class FastColumnParallelLinear(_NoCommLinear, tensor_parallel.ColumnParallelLinear):
    """ColumnParallelLinear with the `_NoCommLinear` shortcut."""


class FastRowParallelLinear(_NoCommLinear, tensor_parallel.RowParallelLinear):
    """RowParallelLinear with the `_NoCommLinear` shortcut."""


class BatchFirstOutputLayer(FastColumnParallelLinear):
    """The LM output layer, computing logits batch-first when the model asks for logits.

    GPTModel returns `logits.transpose(0, 1).contiguous()`: a copy of the whole [s, b, V] logits tensor, and
    in backward the transposed gradient is copied twice more inside the linear layer. V is far larger than the
    hidden size, so those copies are a visible share of a small model's step on the CPU. Transposing the [s, b, h] input instead
    (small) and returning a [s, b, V] *view* of a contiguous [b, s, V] result makes GPTModel's `.contiguous()`
    free and its backward copy-free. Numerically identical (same matmul per row).
    Only when `batch_first` is set (by BatchFirstGPTModel, for calls without labels): Megatron's loss path
    (`labels=...`) reads the [s, b, V] logits with `.view`, which needs them contiguous.
    """

    batch_first = False

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if not self.batch_first:
            return super().forward(input_, weight, runtime_gather_output)
        out, bias = super().forward(input_.transpose(0, 1).contiguous(), weight, runtime_gather_output)
        return out.transpose(0, 1), bias


class BatchFirstGPTModel(GPTModel):
    """GPTModel that lets a BatchFirstOutputLayer compute batch-first logits when it returns logits (no labels)."""

    def _postprocess(self, *args, **kwargs):
        layer = getattr(self, "output_layer", None)
        if isinstance(layer, BatchFirstOutputLayer):
            # GPTModel passes everything by keyword; only the plain-logits path transposes back to [b, s, V].
            layer.batch_first = (kwargs.get("labels") is None and not self.mtp_process
                                 and not self.config.sequence_parallel)
        return super()._postprocess(*args, **kwargs)


def use_fast_modules(model: GPTModel, *, use_te: bool) -> None:
    """Swap in the faster forwards (same parameters and state; only `forward` differs, so a class swap).

    Swapped after construction rather than in the spec because TransformerLayer only passes the TP group to
    a spec whose MLP *is* MLP. Transformer Engine models keep TE's own modules (only the output layer changes).
    """
    layer = getattr(model, "output_layer", None)
    if (type(layer) is tensor_parallel.ColumnParallelLinear and not model.config.sequence_parallel
            and not model.config.defer_embedding_wgrad_compute):
        layer.__class__ = BatchFirstOutputLayer
    if not use_te:
        swaps = {MLP: SwiGLUMLP, tensor_parallel.ColumnParallelLinear: FastColumnParallelLinear,
                 tensor_parallel.RowParallelLinear: FastRowParallelLinear}
        for module in model.modules():
            if type(module) in swaps:
                module.__class__ = swaps[type(module)]
