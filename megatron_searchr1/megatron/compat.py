"""Let megatron-core run on a machine without CUDA (CPU tensors, gloo), and do nothing where CUDA exists.

Megatron-core assumes a GPU in a handful of places. Measured on megatron-core 0.16.1, the places a CPU run hits are:
  * `torch.cuda` RNG get/set/seed in `tensor_parallel.random` (without a CPU version, parameter init is unseeded);
  * `torch.cuda.current_device()` / `synchronize()` / `Event` / `Stream` in communication, DDP and schedules;
  * tensor factories called with `device="cuda"` (pipeline schedules, grad clipping, optimizers, grad scaler);
  * `Tensor.type()` strings compared with `'torch.cuda.FloatTensor'` (optimizers, grad clipping);
  * `Tensor.cuda()` (optimizer state loading).

How narrow this is:
  * megatron-core modules see a *module-scoped* `torch` proxy (their global name `torch` is rebound); everything else
    in the process - our code, transformers, torch itself - keeps the real `torch` and real `torch.cuda`.
  * the two Tensor methods are wrapped, but change behaviour only when called from a `megatron.core` frame.
  * nothing is touched when `torch.cuda.is_available()`.

Call `install_cpu_compat()` once, after megatron-core is importable and before building models; it is idempotent.
Megatron modules imported later (lazily) are covered by calling it again (`initialize_megatron` does).
"""
from __future__ import annotations

import contextlib
import importlib
import sys
import time
import types

import torch

# Megatron modules imported up front so the proxy reaches them. Anything megatron-core imports lazily after
# install_cpu_compat() and that hits a CUDA-only call will raise loudly (not silently misbehave): add it here.
_MEGATRON_MODULES = (
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.data",
    "megatron.core.tensor_parallel.cross_entropy",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.module",
    "megatron.core.dist_checkpointing.serialization",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.utils",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.shared_experts",
)

_CPU = torch.device("cpu")
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint", "as_tensor")
_installed = False


def _to_cpu_device(device):
    """Map any CUDA device spelling (str, int, torch.device) to the CPU; leave the rest alone."""
    if device is None:
        return None
    if isinstance(device, int):
        return _CPU
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


def _cpu_factory(fn):
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    wrapper.__name__ = getattr(fn, "__name__", "factory")
    return wrapper


class _Event:
    """CPU stand-in for torch.cuda.Event: records wall time so elapsed_time() still means something."""

    def __init__(self, enable_timing: bool = False, **_):
        self._t = None

    def record(self, stream=None):
        self._t = time.perf_counter()

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_Event") -> float:
        return (end._t - self._t) * 1000.0


class _Stream:
    """CPU stand-in for torch.cuda.Stream: CPU work is already ordered."""

    def __init__(self, *_, **__):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        event = event or _Event()
        event.record()
        return event


def _make_cuda_shim() -> types.SimpleNamespace:
    """What megatron-core reaches through `torch.cuda` on a CPU machine: one CPU generator, no-op sync."""

    def get_rng_state(device="cuda"):
        return torch.get_rng_state()

    def set_rng_state(new_state, device="cuda"):
        torch.set_rng_state(new_state)

    random = types.SimpleNamespace(get_rng_state=get_rng_state, set_rng_state=set_rng_state)
    shim = types.SimpleNamespace(
        is_available=lambda: False,
        device_count=lambda: 0,
        current_device=lambda: _CPU,
        synchronize=lambda device=None: None,
        empty_cache=lambda: None,
        memory_allocated=lambda device=None: 0,
        max_memory_allocated=lambda device=None: 0,
        manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed,
        get_rng_state=get_rng_state,
        set_rng_state=set_rng_state,
        random=random,
        Event=_Event,
        Stream=_Stream,
        stream=lambda s=None: contextlib.nullcontext(),
        current_stream=lambda device=None: _Stream(),
        default_stream=lambda device=None: _Stream(),
        nvtx=types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None,
                                   range=lambda *a, **k: contextlib.nullcontext()),
    )
    return shim


class _TorchProxy(types.ModuleType):
    """`torch` as seen by megatron-core on the CPU: CUDA devices become the CPU, `torch.cuda` is the shim."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _make_cuda_shim()
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):  # only called for names not set above
        return getattr(torch, name)


def _called_from_megatron() -> bool:
    frame = sys._getframe(2)  # 0: this function, 1: the wrapper, 2: its caller
    return frame.f_globals.get("__name__", "").startswith("megatron.core")


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def _patch_tensor_methods() -> None:
    real_type, real_cuda = torch.Tensor.type, torch.Tensor.cuda

    def type_(self, *args, **kwargs):
        # Megatron checks `param.type() == 'torch.cuda.FloatTensor'`; answer as if the CPU tensor were on the GPU.
        if not args and not kwargs and _called_from_megatron() and self.dtype in _CUDA_TYPE_NAMES:
            return _CUDA_TYPE_NAMES[self.dtype]
        return real_type(self, *args, **kwargs)

    def cuda(self, *args, **kwargs):
        if _called_from_megatron():
            return self
        return real_cuda(self, *args, **kwargs)

    torch.Tensor.type = type_
    torch.Tensor.cuda = cuda


def _set_cpu_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def _get_cpu_rng_state(device="cuda", clone=False, graph_safe=False):
    return torch.get_rng_state()


def install_cpu_compat() -> bool:
    """Make megatron-core usable on the CPU. Returns True when the layer is active, False on a CUDA machine."""
    global _installed
    if torch.cuda.is_available():
        return False
    proxy = _PROXY
    for name in _MEGATRON_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # a module renamed in a newer megatron-core: the scan below still covers the rest
            pass
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(module, "torch", None) is torch:
            module.torch = proxy
    random_mod = sys.modules.get("megatron.core.tensor_parallel.random")
    if random_mod is not None:
        random_mod._set_cuda_rng_state = _set_cpu_rng_state
        random_mod._get_cuda_rng_state = _get_cpu_rng_state
    _patch_moe()
    if not _installed:
        _patch_tensor_methods()
        _installed = True
    return True


def _split_sizes_to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """moe_utils.maybe_move_tensor_to_cpu that also turns a CPU tensor into numpy when asked: Megatron converts only
    CUDA tensors, so on the CPU the alltoall dispatcher hands torch tensors as `all_to_all_single` split sizes,
    which it refuses (TypeError: it wants a list of ints, as numpy's arrays convert)."""
    if torch.is_tensor(tensor) and as_numpy and not tensor.is_cuda:
        return tensor.numpy()
    return _ORIGINAL_MOVE_TO_CPU(tensor, as_numpy=as_numpy, record_stream=record_stream)


_ORIGINAL_MOVE_TO_CPU = None


def _patch_moe() -> None:
    """The two MoE places a CPU run hits (megatron-core 0.16.1): moe_utils refers to `te_general_gemm` (the router's
    GEMM) without defining it when Transformer Engine is absent (NameError), and the alltoall dispatcher's split
    sizes (`_split_sizes_to_host`)."""
    global _ORIGINAL_MOVE_TO_CPU
    moe_utils = sys.modules.get("megatron.core.transformer.moe.moe_utils")
    if moe_utils is None:
        return
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if _ORIGINAL_MOVE_TO_CPU is None:
        _ORIGINAL_MOVE_TO_CPU = moe_utils.maybe_move_tensor_to_cpu
    for name in ("megatron.core.transformer.moe.moe_utils", "megatron.core.transformer.moe.token_dispatcher"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "maybe_move_tensor_to_cpu", None) is _ORIGINAL_MOVE_TO_CPU:
            module.maybe_move_tensor_to_cpu = _split_sizes_to_host


_PROXY = _TorchProxy()
