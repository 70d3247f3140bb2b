"""VLLMEngine's arguments to vllm.LLM, its sleep / wake-up per tag, its seeding and its vLLM version message, with
vllm.LLM replaced by a double (no engine starts; fast). The real engine is exercised in test_engines.py."""
import logging
import random
from types import SimpleNamespace

import numpy as np
import torch

import pytest

vllm = pytest.importorskip("vllm")

from megatron_searchr1.rollout.engine import KV_CACHE, WEIGHTS, wake_and_sync  # noqa: E402
from megatron_searchr1.rollout.engines import vllm_cpu, vllm_engine  # noqa: E402
from megatron_searchr1.rollout.engines.vllm_engine import VLLM_TESTED, VLLMEngine, vllm_version_problem  # noqa: E402


class FakeLLM:
    """Records its constructor kwargs and the sleep-mode calls; its engine core is not reachable (no sessions)."""

    last = None

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.llm_engine = kwargs, [], None
        FakeLLM.last = self

    def sleep(self, level=1):
        self.calls.append(("sleep", level))
        self.asleep = {WEIGHTS, KV_CACHE}

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))
        self.asleep -= set(tags or (WEIGHTS, KV_CACHE))
        return not self.asleep  # vLLM: whether fully awake

    def collective_rpc(self, fn, args=()):
        self.calls.append(("load", len(args[0])))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))
        return True

    def generate(self, prompts, sampling_params, use_tqdm=True):
        """Samples as vLLM does: a request with a seed from its own generator; one without from the global torch
        RNG in batch order (the V1 model runner) shifted by a draw of numpy's global RNG (Model Runner V2 seeds
        unseeded requests from it); also draws from `random`, as vLLM's helpers may."""
        self.sampling_params = sampling_params
        outs = []
        for prompt, sp in zip(prompts, sampling_params):
            if sp.seed is None:
                ids = ((torch.randint(0, 1000, (sp.max_tokens,)) + int(np.random.randint(1000))) % 1000).tolist()
            else:
                own = torch.Generator().manual_seed(sp.seed)
                ids = torch.randint(0, 1000, (sp.max_tokens,), generator=own).tolist()
            random.random()
            completion = SimpleNamespace(token_ids=ids, finish_reason="length", stop_reason=None,
                                         logprobs=[{t: SimpleNamespace(logprob=-1.0)} for t in ids])
            outs.append(SimpleNamespace(outputs=[completion], num_cached_tokens=0))
        return outs


@pytest.fixture
def platform(monkeypatch):
    """Pretend to be on a GPU (`on_cpu=False`) or the CPU; vllm.LLM is the double."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(vllm, "LLM", FakeLLM)

    def use(on_cpu: bool):
        monkeypatch.setattr(current_platform, "is_cpu", lambda: on_cpu)
        monkeypatch.setattr(current_platform, "is_sleep_mode_available", lambda: not on_cpu)
        if on_cpu:
            monkeypatch.setattr(vllm_cpu, "use_plain_cpu_linear", lambda: None)
    return use


@pytest.mark.parametrize("on_cpu, asked, passed", [(True, None, True), (False, None, False), (False, True, True),
                                                   (True, False, False)])
def test_enforce_eager_auto_is_eager_on_cpu_and_cuda_graphs_on_gpus(platform, on_cpu, asked, passed):
    """rollout.enforce_eager=None (the default) reaches vllm.LLM as True on the CPU (no compile warm-up) and False
    on GPUs (CUDA graphs); an explicit value is passed as it is. Sleep mode only where the platform has it."""
    from megatron_searchr1.config import load_config

    assert load_config(None, []).rollout.enforce_eager is None
    platform(on_cpu)
    VLLMEngine("/model", enforce_eager=asked, kv_sessions=False)
    kw = FakeLLM.last.kwargs
    assert kw["enforce_eager"] is passed
    assert kw["enable_sleep_mode"] is (not on_cpu)
    assert kw["logprobs_mode"] == "processed_logprobs"  # log-probs of the sampling distribution


def test_gpu_sleep_level_2_then_weights_sync_kv_cache(platform):
    """On a GPU: sleep(level) reaches vLLM; wake_and_sync wakes the weights, loads, then the KV cache; generating
    on dropped weights without a sync is refused, as is loading weights that are still asleep."""
    platform(False)
    engine = VLLMEngine("/model", kv_sessions=False)
    llm = FakeLLM.last
    assert engine.sleep(level=2) is True and engine.sleeping
    with pytest.raises(RuntimeError, match="weights sleep"):
        engine.load_weights([("w", None)])
    engine.wake_up([WEIGHTS, KV_CACHE])  # woken without a sync: the weights are garbage
    with pytest.raises(RuntimeError, match="level=2"):
        engine.generate([[1]], vllm_engine.SamplingParams(max_tokens=1))
    engine.sleep(level=2)
    llm.calls.clear()

    def sync():
        engine.load_weights([("w", None)])
        engine.finish_weight_sync()

    wake_and_sync(engine, sync)
    assert llm.calls == [("wake_up", [WEIGHTS]), ("load", 1), ("reset_prefix_cache",), ("wake_up", [KV_CACHE])]
    assert not engine.sleeping and engine.generate([], vllm_engine.SamplingParams(max_tokens=1)) == []
    assert engine.sleep(level=1) is False and llm.calls[-1] == ("sleep", 1)


def test_cpu_sleep_is_a_no_op(platform):
    """vLLM has no sleep mode on the CPU: sleep and wake-up call nothing, the weights stay (no sync needed)."""
    platform(True)
    engine = VLLMEngine("/model", kv_sessions=False, kv_cache_gib=0.1)
    assert engine.sleep(level=2) is False and not engine.sleeping
    engine.wake_up([WEIGHTS])
    assert FakeLLM.last.calls == []


def _rng_states():
    return random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state()


def _same_states(a, b) -> bool:
    return a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def test_one_seeded_stream_per_generate_call(platform):
    """With a seed, a call samples from one stream seeded from it (no request carries a seed of its own, which would
    send vLLM's sampler through its per-request loop): the same batch and seed give the same samples, another seed
    others, and the process-global RNGs are where they were before the call."""
    platform(True)
    engine = VLLMEngine("/model", kv_sessions=False, kv_cache_gib=0.1)
    assert engine.seed_per_request is False
    prompts = [[1, 2], [3], [4, 5, 6]]
    params = vllm_engine.SamplingParams(max_tokens=8, seed=5)
    torch.manual_seed(0)
    before = _rng_states()
    first = engine.generate(prompts, params)
    assert _same_states(_rng_states(), before)  # the trainer's streams are untouched
    assert all(sp.seed is None for sp in FakeLLM.last.sampling_params)
    again = engine.generate(prompts, params)
    assert [g.token_ids for g in again] == [g.token_ids for g in first]
    other = engine.generate(prompts, vllm_engine.SamplingParams(max_tokens=8, seed=6))
    assert [g.token_ids for g in other] != [g.token_ids for g in first]
    # the price: a prompt's sample depends on the batch it is in
    alone = engine.generate(prompts[2:], params)
    assert alone[0].token_ids != first[2].token_ids
    # the stream is the global one seeded from the call's seed, not the state the caller left
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    assert [g.token_ids for g in engine.generate(prompts, params)] == [g.token_ids for g in first]


def test_seed_per_request_gives_each_prompt_its_own_seed(platform):
    """seed_per_request=True: each request carries derive_seed(seed, index), a sample that does not depend on the
    rest of the batch; the global RNGs are neither seeded nor used."""
    platform(True)
    engine = VLLMEngine("/model", kv_sessions=False, kv_cache_gib=0.1, seed_per_request=True)
    prompts = [[1, 2], [3], [4, 5, 6]]
    params = vllm_engine.SamplingParams(max_tokens=8, seed=5)
    outs = engine.generate(prompts, params)
    assert [sp.seed for sp in FakeLLM.last.sampling_params] == [vllm_engine.derive_seed(5, i) for i in range(3)]
    assert engine.generate(prompts[:1], params)[0].token_ids == outs[0].token_ids  # batch-independent
    engine.seed_per_request = False  # the attribute switches it on a running engine
    engine.generate(prompts, params)
    assert all(sp.seed is None for sp in FakeLLM.last.sampling_params)


def test_unseeded_calls_draw_from_the_global_stream(platform):
    """params.seed=None: the engine seeds nothing; samples come from the global RNGs as the caller left them."""
    platform(True)
    engine = VLLMEngine("/model", kv_sessions=False, kv_cache_gib=0.1)
    params = vllm_engine.SamplingParams(max_tokens=8)
    torch.manual_seed(3)
    np.random.seed(3)
    a = engine.generate([[1]], params)[0].token_ids
    assert engine.generate([[1]], params)[0].token_ids != a  # the global stream moved on
    torch.manual_seed(3)
    np.random.seed(3)
    assert engine.generate([[1]], params)[0].token_ids == a


@pytest.mark.parametrize("version, ok", [("0.32.0", True), ("0.32.0+cpu", True), ("0.32.3", True),
                                         ("0.31.2", False), ("0.33.0", False), ("0.33.0rc1", False),
                                         ("1.0.0", False), ("not-a-version", False)])
def test_vllm_version_message(version, ok):
    problem = vllm_version_problem(version)
    assert (problem is None) is ok
    if not ok:
        assert f"vLLM {version} is installed" in problem and f"vllm{VLLM_TESTED}" in problem


def test_engine_warns_outside_the_tested_range(platform, monkeypatch, caplog):
    platform(True)
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    with caplog.at_level(logging.WARNING, logger=vllm_engine.__name__):
        VLLMEngine("/model", kv_sessions=False, kv_cache_gib=0.1)
    assert "vLLM 0.34.0 is installed" in caplog.text and VLLM_TESTED in caplog.text


def test_doctests_of_the_vllm_modules():
    import doctest

    from megatron_searchr1.rollout.engines import vllm_sessions

    for module in (vllm_engine, vllm_sessions):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0, module.__name__


# -- the arguments whose GPU default differs from the CPU's (rollout/engines/vllm_args.py) -------------------------
@pytest.mark.parametrize("on_cpu, expected", [
    (True, dict(async_scheduling=False, enforce_eager=True, enable_sleep_mode=False, kv_cache_memory_bytes=2 ** 30,
                enable_chunked_prefill=False, max_num_batched_tokens=8192, block_size=32)),
    (False, dict(async_scheduling=False, enforce_eager=False, enable_sleep_mode=True)),
], ids=["cpu", "gpu"])
def test_engine_hands_vllm_the_platform_arguments(platform, monkeypatch, on_cpu, expected):
    """What reaches vllm.LLM for every argument in the platform table: async scheduling pinned off on GPUs too (GPU
    vLLM turns it on; the KV sessions' step loop was tested without it), GPUs otherwise left to vLLM's defaults."""
    from megatron_searchr1.rollout.engines.vllm_args import PLATFORM_ARGS

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    platform(on_cpu)
    VLLMEngine("/model", kv_sessions=False, max_model_len=512)
    kw = FakeLLM.last.kwargs
    assert {k: kw[k] for k in PLATFORM_ARGS if k in kw} == expected
    monkeypatch.setenv("RANK", "0")  # under torchrun: one vLLM worker per rank, either platform
    VLLMEngine("/model", kv_sessions=False, kv_cache_gib=0.5)
    assert FakeLLM.last.kwargs["distributed_executor_backend"] == "external_launcher"
    assert FakeLLM.last.kwargs["kv_cache_memory_bytes"] == 2 ** 29


def test_engine_construction_reads_the_table(platform, monkeypatch):
    """The table is what the engine passes, not a description beside it: change an entry, vllm.LLM gets the change."""
    import dataclasses

    from megatron_searchr1.rollout.engines import vllm_args

    platform(False)
    entry = vllm_args.PLATFORM_ARGS["block_size"]
    monkeypatch.setitem(vllm_args.PLATFORM_ARGS, "block_size", dataclasses.replace(entry, gpu=16))
    VLLMEngine("/model", kv_sessions=False)
    assert FakeLLM.last.kwargs["block_size"] == 16


@pytest.mark.parametrize("on_cpu", [True, False], ids=["cpu", "gpu"])
def test_async_scheduling_on_is_refused(platform, on_cpu):
    platform(on_cpu)
    with pytest.raises(ValueError, match="async_scheduling=True: the vllm engine runs vLLM with "
                                         "async_scheduling=False"):
        VLLMEngine("/model", kv_sessions=False, kv_cache_gib=0.1, async_scheduling=True)
    VLLMEngine("/model", kv_sessions=False, kv_cache_gib=0.1, async_scheduling=False)  # the same value: fine


def _fields_set_in(module: str, cls: str, method: str = "check_and_update_config") -> set[str]:
    """Config fields a vLLM method assigns (`x_config.field = ...`) or fills (`x_config.field.update/append(...)`),
    read from the installed source without importing it (the CUDA platform module needs CUDA)."""
    import ast
    import importlib.util

    with open(importlib.util.find_spec(module).origin) as f:
        tree = ast.parse(f.read())
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    fn = next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == method)
    fields = set()
    for node in ast.walk(fn):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for t in targets:
            if isinstance(t, ast.Attribute) and "config" in ast.unparse(t.value):
                fields.add(t.attr)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("update", "append", "extend") and isinstance(node.func.value, ast.Attribute)
                and "config" in ast.unparse(node.func.value.value)):
            fields.add(node.func.value.attr)
    return fields


def test_platform_table_covers_what_vllms_cpu_and_cuda_platforms_set():
    """Every config field vLLM 0.32's CPU or CUDA platform sets is in the table (passed per platform, with a reason)
    or in LEFT_TO_VLLM (with why not); EngineArgs' per-device batch sizes and VllmConfig's async-scheduling choice
    (on where the executor allows it: the GPU default the table pins off) are in the table too."""
    from megatron_searchr1.rollout.engines.vllm_args import LEFT_TO_VLLM, PLATFORM_ARGS

    cpu = _fields_set_in("vllm.platforms.cpu", "CpuPlatform")
    cuda = _fields_set_in("vllm.platforms.cuda", "CudaPlatformBase")
    assert {"async_scheduling", "block_size", "kv_cache_memory_bytes"} <= cpu and "worker_cls" in cuda  # parsed
    undecided = (cpu | cuda) - set(PLATFORM_ARGS) - set(LEFT_TO_VLLM)
    assert not undecided, f"vLLM's platform code sets {sorted(undecided)}: add them to the table or LEFT_TO_VLLM"
    assert not set(PLATFORM_ARGS) & set(LEFT_TO_VLLM)
    assert {"max_num_batched_tokens", "max_num_seqs"} <= set(PLATFORM_ARGS)  # EngineArgs.get_batch_defaults
    assert "async_scheduling" in _fields_set_in("vllm.config.vllm", "VllmConfig", "__post_init__")
    assert PLATFORM_ARGS["async_scheduling"].pinned
    for name, arg in PLATFORM_ARGS.items():
        assert arg.reason and arg.vllm_cpu and arg.vllm_gpu, name
    assert all(LEFT_TO_VLLM.values())
