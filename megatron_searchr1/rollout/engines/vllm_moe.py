"""A mixture-of-experts model in vLLM after a weight sync: the experts' kernel layout rebuilt from what was loaded.

After loading a checkpoint vLLM converts each MoE layer's fused expert weights into the layout its experts backend
reads (`process_weights_after_loading`): FlashInfer CUTLASS swaps the fused [gate; up] halves, FlashInfer TRT-LLM pads
the intermediate size and permutes into its block layout, ROCm AITER shuffles, the CPU backend prepacks for its
grouped GEMM; Triton reads the checkpoint layout as it is. A weight sync writes the checkpoint layout again
(`model.load_weights`), so after every sync the engine runs vLLM's own post-load processing of the whole model, as
NeMo-RL does after each refit (`vllm.model_executor.model_loader.utils.process_weights_after_loading`): vLLM 0.32's
unquantized MoE method redoes the conversion in place on a reload (`_setup_kernel` with its kernel already built:
copied into the same storage, which CUDA graphs captured). The one step that reload path skips is the experts' own
post-load hook, which on the CPU is the prepack: it runs here after vLLM's. Every sync sends every expert
(weight_sync.py), so each conversion starts from the checkpoint layout (a swap done twice would undo itself).

Backends whose reload is not that in-place conversion are refused when the engine starts (`reload_problem`), with
what to change: MoonEP (vLLM raises on an in-place reload), XPU, TPU and out-of-tree backends (not checked), and
quantized MoE methods (the sync sends unquantized weights).
"""
from __future__ import annotations

from typing import Optional, Sequence

RELOADABLE_BACKENDS: dict[str, str] = {
    "TRITON": "reads the checkpoint layout; vLLM's post-load only makes it contiguous",
    "BATCHED_TRITON": "reads the checkpoint layout; vLLM's post-load only makes it contiguous",
    "FLASHINFER_CUTLASS": "vLLM's post-load swaps the loaded [gate; up] halves to [up; gate] again, in place",
    "FLASHINFER_TRTLLM": "vLLM's post-load zeroes the intermediate padding and permutes to its block layout again",
    "AITER": "vLLM's post-load shuffles the loaded weights again, in place",
    "CPU": "vLLM's post-load, then the CPU experts' grouped-GEMM prepack that vLLM's reload path skips (run here)",
}
"""vLLM 0.32's unquantized experts backends (UnquantizedMoeBackend names) whose layout a weight sync rebuilds."""

REFUSED_BACKENDS: dict[str, str] = {
    "MOONEP": "vLLM 0.32 raises on an in-place reload of MoonEP's [E+B] layout; choose another all2all_backend",
    "XPU": "its post-load transposes the parameters themselves, so a reload writes the checkpoint layout into the "
           "transposed shapes (not checked)",
    "TPU": "its post-load is outside vLLM's (not checked)",
    "OOT": "an out-of-tree platform's post-load is its own (not checked)",
}
"""The other backends, and why a sync cannot refresh them; a backend in neither table is refused as not checked."""


def moe_layers(model) -> list[tuple[str, object]]:
    """(name, module) of every MoE experts layer of a vLLM model."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    return [(name, m) for name, m in model.named_modules() if isinstance(m, RoutedExperts)]


def reload_problem(methods: Sequence[tuple[str, object]]) -> Optional[str]:
    """None when every MoE layer's quant method (name, method) is one a weight sync can refresh, else what to change.

    Unquantized layers only (the sync sends the trainer's unquantized weights), on a backend in
    RELOADABLE_BACKENDS."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    for name, method in methods:
        if not isinstance(method, UnquantizedFusedMoEMethod):
            return (f"MoE layer {name} is quantized ({type(method).__name__}): the weight sync sends the trainer's "
                    f"unquantized weights; serve the model unquantized (no `quantization` in the engine's arguments)")
        backend = method.unquantized_backend
        if backend.name not in RELOADABLE_BACKENDS:
            why = REFUSED_BACKENDS.get(backend.name, "not checked")
            return (f"MoE layer {name} runs vLLM's {backend.value} experts backend, whose layout a weight sync cannot "
                    f"rebuild in place: {why}. Run a backend the sync refreshes "
                    f"({', '.join(sorted(RELOADABLE_BACKENDS))}; on GPUs vLLM's moe_backend='triton' is one), or "
                    f"the hf engine")
    return None


def experts_reload_problem(worker) -> Optional[str]:
    """Inside the vLLM worker (collective_rpc), once when the engine starts: reload_problem of its model."""
    return reload_problem([(name, m.quant_method) for name, m in moe_layers(worker.model_runner.model)])


def post_load(worker) -> int:
    """Inside the vLLM worker (collective_rpc), after every weight sync of an MoE model: vLLM's post-load processing
    of the model, then the CPU experts' prepack (the module docstring). Returns the MoE layers processed."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    model = worker.model_runner.model
    with set_current_vllm_config(worker.vllm_config):  # some post-load steps read the current config
        process_weights_after_loading(model, worker.model_config, worker.device)
    layers = moe_layers(model)
    for _, module in layers:
        method = module.quant_method
        if method.unquantized_backend.name == "CPU":  # the experts' own hook: the prepack (reload skips it)
            method.moe_kernel.fused_experts.process_weights_after_loading(module)
    return len(layers)
