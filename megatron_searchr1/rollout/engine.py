"""The rollout engine interface: token ids in, token ids (+ log-probs) out.

    engine = make_engine(cfg)                                  # engines/vllm_engine.py or engines/hf_engine.py
    outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=64, stop=("</search>", "</answer>")))
    outs[0].token_ids, outs[0].logprobs, outs[0].finish_reason   # what the loop keeps, never re-tokenized
    engine.load_weights(iter([(hf_name, tensor), ...]))          # weight sync, bucket by bucket
    engine.sleep(level=2); ...train...; wake_and_sync(engine, sync=lambda: sync_weights(...))

Every engine implements `Engine`. The loop (loop.py) only talks to this interface, so a scripted engine in the
unit tests, the `hf` reference engine and vLLM are interchangeable.

Sessions (optional, `engine.keeps_sessions`): the loop names each prompt by its trajectory,
`engine.generate(prompts, params, sessions=keys)`. An engine that keeps sessions holds each key's KV cache from one
turn to the next; a prompt that extends what it holds for its key computes only the new tokens (a prefix cache can
reuse whole KV blocks only). The result is the same as without sessions; only the compute differs.
`engine.end_sessions(keys)` frees them (all of them without keys). Engines without sessions ignore the keys.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Protocol, Sequence, TypeVar

import torch

T = TypeVar("T")


@dataclass(frozen=True)
class SamplingParams:
    """How one generate() call samples; the same for every prompt of the call."""

    max_tokens: int
    """Most tokens generated per prompt in this call."""
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Top-k sampling; -1 = off."""
    stop: tuple[str, ...] = ()
    """Stop strings; the stop string is kept in the output (the tokens that made it are the last ones)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation (eos); kept in the output."""
    logprobs: bool = True
    """Return the log-prob of each generated token (under the sampling distribution before temperature)."""
    seed: Optional[int] = None
    """Base seed; the vllm engine seeds one random stream per generate() call from it (one seed per prompt with
    seed_per_request), the hf engine one generator per prompt."""

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def derive_seed(seed: int, index: int) -> int:
    """The seed of prompt `index` in a generate() call with base seed `seed` (63 bits): used by the hf engine and by
    vllm's seed_per_request.

    A per-prompt seed makes a sample independent of the other prompts of the call and of how they are batched.

    >>> derive_seed(1, 0) != derive_seed(1, 1) != derive_seed(2, 0)
    True
    """
    return (seed * 1_000_003 + index * 7_919 + 1) % (2 ** 63 - 1)


@dataclass
class Generation:
    """What an engine returns for one prompt."""

    token_ids: list[int]
    """Generated ids, exactly as sampled (stop string / stop token included, nothing after it)."""
    logprobs: list[float]
    """log p(token) of each generated id under the engine's model (same length as token_ids)."""
    finish_reason: str
    """'stop' (a stop string or stop token) or 'length' (max_tokens reached)."""
    stop_reason: Optional[str | int] = None
    """The stop string or stop token id that ended it, None for 'length'."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (not recomputed); for compute accounting."""

    def __post_init__(self):
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"token_ids ({len(self.token_ids)}) and logprobs ({len(self.logprobs)}) differ in length")


class Engine(Protocol):
    """A generation engine the rollout loop can drive."""

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams) -> list[Generation]:
        """One Generation per prompt, in order. Engines with `keeps_sessions` also take `sessions=` (module doc)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take (HF name, full tensor) pairs; may be called many times per sync (one bucket per call)."""

    def finish_weight_sync(self) -> None:
        """Called once after the last bucket of a sync (e.g. reset the prefix cache: cached KV is stale)."""

    def sleep(self, level: int = 1) -> bool:
        """Free generation memory while the trainer runs (level 1: weights to host memory, KV cache dropped;
        level 2: both dropped); no-op where unsupported. True when the weights were dropped: the next wake-up
        must sync them before generating."""

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        """Undo sleep() for these allocations (`WEIGHTS`, `KV_CACHE`; None: all)."""


def keeps_sessions(engine) -> bool:
    """Whether `engine` takes `sessions=` keys in generate() and has end_sessions() (module doc)."""
    return bool(getattr(engine, "keeps_sessions", False))


WEIGHTS, KV_CACHE = "weights", "kv_cache"
"""vLLM's sleep-mode tags: the engine's weights and its KV cache can wake up separately."""


def free_cached_device_memory() -> None:
    """Hand PyTorch's cached but unused CUDA blocks back to the driver, so vLLM can allocate them (no-op without
    CUDA). After an update the caching allocator still holds its activations (~30 GiB for a 7B micro-batch)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def wake_and_sync(engine, sync: Optional[Callable[[], T]] = None,
                  after_sync: Optional[Callable[[], None]] = None) -> Optional[T]:
    """Wake a sleeping engine with the trainer's weights, the order verl's Megatron worker uses (rollout_mode):
    free the allocator's cache, wake the weights only, sync them (`sync`, None when the engine kept them),
    `after_sync` (e.g. offload the actor's parameters, which the sync read), free the cache again, then wake the
    KV cache. The KV cache is allocated last, when the sync's buckets and the trainer's cache are gone: waking
    both before the sync needs the KV cache and the trainer's cached memory at once. Returns sync()'s result."""
    free_cached_device_memory()
    engine.wake_up(tags=[WEIGHTS])
    out = sync() if sync is not None else None
    if after_sync is not None:
        after_sync()
    free_cached_device_memory()
    engine.wake_up(tags=[KV_CACHE])
    return out


def sleep_engine(engine, level: int) -> bool:
    """Put the engine to sleep at `level` (1 or 2); True when its weights were dropped (a sync must follow).

    Level 2 when the next wake-up syncs anyway: level 1 would copy the weights to pinned host memory and back
    every step (14 GiB per GPU for a 7B engine) only to overwrite them."""
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2, got {level}")
    return bool(engine.sleep(level=level))
