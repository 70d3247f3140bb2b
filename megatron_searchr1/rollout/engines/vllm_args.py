"""The vllm.LLM arguments whose default on GPUs differs from the CPU backend's: what the `vllm` engine passes on each.

vLLM 0.32 chooses several settings per platform: `CpuPlatform.check_and_update_config` forces some (async
scheduling off, 128-token KV blocks, the KV cache from $VLLM_CPU_KVCACHE_SPACE), `VllmConfig` turns async scheduling
on where the executor supports it (CUDA, in-process or under torchrun), `EngineArgs.get_batch_defaults` sizes batches
per device. The engine is tested on the CPU (vllm-cpu, CI) and not yet on a GPU, so every such argument is written
down here once, with the value passed on each platform and the reason; `platform_llm_kwargs` is how VLLMEngine builds
its vllm.LLM arguments from it. `LEFT_TO_VLLM` names what vLLM's platform code sets that the engine does not pass.
tests/rollout/engines/test_vllm_engine_unit.py checks that both together cover every field vLLM's CPU and CUDA
platforms set, and that the engine hands vllm.LLM exactly the values below.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

VLLM_DEFAULT = type("VllmDefault", (), {"__repr__": lambda self: "VLLM_DEFAULT"})()
"""A PlatformArg value meaning: pass nothing, vLLM decides (its value is in `vllm_cpu` / `vllm_gpu`)."""


@dataclass(frozen=True)
class EngineInputs:
    """What the table's computed values read: VLLMEngine's own arguments, resolved."""

    kv_cache_gib: Optional[float]
    """The engine's kv_cache_gib (None: the platform's default)."""
    max_model_len: Optional[int]
    """The engine's max_model_len (None: the model config's)."""
    under_torchrun: bool
    """torch.distributed is initialised or torchrun's RANK is set: every rank is one vLLM worker."""


Value = Any  # a constant, VLLM_DEFAULT, or a function (EngineInputs, the kwargs resolved so far) -> either


@dataclass(frozen=True)
class PlatformArg:
    """One vllm.LLM argument: what the engine passes on the CPU and on GPUs, what vLLM would pick, and why."""

    cpu: Value
    """Passed on the CPU backend (VLLM_DEFAULT: nothing; a function: computed from EngineInputs)."""
    gpu: Value
    """Passed on GPUs."""
    vllm_cpu: str
    """vLLM 0.32's own value on the CPU, and where it is set."""
    vllm_gpu: str
    """vLLM 0.32's own value on CUDA, and where it is set."""
    reason: str
    """Why the engine passes what it passes."""
    pinned: bool = False
    """True: a caller's other value (VLLMEngine's llm_kwargs) is refused, the engine depends on this one."""

    def value(self, on_cpu: bool, inputs: EngineInputs, resolved: dict) -> Any:
        v = self.cpu if on_cpu else self.gpu
        return v(inputs, resolved) if callable(v) else v


def _kv_cache_bytes_cpu(inputs: EngineInputs, resolved: dict) -> int:
    from megatron_searchr1.rollout.engines.vllm_cpu import cpu_kv_cache_gib

    return int(cpu_kv_cache_gib(inputs.kv_cache_gib) * 2 ** 30)


def _kv_cache_bytes_gpu(inputs: EngineInputs, resolved: dict) -> Any:
    return VLLM_DEFAULT if inputs.kv_cache_gib is None else int(inputs.kv_cache_gib * 2 ** 30)


def _whole_prefill_tokens(inputs: EngineInputs, resolved: dict) -> Any:
    # without chunking a prompt is prefilled in one step: the step must hold the longest one
    if resolved.get("enable_chunked_prefill") is False and inputs.max_model_len:
        return max(int(inputs.max_model_len), 8192)
    return VLLM_DEFAULT


def _executor(inputs: EngineInputs, resolved: dict) -> Any:
    return "external_launcher" if inputs.under_torchrun else VLLM_DEFAULT


PLATFORM_ARGS: dict[str, PlatformArg] = {
    "async_scheduling": PlatformArg(
        cpu=False, gpu=False, pinned=True,
        vllm_cpu="False (CpuPlatform.check_and_update_config forces it)",
        vllm_gpu="True (VllmConfig, when unset: the uni and external_launcher executors support it)",
        reason="KV sessions drive the scheduler through a hand-written loop, one llm_engine.step() per token, pausing "
               "a request at a stop candidate and resuming it (vllm_sessions.py), and every weight sync aborts them "
               "then resets the prefix cache; async scheduling keeps the next step in flight before this one's "
               "outputs are seen, so a paused or aborted request can still run and reset_prefix_cache() can find "
               "requests running. Everything was tested synchronously (the CPU forces it)"),
    "enforce_eager": PlatformArg(
        cpu=True, gpu=False,
        vllm_cpu="False (CPU: torch.compile, no CUDA graphs)", vllm_gpu="False (torch.compile and CUDA graphs)",
        reason="CPU: no compile warm-up (minutes on 2 cores for a tiny model); GPUs: CUDA graphs (their pool is in "
               "the memory planner). VLLMEngine(enforce_eager=...) overrides it"),
    "enable_sleep_mode": PlatformArg(
        cpu=False, gpu=True,
        vllm_cpu="unsupported (needs CUDA/ROCm/XPU memory pools; True is rejected)", vllm_gpu="False",
        reason="GPUs: the weights and KV cache are freed while the trainer runs (generation and training never "
               "overlap); the CPU has no sleep mode, sleep()/wake_up() are no-ops there"),
    "kv_cache_memory_bytes": PlatformArg(
        cpu=_kv_cache_bytes_cpu, gpu=_kv_cache_bytes_gpu,
        vllm_cpu="$VLLM_CPU_KVCACHE_SPACE GiB (CpuPlatform.check_and_update_config), else a share of host memory",
        vllm_gpu="gpu_memory_utilization x the GPU's memory, less weights and activations",
        reason="CPU: kv_cache_gib, else $VLLM_CPU_KVCACHE_SPACE, else 1 GiB (a share of all host memory would starve "
               "the trainer beside it); GPUs: kv_cache_gib when given, else gpu_memory_utilization's share"),
    "enable_chunked_prefill": PlatformArg(
        cpu=False, gpu=VLLM_DEFAULT,
        vllm_cpu="True (the model supports it)", vllm_gpu="True (the model supports it)",
        reason="CPU: a request with its own seed (seed_per_request) whose prefill is chunked crashes vLLM 0.32's CPU "
               "sampler ('CPU Generator does not use offset'), and multi-turn contexts chunk from the second turn; "
               "GPUs' Philox generators have the offset"),
    "max_num_batched_tokens": PlatformArg(
        cpu=_whole_prefill_tokens, gpu=VLLM_DEFAULT,
        vllm_cpu="4096 x world size (EngineArgs.get_batch_defaults)",
        vllm_gpu="8192; 16384 on GPUs with >= 70 GiB but A100 (EngineArgs.get_batch_defaults)",
        reason="CPU, chunked prefill off: one step must hold the longest prompt, max(max_model_len, 8192)"),
    "max_num_seqs": PlatformArg(
        cpu=VLLM_DEFAULT, gpu=VLLM_DEFAULT,
        vllm_cpu="256 x world size (EngineArgs.get_batch_defaults)",
        vllm_gpu="256; 1024 on GPUs with >= 70 GiB but A100 (EngineArgs.get_batch_defaults)",
        reason="vLLM's on both: a rollout's samples past it queue, and KV sessions size themselves against it "
               "(KVSessions.room); set it through llm_kwargs"),
    "block_size": PlatformArg(
        cpu=32, gpu=VLLM_DEFAULT,
        vllm_cpu="128 (CpuPlatform.check_and_update_config, when unset)",
        vllm_gpu="the attention backend's (16 for FlashAttention)",
        reason="the prefix cache reuses whole blocks: at 128 a new request per turn recomputes up to 127 context "
               "tokens every turn; 32 is the smallest the CPU attention accepts (tools/benchmarks/NOTES-vllm.md). "
               "GPU backends' 16 is already small"),
    "distributed_executor_backend": PlatformArg(
        cpu=_executor, gpu=_executor,
        vllm_cpu="'uni' in one process; 'mp' when VLLM_ENABLE_V1_MULTIPROCESSING=1 (CpuPlatform.check_and_update_"
                 "config), which the engine sets to 0",
        vllm_gpu="'uni' for one GPU, 'mp' for TP > 1",
        reason="under torchrun every rank is one vLLM worker of the SPMD program ('external_launcher'); otherwise "
               "one worker in this process"),
}
"""Every vllm.LLM argument the engine sets per platform (or leaves to vLLM knowingly), in the order they resolve."""

LEFT_TO_VLLM: dict[str, str] = {
    "worker_cls": "the platform's own worker (CPUWorker, the CUDA Worker): nothing to choose",
    "mamba_ssm_cache_dtype": "Mamba / GDN layers only; no supported family has them",
    "enable_dbo": "dual-batch overlap: off by default on both (the CPU forces it off)",
    "cudagraph_capture_sizes": "follows enforce_eager (no CUDA graphs on the CPU)",
    "mode": "the compilation mode: follows enforce_eager (none when eager)",
    "backend": "the compilation backend: follows enforce_eager",
    "inductor_compile_config": "the CPU's inductor settings: follows enforce_eager",
    "ir_enable_torch_wrap": "the CPU's compile IR setting: follows enforce_eager",
    "custom_ops": "ARM CPUs' GELU custom ops: kernels, not behaviour",
    "torch_profiler_dump_cuda_time_total": "profiling only",
    "disable_chunked_mm_input": "multimodal models only",
    "enable_prefix_caching": "VLLMEngine's own argument, the same on both; the CPU turns it off for MLA models "
                             "(DeepSeek) only, which no supported family is",
}
"""Fields vLLM 0.32's CPU or CUDA platform sets in check_and_update_config that the engine does not pass, and why."""


def platform_llm_kwargs(on_cpu: bool, given: dict, inputs: EngineInputs) -> dict:
    """vllm.LLM's keyword arguments: `given` (the caller's; a table entry given as None counts as unset) with every
    PLATFORM_ARGS entry this platform sets filled in. A pinned entry given another value is refused."""
    out = {k: v for k, v in given.items() if not (k in PLATFORM_ARGS and v is None)}
    for name, arg in PLATFORM_ARGS.items():
        value = arg.value(on_cpu, inputs, out)
        if name in out:
            if arg.pinned and out[name] != value:
                raise ValueError(f"{name}={out[name]!r}: the vllm engine runs vLLM with {name}={value!r} "
                                 f"({arg.reason.split(';')[0]}); leave it unset")
            continue
        if value is not VLLM_DEFAULT:
            out[name] = value
    return out

