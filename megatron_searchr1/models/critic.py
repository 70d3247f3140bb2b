"""Critic: the actor's GPT trunk with a scalar value head in place of the LM head.

    critic = build_critic_model(hf_config)      # TP/PP from parallel_state, like build_gpt_model
    values = critic(input_ids, None, None)      # (B, T) fp32 on the last PP stage; hidden states elsewhere

Parameter names: the trunk is named exactly like the actor's (see models/gpt.py: embedding.*, decoder.layers.*,
decoder.final_layernorm.weight), so models/convert.py's `load_hf_weights` (an HF causal-LM dir) and
`load_megatron_checkpoint` (a converted actor checkpoint) load the actor's weights into it unchanged, leaving the
value head as built; there is no `output_layer.weight`. The head, on the last pipeline stage only, is

    value_head.weight   [1, H]   replicated on every TP rank (not split; its grads agree across TP ranks)
    value_head.bias     [1]

It starts at zero (values 0 before the first update, so the first GAE pass sees no random baseline), and is
initialised by us, not loaded: HF checkpoints have no value head. The converter exports actors only; a critic is
saved and resumed as a Megatron dist checkpoint (its value head included).

Construction note: GPTModel always builds an LM output layer on the last stage; we drop it right after
construction (a transient vocab x hidden allocation, freed before training).
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_searchr1.models.gpt import build_stage

VALUE_HEAD_WEIGHT = "value_head.weight"
VALUE_HEAD_BIAS = "value_head.bias"


class CriticModel(GPTModel):
    """GPTModel whose last stage returns per-token values (B, T) from `value_head(final_norm(h))`."""

    def __init__(self, **gpt_kwargs):
        gpt_kwargs["share_embeddings_and_output_weights"] = False  # the critic has no output layer to tie
        super().__init__(**gpt_kwargs)
        if self.post_process:
            del self.output_layer
            self.value_head = torch.nn.Linear(
                self.config.hidden_size, 1, bias=True, dtype=self.config.params_dtype
            )
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)

    def _postprocess(self, hidden_states, *args, **kwargs):
        """hidden_states [s, b, h] (already through decoder.final_layernorm) -> values (b, s) fp32."""
        if not self.post_process:
            return hidden_states
        if self.config.sequence_parallel:
            # [s/tp, b, h] -> [s, b, h]. Every TP rank then computes the same values and loss, so backward only
            # takes this rank's slice (no reduce-scatter: that would sum tp identical gradients).
            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False
            )
        values = self.value_head(hidden_states).squeeze(-1)  # [s, b]
        return values.transpose(0, 1).float().contiguous()  # (B, T)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        # LanguageModule marks `output_layer.weight` for vocab padding when post_process; we have none, so
        # hide post_process from it for this call (the value head is a plain replicated module either way).
        post_process, self.post_process = self.post_process, False
        try:
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        finally:
            self.post_process = post_process


def build_critic_model(
    hf_config,
    *,
    params_dtype: torch.dtype = torch.float32,
    use_te: Optional[bool] = None,
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
    config: Optional[TransformerConfig] = None,
) -> CriticModel:
    """This rank's critic stage for `hf_config` (randomly initialised trunk, zero value head); arguments as
    build_gpt_model's. Load the actor's weights with models/convert.py's loaders (the value head stays zero)."""
    return build_stage(CriticModel, hf_config, params_dtype=params_dtype, use_te=use_te, pre_process=pre_process,
                       post_process=post_process, config=config)
