"""The `hf` reference engine: plain `transformers` forward passes with a KV cache, written for correctness.

    engine = HFEngine("/path/to/hf_dir")                       # or HFEngine(model, tokenizer=tok)
    outs = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=32, temperature=0, stop=("</answer>",)))

What it promises (the same semantics as the vLLM engine, so the two cross-check each other):
- prompts are token ids; the generated ids are returned exactly as sampled, never re-tokenized;
- temperature 0 is greedy (argmax); otherwise softmax(logits / temperature), then top-k, then top-p;
- `logprobs[i]` is log p(token_i) under the distribution it was sampled from: log_softmax of the logits divided by
  the temperature, after top-k / top-p (vLLM's `processed_logprobs`; at temperature 0 the untempered logits). With
  top-k / top-p off this is what the trainer recomputes at the sampling temperature;
- a stop string ends a sample once the decoded text of its generated ids (special tokens skipped, as vLLM
  detokenizes) contains it; the tokens that made it are the last ones. A stop token id ends it too and is kept.
  Only the ids in `params.stop_token_ids` stop generation: the model's eos is not added implicitly;
- each prompt gets its own torch.Generator seeded from (params.seed, prompt index), so a sample does not depend on
  the other prompts of the batch. (The seeds differ from vLLM's: sampled outputs agree across engines only in
  distribution; greedy outputs agree token for token.)

Prompts are left-padded into one batch (attention mask + explicit position ids, so padding changes nothing but
rounding); finished samples stay in the batch until all are done. It is not fast, and does not need to be.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

from megatron_searchr1.rollout.engine import Generation, SamplingParams, derive_seed


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits outside the top-k and outside the top-p nucleus with -inf.  logits: (V,) -> (V,)"""
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the token that crosses it stays in)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p                       # (V,)
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


class HFEngine:
    """A `transformers` causal LM behind the `Engine` interface (see the module docstring)."""

    def __init__(self, model_or_dir, *, tokenizer=None, dtype: torch.dtype | str = torch.float32,
                 device: str | torch.device = "cpu"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        if isinstance(model_or_dir, str):
            self.model = AutoModelForCausalLM.from_pretrained(model_or_dir, dtype=dtype)
            self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(model_or_dir)
        else:
            if tokenizer is None:
                raise ValueError("HFEngine(model) needs tokenizer=... to check stop strings; "
                                 "or pass the model directory instead")
            self.model, self.tokenizer = model_or_dir.to(dtype), tokenizer
        self.device = torch.device(device)
        self.model.to(self.device).eval()
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else 0  # pad positions are masked out, any id works
        try:  # ids past the tokenizer (a checkpoint's padded embedding rows) are never sampled
            self.real_vocab_size: Optional[int] = len(self.tokenizer)
        except TypeError:  # a tokenizer stand-in without a size (tests): nothing to mask
            self.real_vocab_size = None

    # -- generation -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: Sequence[list[int]], params: SamplingParams) -> list[Generation]:
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        from transformers import DynamicCache

        n, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)                       # (B, T0) left-padded
        mask = torch.zeros((n, width), dtype=torch.long)                                   # (B, T0)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        gens = [self._generator(params.seed, i) for i in range(n)]
        out_ids: list[list[int]] = [[] for _ in range(n)]
        out_lp: list[list[float]] = [[] for _ in range(n)]
        finish: list[Optional[tuple[str, Optional[str | int]]]] = [None] * n
        stop_ids = set(params.stop_token_ids)

        cache = DynamicCache()
        step_ids, positions = ids, (mask.cumsum(-1) - 1).clamp(min=0)                     # (B, T0)
        for _ in range(params.max_tokens):
            logits = self.model(input_ids=step_ids, attention_mask=mask, position_ids=positions,
                                past_key_values=cache, use_cache=True).logits[:, -1, :].float()   # (B, V)
            if self.real_vocab_size is not None and logits.shape[-1] > self.real_vocab_size:
                logits[:, self.real_vocab_size:] = float("-inf")  # a checkpoint's padded rows: no id names them
            nxt = torch.empty(n, dtype=torch.long)
            for i in range(n):
                if finish[i] is not None:
                    nxt[i] = self.pad_id
                    continue
                processed = self._processed(logits[i], params)                              # (V,)
                tok = self._sample(processed, params, gens[i])
                nxt[i] = tok
                out_ids[i].append(tok)
                out_lp[i].append(float(torch.log_softmax(processed, dim=-1)[tok]))
                if tok in stop_ids:
                    finish[i] = ("stop", tok)
                elif params.stop:
                    text = self.tokenizer.decode(out_ids[i], skip_special_tokens=True)
                    hit = [s for s in params.stop if s in text]
                    if hit:  # the earliest-ending stop string in the text is the one that ended it
                        finish[i] = ("stop", min(hit, key=lambda s: text.index(s) + len(s)))
            if all(f is not None for f in finish):
                break
            step_ids = nxt.to(self.device)[:, None]                                        # (B, 1)
            positions = positions[:, -1:] + 1                                              # (B, 1)
            mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=self.device)], dim=1)
        return [Generation(token_ids=out_ids[i], logprobs=out_lp[i] if params.logprobs else [0.0] * len(out_ids[i]),
                           finish_reason=(finish[i] or ("length", None))[0], stop_reason=(finish[i] or (None, None))[1])
                for i in range(n)]

    @staticmethod
    def _generator(seed: Optional[int], index: int) -> torch.Generator:
        g = torch.Generator()
        if seed is None:
            g.seed()
        else:
            g.manual_seed(derive_seed(seed, index))
        return g

    @staticmethod
    def _processed(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """The logits (V,) of the sampling distribution: / temperature, then top-k / top-p (-inf outside);
        unchanged at temperature 0 (greedy), as vLLM leaves them."""
        if params.temperature == 0:
            return logits
        return _filter_logits(logits / params.temperature, params.top_k, params.top_p)

    @staticmethod
    def _sample(processed: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
        """One token from the processed logits (V,) (`_processed`) with the call's sampling settings."""
        if params.temperature == 0:
            return int(torch.argmax(processed))
        probs = torch.softmax(processed, dim=-1)
        return int(torch.multinomial(probs.cpu(), 1, generator=gen))

    # -- weights and memory ------------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (HF name, tensor) pairs into the model in place; an unknown name or a wrong shape is an error."""
        state = self.model.state_dict()
        for name, tensor in weights:
            if name not in state:
                raise KeyError(f"HFEngine.load_weights: {name!r} is not a parameter of the model "
                               f"(names look like {next(iter(state))!r})")
            if state[name].shape != tensor.shape:
                raise ValueError(f"HFEngine.load_weights: {name} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(state[name].shape)}")
            state[name].copy_(tensor)

    def finish_weight_sync(self) -> None:
        """Nothing cached across calls: every generate() starts a fresh KV cache."""

    def sleep(self, level: int = 1) -> bool:
        """No-op: the KV cache lives only inside generate(); the weights stay (False: nothing to sync)."""
        return False

    def wake_up(self, tags=None) -> None:
        """No-op (see sleep)."""

    def close(self) -> None:
        """Drop the model."""
        self.model = None

