"""initialize_megatron: a world of one outside torchrun, and real torchrun runs of our model through Megatron DDP +
get_megatron_optimizer at TP=2 and DP=2 (distributed optimizer), one step each, against a single-process reference."""
import os
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_torchrun

SCRIPT = Path(__file__).with_name("ddp_step_script.py")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "ref.pt"
    run_torchrun(SCRIPT, 1, "--tp", "1", "--out", out, timeout=300)
    return torch.load(out)


def _assert_same_step(ref, got):
    assert got["loss"] == pytest.approx(ref["loss"], abs=1e-6)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert ref["params"].keys() == got["params"].keys()
    for name, want in ref["params"].items():
        # Adam's first step is ~lr*sign(g): float-order noise in tiny grads moves it a little, never by a step.
        torch.testing.assert_close(got["params"][name], want, atol=1e-4, rtol=0, msg=name)


@pytest.mark.parametrize("nproc,extra", [(2, ["--tp", "2"]), (2, ["--tp", "1", "--distributed-optimizer"])],
                         ids=["tp2-ddp", "dp2-distributed-optimizer"])
def test_one_optimizer_step_matches_single_process(reference, tmp_path, nproc, extra):
    out = tmp_path / "got.pt"
    run_torchrun(SCRIPT, nproc, *extra, "--out", out, timeout=300)
    got = torch.load(out)
    _assert_same_step(reference, got)


def test_seeded_run_is_reproducible_and_the_step_moves_weights(reference, tmp_path):
    out = tmp_path / "again.pt"
    run_torchrun(SCRIPT, 1, "--tp", "1", "--out", out, timeout=300)
    again = torch.load(out)
    _assert_same_step(reference, again)  # seeded init + data: identical run to run
    for name in ("embedding.word_embeddings.weight", "decoder.layers.0.mlp.linear_fc1.weight"):
        assert (reference["params"][name] - reference["before"][name]).abs().max() > 1e-3, name


def test_a_world_of_one_cleans_up_its_environment(monkeypatch):
    """initialize_megatron outside torchrun sets RANK/MASTER_PORT...; destroy must remove them again, or a
    subprocess started later inherits a rendezvous that no longer exists (EADDRINUSE)."""
    import os

    import torch.distributed as dist

    from megatron.core import parallel_state as mpu
    from megatron_searchr1.megatron.initialize import destroy_megatron, initialize_megatron

    if dist.is_initialized():
        pytest.fail("a process group from an earlier test is still alive: that test leaks it", pytrace=False)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    initialize_megatron(tp=1, pp=1, seed=3)
    try:
        assert mpu.get_tensor_model_parallel_world_size() == 1 and dist.get_world_size() == 1
        assert os.environ["RANK"] == "0"
        with pytest.raises(ValueError, match="nproc_per_node 2"):
            initialize_megatron(tp=2, pp=1)  # one process cannot hold TP=2: the message says how to launch
    finally:
        destroy_megatron()
    assert "RANK" not in os.environ and "MASTER_PORT" not in os.environ
    assert not dist.is_initialized()


# ------------------------------------------------------------------------------------------------ device choice
def test_no_gpu_anywhere_is_cpu_mode_without_asking():
    from megatron_searchr1.megatron.initialize import resolve_device

    assert resolve_device(cuda_available=False, env={}, nvidia_devices=[]) == "cpu"
    assert resolve_device(cuda_available=False, env={"CUDA_VISIBLE_DEVICES": ""}, nvidia_devices=[]) == "cpu"
    assert resolve_device(cuda_available=True, env={}, nvidia_devices=["/dev/nvidia0"]) == "cuda"


@pytest.mark.parametrize("env, devices, reason", [
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, [], "CUDA_VISIBLE_DEVICES=0,1"),
    ({"LOCAL_RANK": "3"}, ["/dev/nvidia3", "/dev/nvidia0"], "/dev/nvidia0"),
    ({"MEGATRON_SEARCHR1_DEVICE": "cuda"}, [], "MEGATRON_SEARCHR1_DEVICE=cuda was asked for"),
])
def test_a_gpu_launch_without_cuda_is_refused_not_run_on_cpus(env, devices, reason):
    from megatron_searchr1.megatron.initialize import resolve_device

    with pytest.raises(RuntimeError, match="expects GPUs") as e:
        resolve_device(cuda_available=False, env=env, nvidia_devices=devices)
    assert reason in str(e.value) and "MEGATRON_SEARCHR1_DEVICE=cpu" in str(e.value)  # says how to override
    # CPU mode on purpose: the env var or the argument
    assert resolve_device(cuda_available=False, env={**env, "MEGATRON_SEARCHR1_DEVICE": "cpu"},
                          nvidia_devices=devices) == "cpu"
    if "MEGATRON_SEARCHR1_DEVICE" not in env:
        assert resolve_device("cpu", cuda_available=False, env=env, nvidia_devices=devices) == "cpu"
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        resolve_device("tpu", cuda_available=False, env=env, nvidia_devices=devices)


def test_initialize_refuses_a_gpu_launch_without_cuda(monkeypatch):
    """The check runs before any process group starts (nothing to clean up, no gloo world on a GPU job)."""
    import torch.distributed as dist

    from megatron_searchr1.megatron.initialize import initialize_megatron

    if torch.cuda.is_available():
        pytest.skip("checks a machine without CUDA")
    if dist.is_initialized():
        pytest.fail("a process group from an earlier test is still alive: that test leaks it", pytrace=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.delenv("MEGATRON_SEARCHR1_DEVICE", raising=False)
    with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES=0"):
        initialize_megatron(tp=1, pp=1)
    assert not dist.is_initialized()


def test_cuda_process_group_carries_gloo_for_cpu_tensors_and_connects_lazily_on_the_local_gpu(monkeypatch):
    """On CUDA the default group has a CPU backend beside NCCL (an NCCL-only group refuses the CPU tensors of
    metrics and counts); on the CPU gloo alone. No device is bound (a bound default group connects every Megatron
    group eagerly, each with its NCCL buffers), so the rank's GPU must be selected before the group starts: the
    recorded calls of a CUDA start-up are set_device(LOCAL_RANK), then init_process_group without device_id."""
    import megatron_searchr1.megatron.initialize as init

    nccl = init.process_group_kwargs("cuda", 3, 5)
    assert nccl["backend"] == "cpu:gloo,cuda:nccl" and "device_id" not in nccl
    assert nccl["timeout"].total_seconds() == 300
    gloo = init.process_group_kwargs("cpu", 3, 7)
    assert gloo["backend"] == "gloo" and "device_id" not in gloo
    assert gloo["timeout"].total_seconds() == 420

    calls = []
    monkeypatch.setattr(init.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(init.torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(init.dist, "init_process_group", lambda **kw: calls.append(("init_process_group", kw)))
    for key, value in dict(RANK="5", LOCAL_RANK="1", WORLD_SIZE="8", MASTER_ADDR="h", MASTER_PORT="1").items():
        monkeypatch.setenv(key, value)
    init._init_process_group(5, "cuda")
    assert [c[0] for c in calls] == ["set_device", "init_process_group"] and calls[0][1] == 1
    assert "device_id" not in calls[1][1] and calls[1][1]["backend"] == "cpu:gloo,cuda:nccl"


def test_the_backend_string_gives_every_megatron_subgroup_a_cpu_backend():
    """Megatron makes its TP/PP/DP groups with backend=None, which inherit the default group's backend string:
    with `cpu:gloo,...` a CPU tensor works on each of them (checked here with the CPU half of the string)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    if dist.is_initialized():
        pytest.fail("a process group from an earlier test is still alive: that test leaks it", pytrace=False)
    from megatron_searchr1.megatron.initialize import process_group_kwargs

    assert process_group_kwargs("cuda", 0, 1)["backend"].startswith("cpu:gloo,")
    store = dist.HashStore()
    dist.init_process_group(backend="cpu:gloo", store=store, rank=0, world_size=1)
    try:
        mpu.initialize_model_parallel(1, 1)
        for group in (mpu.get_tensor_model_parallel_group(), mpu.get_pipeline_model_parallel_group(),
                      mpu.get_data_parallel_group(), mpu.get_model_parallel_group()):
            assert "cpu:gloo" in str(dist.get_backend_config(group))
            t = torch.ones(2, dtype=torch.float64)
            dist.all_reduce(t, group=group)
            assert t.tolist() == [1.0, 1.0]
    finally:
        mpu.destroy_model_parallel()
        dist.destroy_process_group()


def test_initialize_passes_the_configured_timeout_and_backend(monkeypatch):
    """What initialize_megatron hands to init_process_group and Megatron: the timeout from
    parallel.timeout_minutes (not a fixed 30 minutes)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megatron_searchr1.megatron import initialize

    if dist.is_initialized():
        pytest.fail("a process group from an earlier test is still alive: that test leaks it", pytrace=False)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    seen = {}
    real_init, real_mp = dist.init_process_group, mpu.initialize_model_parallel
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: (seen.update(pg=kw), real_init(**kw))[1])
    monkeypatch.setattr(mpu, "initialize_model_parallel",
                        lambda **kw: (seen.update(mp=kw), real_mp(**kw))[1])
    initialize.initialize_megatron(tp=1, pp=1, timeout_minutes=11, device="cpu")
    try:
        assert seen["pg"]["backend"] == "gloo" and seen["pg"]["timeout"].total_seconds() == 11 * 60
        assert seen["mp"]["distributed_timeout_minutes"] == 11
    finally:
        initialize.destroy_megatron()


@pytest.mark.parametrize("device,tp,sp,want", [
    ("cuda", 2, False, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}), ("cuda", 4, True, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),
    ("cuda", 1, False, {}), ("cpu", 2, False, {}), ("cpu", 2, True, {})])
def test_cuda_device_max_connections_where_megatron_overlaps_tp_communication(device, tp, sp, want):
    from megatron_searchr1.megatron.initialize import cuda_env

    assert cuda_env(device, tp, sp) == want


def test_cuda_env_is_set_before_cuda_and_a_user_value_is_kept(monkeypatch):
    from megatron_searchr1.megatron import initialize

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    initialize._apply_cuda_env({"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    with pytest.warns(UserWarning, match="kept as set"):
        initialize._apply_cuda_env({"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"


def test_seed_is_offset_per_pipeline_stage(monkeypatch):
    """Megatron-LM's rule: seed + 100 * pp_rank (pipeline stages initialise different layers from different
    streams); the trainer relies on it."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megatron_searchr1.megatron.initialize import destroy_megatron, initialize_megatron, seed_everything

    if dist.is_initialized():
        pytest.fail("a process group from an earlier test is still alive: that test leaks it", pytrace=False)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    initialize_megatron(tp=1, pp=1, seed=7)
    try:
        assert torch.initial_seed() == 7
        first = torch.rand(4)
        monkeypatch.setattr(mpu, "get_pipeline_model_parallel_rank", lambda: 2)
        assert seed_everything(7) == 207 and torch.initial_seed() == 207
        assert not torch.equal(torch.rand(4), first)
    finally:
        destroy_megatron()
