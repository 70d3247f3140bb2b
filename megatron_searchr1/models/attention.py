"""Core attention for Megatron's local layer spec on top of `torch.nn.functional.scaled_dot_product_attention`.

Megatron's local `DotProductAttention` materialises the full [b*np, sq, sk] score matrix with `baddbmm`,
builds a boolean causal mask, fills it, runs an fp32 softmax, and multiplies again. `SDPAttention` is a
drop-in replacement (same constructor, same forward contract) that lets PyTorch pick its fused kernel (flash
attention on the CPU and GPU, or the math fallback), with GQA handled inside the kernel (`enable_gqa`), so no
repeated K/V copy is made (tools/benchmarks/bench_megatron_vs_hf.py measures the difference).

`SDPSelfAttention` (Megatron's `SelfAttention` plus one shortcut) hands RoPE to this module: Megatron's
unfused RoPE recomputes cos/sin of the frequencies for q and for k in every layer and copies q and k
through concats (rotate-half, an empty pass-through slice, and again in backward); here cos/sin are
computed once per forward (shared by all layers) and applied per half into one buffer (`_Rope`), with the
same IEEE operations per element, so the result is bit-identical. Keys come out of RoPE already in the
memory layout the CPU flash kernel reads fastest (heads-major), and without a mask the batch is folded
into the heads so the kernel's output is Megatron's [s, b, h*d] without a copy.

Under sequence parallelism the attention core still sees the whole sequence (linear_qkv all-gathers it first), so
nothing here handles sequence-parallel inputs (tests/models/test_config.py runs the local spec with SP at TP=2).

Contract (identical to `DotProductAttention`):
    query: [sq, b, np, hn], key/value: [sk, b, ng, hn]  (np, ng = heads, query groups on this TP rank)
    attention_mask: None, or bool broadcastable to [b, np, sq, sk] where True means "masked out".
        When given it replaces the causal mask (as Megatron's softmax does); None with a causal
        mask type means plain causal attention.
    returns: [sq, b, np * hn]
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide


# inference_mode flag -> (freqs, dtype, cos, sin) of the last RoPE frequencies seen in that mode. GPTModel caches
# its [s, 1, 1, d] frequency tensor per sequence length, so every layer of a forward (and later steps) passes the same
# object. Separate entries per mode: cos/sin computed under torch.inference_mode are inference tensors, which a
# later training forward at the same length could not save for backward (the trainer computes old log-probs
# under inference_mode, then trains).
_ROPE_CACHE: dict = {}


def _rope_cos_sin(freqs: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    mode = torch.is_inference_mode_enabled()
    hit = _ROPE_CACHE.get(mode)
    if hit is not None and hit[0] is freqs and hit[1] == dtype:
        return hit[2], hit[3]
    cos, sin = torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)
    _ROPE_CACHE[mode] = (freqs, dtype, cos, sin)  # one entry per mode: the current sequence length's
    return cos, sin


class _Rope(torch.autograd.Function):
    """Non-interleaved RoPE, Megatron's formula t * cos + rotate_half(t) * sin, computed per half.

    With t = [t1, t2]: out = [t1 c1 - t2 s1, t2 c2 + t1 s2], grad = [g1 c1 + g2 s2, g2 c2 - g1 s1].
    Each half is written into its slice of one output buffer, so no concat (autograd's version concatenates
    twice, once per direction); every element sees the same IEEE operations, so the result is bit-identical.
    """

    @staticmethod
    def forward(ctx, t, cos, sin, heads_major: bool):
        ctx.save_for_backward(cos, sin)
        return _rope_halves(t, cos, sin, sign=1.0, heads_major=heads_major)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rope_halves(grad, cos, sin, sign=-1.0), None, None, None


def _rope_halves(t: Tensor, cos: Tensor, sin: Tensor, sign: float, heads_major: bool = False) -> Tensor:
    """sign=+1: [t1 c1 - t2 s1, t2 c2 + t1 s2] (forward); sign=-1: [t1 c1 + t2 s2, t2 c2 - t1 s1] (its transpose).

    heads_major: return the [s, b, h, d] result laid out as [b, h, s, d] in memory (see SDPAttention).
    """
    t1, t2 = t.chunk(2, dim=-1)
    c1, c2 = cos.chunk(2, dim=-1)
    s1, s2 = sin.chunk(2, dim=-1)
    if heads_major:
        s, b, h, d = t.shape
        out = torch.empty(b, h, s, d, dtype=t.dtype, device=t.device).permute(2, 0, 1, 3)
    else:
        out = torch.empty_like(t, memory_format=torch.contiguous_format)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(t1, c1, out=o1)
    torch.mul(t2, c2, out=o2)
    if sign > 0:
        o1.sub_(t2 * s1)
        o2.add_(t1 * s2)
    else:
        o1.add_(t2 * s2)
        o2.sub_(t1 * s1)
    return out


def apply_rope(t: Tensor, cos: Tensor, sin: Tensor, heads_major: bool = False) -> Tensor:
    """Non-interleaved RoPE (Megatron's `_apply_rotary_pos_emb_bshd` numerics). t [s, b, h, d], cos/sin [s, 1, 1, d].

    The result has t's shape; `heads_major=True` stores it as [b, h, s, d] in memory.
    """
    return _Rope.apply(t, cos, sin, heads_major)


def _heads_major(t: Tensor) -> Tensor:
    """[s, b, g, d] -> [1, b*g, s, d], contiguous (copied only if t is not already stored heads-major)."""
    s, b, g, d = t.shape
    return t.permute(1, 2, 0, 3).contiguous().view(1, b * g, s, d)


class SDPAttention(MegatronModule):
    """Scaled dot-product core attention (causal, GQA, dropout) for the local spec; TP-aware head counts."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        # Fail loudly on the features this kernel does not implement rather than compute something else.
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not support context parallelism; use the Transformer Engine spec.")
        if config.window_size is not None:
            raise ValueError("SDPAttention does not implement sliding-window attention.")
        if config.softmax_type != "vanilla":
            raise ValueError(f"SDPAttention supports softmax_type='vanilla' only, got {config.softmax_type!r}.")
        if config.apply_query_key_layer_scaling:
            raise ValueError("SDPAttention does not implement apply_query_key_layer_scaling (an fp16 trick).")

        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        tp_size = pg_collection.tp.size()

        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, tp_size)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.hidden_size_per_attention_head)
        )
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        # (q_freqs, k_freqs) set by SDPSelfAttention for the duration of one forward call.
        self.pending_rope: Optional[tuple[Tensor, Tensor]] = None

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params=None,
    ) -> Tensor:
        if packed_seq_params is not None:
            raise ValueError("SDPAttention does not support packed sequences (THD); use the Transformer Engine spec.")
        if attention_bias is not None:
            raise ValueError("SDPAttention does not support an attention bias.")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        sq, b = query.shape[0], query.shape[1]
        if self.pending_rope is not None:
            q_freqs, k_freqs = self.pending_rope
            # Straight into the layout the attention kernel reads fastest (see below).
            heads_major = attention_mask is None
            query = apply_rope(query, *_rope_cos_sin(q_freqs, query.dtype), heads_major=heads_major)
            key = apply_rope(key, *_rope_cos_sin(k_freqs, key.dtype), heads_major=heads_major)

        attn_mask = None
        is_causal = False
        if attention_mask is not None:
            # Megatron's mask says "True = masked out"; sdpa's boolean mask says "True = attend".
            attn_mask = ~attention_mask.to(torch.bool)
        elif mask_type == AttnMaskType.causal and sq > 1:
            # sq == 1 is a single decoding step over a cache: it may attend to everything (as Megatron does).
            is_causal = True

        if attn_mask is None:
            # Fold the batch into the heads: [s, b, h, d] -> [1, b*h, s, d]. PyTorch's flash kernels lay their
            # output out as [batch, s, heads, d] in memory, which is then exactly Megatron's [s, b, h, d]: no
            # copy of the output nor of its gradient. The kernel is faster when each
            # head's keys and values [s, d] are contiguous, so q/k/v are stored heads-major: RoPE writes q and
            # k that way for free, values (small under GQA) are copied.
            # GQA still pairs query head b*h + i with key/value head b*g + i // (h/g).
            q, k, v = _heads_major(query), _heads_major(key), _heads_major(value)
        else:
            # An explicit mask is per batch row: keep the batch. [s, b, h, d] -> [b, h, s, d] (strided views).
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))

        dropout_p = self.dropout_p if self.training else 0.0
        gqa = self.num_attention_heads_per_partition != self.num_query_groups_per_partition
        # Heads are split over TP ranks, so their dropout masks must differ: draw from the TP RNG stream, exactly
        # where Megatron's DotProductAttention does (no dropout: no RNG use, so no fork needed).
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if dropout_p > 0.0 else contextlib.nullcontext()
        with rng:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                scale=self.softmax_scale, enable_gqa=gqa,
            )
        if attn_mask is None:
            # [1, b*h, s, d] -> [s, b*h, d] -> [sq, b, h * d] (a view when the kernel wrote [s, b*h, d])
            return out.squeeze(0).transpose(0, 1).reshape(sq, b, self.hidden_size_per_partition)
        # [b, h, s, d] -> [sq, b, h * d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)


class SDPSelfAttention(SelfAttention):
    """Megatron's SelfAttention that lets SDPAttention apply RoPE (see the module doc); otherwise unchanged.

    The shortcut is taken only for plain training/prefill forwards (no inference cache, no packed sequences,
    no context parallelism, no fused or interleaved RoPE, no q/k norms, no core-attention recompute);
    anything else runs Megatron's own path.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cfg = self.config
        self.rope_in_core = (
            isinstance(self.core_attention, SDPAttention)
            and not cfg.apply_rope_fusion
            and not cfg.rotary_interleaved
            and not cfg.multi_latent_attention
            and not cfg.fused_single_qkv_rope
            and not cfg.no_rope_freq
            and cfg.context_parallel_size == 1
            and not self.checkpoint_core_attention
            and isinstance(self.q_layernorm, (IdentityOp, type(None)))
            and isinstance(self.k_layernorm, (IdentityOp, type(None)))
        )

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, *args, **kwargs):
        plain = (
            self.rope_in_core
            and rotary_pos_emb is not None
            and inference_context is None
            and kwargs.get("inference_params") is None
            and kwargs.get("packed_seq_params") is None
            and not args
        )
        if not plain:
            return super().forward(hidden_states, attention_mask, key_value_states, inference_context,
                                   rotary_pos_emb, *args, **kwargs)
        if not isinstance(rotary_pos_emb, tuple):
            rotary_pos_emb = (rotary_pos_emb, rotary_pos_emb)
        self.core_attention.pending_rope = rotary_pos_emb
        try:
            return super().forward(hidden_states, attention_mask, key_value_states, inference_context,
                                   None, **kwargs)
        finally:
            self.core_attention.pending_rope = None
