"""A vLLM logits processor that never samples a checkpoint's padded vocabulary rows.

Checkpoints often pad the embedding past the tokenizer (Qwen2.5: 152,064 rows, 151,665 token ids). vLLM cuts only
its own tensor-parallel padding (at config.vocab_size), so the rows past the tokenizer stay in its softmax and can be
sampled; the trainer's log-probs leave them out (models/gpt.py real_vocab_size). Setting their logits to -inf before
temperature and top-k/top-p keeps both sides over the same ids, and the engine's processed log-probs (what the
rollout correction compares) are then over the tokenizer's ids too. VLLMEngine adds it only when the model has such
rows. Importing this module imports vLLM.
"""
from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import LogitsProcessor


class PaddedVocabMask(LogitsProcessor):
    """Logits of ids >= len(tokenizer) -> -inf, for every request (argmax too: greedy must not pick them either)."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        from transformers import AutoTokenizer

        mc = vllm_config.model_config
        self.n_real = len(AutoTokenizer.from_pretrained(mc.tokenizer, trust_remote_code=mc.trust_remote_code))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:  # (num_requests, V)
        if logits.shape[-1] > self.n_real:
            logits[:, self.n_real:] = float("-inf")
        return logits

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update) -> None:
        pass
