"""A vLLM logits processor that never samples a checkpoint's padded vocabulary rows, under both of vLLM's model runners.

Checkpoints often pad the embedding past the tokenizer (Qwen2.5: 152,064 rows, 151,665 token ids). vLLM cuts only
its own tensor-parallel padding (at config.vocab_size), so the rows past the tokenizer stay in its softmax and can be
sampled; the trainer's log-probs leave them out (models/gpt.py real_vocab_size). Setting their logits to -inf before
temperature and top-k/top-p keeps both sides over the same ids, and the engine's processed log-probs (what the
rollout correction compares) are then over the tokenizer's ids too. VLLMEngine adds it only when the model has such
rows. Importing this module imports vLLM.

vLLM 0.32 has two logits-processor interfaces, one per model runner, and each runner's loader refuses a class that
does not subclass its own base: the V1 runner (the CPU backend, and GPUs without Triton) builds
`vllm.v1.sample.logits_processor.LogitsProcessor(vllm_config, device, is_pin_memory)`; Model Runner V2 (vLLM's
default on GPUs with Triton) validates `logits_processors` against
`vllm.v1.worker.gpu.sample.logits_processor.LogitsProcessor` when the engine is built (the input processor), then
builds it as `(vllm_config, req_states)`. `PaddedVocabMask` subclasses both, so either runner loads it; the mask is the
same slice either way. (verl instead wraps the model's compute_logits after loading; a processor keeps vLLM's model
untouched and is what vLLM's own loaders check.)
"""
from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor
from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor


def real_vocab_size(vllm_config) -> int:
    """The tokenizer's number of ids (what the trainer's log-probs are over), read from vLLM's model config."""
    from transformers import AutoTokenizer

    mc = vllm_config.model_config
    return len(AutoTokenizer.from_pretrained(mc.tokenizer or mc.model,
                                             trust_remote_code=getattr(mc, "trust_remote_code", False)))


class PaddedVocabMask(V1LogitsProcessor, V2LogitsProcessor):
    """Logits of ids >= len(tokenizer) -> -inf, for every request (argmax too: greedy must not pick them either)."""

    def __init__(self, vllm_config, *runner_args):
        # V1 passes (device, is_pin_memory), V2 passes (req_states): the mask needs neither
        self.n_real = real_vocab_size(vllm_config)

    def apply(self, logits: torch.Tensor, ctx=None) -> torch.Tensor:  # (num_rows, V); V2 passes its LogitsContext
        if logits.shape[-1] > self.n_real:
            logits[:, self.n_real:] = float("-inf")
        return logits

    # -- V1 interface: stateless, and it changes the argmax
    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update) -> None:
        pass

    # -- V2 interface: True = "this processor changes this request's logits". Model Runner V2 skips all logits
    # processing for a batch in which no processor claims a request, so returning False would unmask greedy rows.
    def add_request(self, req_idx: int, sampling_params) -> bool:
        return True
