"""The CPU compatibility layer: active only without CUDA, scoped to megatron-core, and seeding really seeds."""
import pytest
import torch

from megatron_searchr1.megatron import compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is a no-op with CUDA")


@pytest.fixture(scope="module", autouse=True)
def installed():
    assert compat.install_cpu_compat() is True
    assert compat.install_cpu_compat() is True  # idempotent


def test_megatron_sees_the_proxy_and_everyone_else_the_real_torch():
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel.layers as layers

    assert schedules.torch is not torch and layers.torch is not torch
    # megatron's `device="cuda"` factories land on the CPU ...
    t = schedules.torch.zeros([], dtype=torch.int, device="cuda")
    assert t.device.type == "cpu"
    assert schedules.torch.empty(3, device=schedules.torch.cuda.current_device()).device.type == "cpu"
    # ... while the real torch outside megatron is untouched: CUDA requests still fail loudly.
    assert torch.cuda.current_device is not schedules.torch.cuda.current_device
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")


def _call_as(module_name, fn_src):
    scope = {"__name__": module_name, "torch": torch}
    exec(fn_src, scope)
    return scope["f"]


def test_tensor_type_and_cuda_change_only_for_megatron_callers():
    f_meg = _call_as("megatron.core.optimizer.fake", "def f(t):\n    return t.type(), t.cuda()")
    f_ours = _call_as("megatron_searchr1.fake", "def f(t):\n    return t.type()")
    x = torch.zeros(2)
    kind, same = f_meg(x)
    assert kind == "torch.cuda.FloatTensor" and same is x
    assert f_meg(x.bfloat16())[0] == "torch.cuda.BFloat16Tensor"
    assert f_ours(x) == "torch.FloatTensor"
    assert x.type(torch.float64).dtype == torch.float64  # the conversion form still converts
    with pytest.raises((RuntimeError, AssertionError)):
        x.cuda()  # from our code, still an error on a CPU-only machine


def test_model_parallel_seed_seeds_the_cpu_generator():
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    def draw(seed):
        tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=0, ep_rank=0, etp_rank=0)
        outside = torch.randn(4)
        with get_cuda_rng_tracker().fork():
            inside = torch.randn(4)
        return outside, inside

    a, b, c = draw(11), draw(11), draw(12)
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[1], b[1])
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[1], c[1])
    assert not torch.equal(a[0], a[1])  # the TP-region stream is a different stream
    # The default stream is exactly torch.manual_seed(seed): reproducible with plain torch too.
    torch.manual_seed(11)
    torch.testing.assert_close(torch.randn(4), a[0])


def test_event_times_cpu_work():
    import megatron.core.pipeline_parallel.schedules as schedules

    cuda = schedules.torch.cuda
    start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
    start.record()
    torch.randn(200, 200) @ torch.randn(200, 200)
    end.record()
    cuda.synchronize()
    assert start.elapsed_time(end) > 0

