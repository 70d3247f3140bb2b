"""megatron/offload.py on a tiny real Megatron actor + optimizer (one process, gloo): offload -> reload gives back
the same bits and the same training; each flag empties exactly its own storages, byte for byte."""
import os
from types import SimpleNamespace

import pytest
import torch

from megatron_searchr1.megatron.offload import GenerationOffload, Stash, offload_grads
from tests.rl_fixtures import grpo_run, rl_root, run_module, server, tiny_model, world  # noqa: F401 (fixtures)

COMBOS = [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True), (torch.bfloat16, True)]
"""(params dtype, distributed optimizer): FP32Optimizer, Float16Optimizer (fp32 masters), DistributedOptimizer
with an fp32 and a bf16 parameter buffer."""


@pytest.fixture(scope="module")
def megatron_world():
    import torch.distributed as dist

    from megatron_searchr1.megatron.initialize import destroy_megatron, initialize_megatron

    if dist.is_initialized():
        pytest.fail("a process group from an earlier test is still alive: that test leaks it", pytrace=False)
    saved = {k: os.environ.pop(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
             if k in os.environ}
    initialize_megatron(tp=1, pp=1, seed=3)
    yield
    destroy_megatron()
    os.environ.update(saved)


def _hf_config():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False, attention_dropout=0.0)


def _actor(dtype, dist_opt, state=None):
    from megatron_searchr1.megatron.optimizer import build_optimizer
    from megatron_searchr1.trainer.roles import build_actor

    load = None if state is None else (lambda bare: bare.load_state_dict(state))
    model = build_actor(_hf_config(), params_dtype=dtype, use_distributed_optimizer=dist_opt, load_weights=load)
    opt, _ = build_optimizer(model, lr=1e-2, weight_decay=0.01)
    return model, opt


def _step(model, opt, seed):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed))

    def forward_step(data_iterator, model):
        toks = next(data_iterator)
        pos = torch.arange(16).unsqueeze(0).expand_as(toks)
        out = model(toks[:, :-1], pos[:, :-1], None, labels=toks[:, 1:])
        return out, lambda per_token: (per_token.float().mean(), {})

    model.zero_grad_buffer()
    opt.zero_grad()
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([tokens]), model=[model],
                                num_microbatches=1, seq_length=15, micro_batch_size=2, forward_only=False)
    ok, _, _ = opt.step()
    assert ok


def _opt_tensors(opt):
    from megatron_searchr1.megatron.offload import _optimizer_tensors

    return _optimizer_tensors(opt)


def _flags(**on):
    names = ("param_offload", "grad_offload", "optimizer_offload", "ref_offload")
    return SimpleNamespace(**{n: bool(on.get(n)) for n in names})


def _nbytes(t):
    return t.untyped_storage().nbytes()


def _expected_bytes(model, opt, ref):
    """What each kind holds, counted from the objects (not from the stash)."""
    from megatron_searchr1.megatron.offload import _ddp_buffers

    bufs = _ddp_buffers(model)
    if all(b.param_data is not None for b in bufs):  # distributed optimizer: the params are views of one buffer
        params = sum(b.param_data.numel() * b.param_data.element_size() for b in bufs)
    else:
        params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"params": params,
            "grads": sum(b.grad_data.numel() * b.grad_data.element_size() for b in bufs),
            "optimizer": sum(t.numel() * t.element_size() for t in _opt_tensors(opt)),
            "ref": sum(p.numel() * p.element_size() for p in ref.parameters())}


@pytest.mark.parametrize("dtype, dist_opt", COMBOS)
def test_offload_reload_is_bit_identical_and_training_continues_identically(megatron_world, dtype, dist_opt):
    from megatron_searchr1.trainer.roles import build_reference

    model, opt = _actor(dtype, dist_opt)
    twin, twin_opt = _actor(dtype, dist_opt, state=model.module.state_dict())
    ref = build_reference(_hf_config(), params_dtype=dtype)
    for m, o in ((model, opt), (twin, twin_opt)):
        _step(m, o, seed=1)  # Adam's state exists from here
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    states = [t.clone() for t in _opt_tensors(opt)]
    assert states, "no optimizer state to offload"
    ref_params = [p.detach().clone() for p in ref.parameters()]
    expected = _expected_bytes(model, opt, ref)

    off = GenerationOffload(_flags(param_offload=True, grad_offload=True, optimizer_offload=True, ref_offload=True),
                            actor=model, actor_opt=opt, ref=ref)
    off.before_wake()
    assert all(_nbytes(p) > 0 for p in model.parameters())  # the sync still reads the actor's weights
    assert all(_nbytes(t) == 0 for t in _opt_tensors(opt))
    assert all(_nbytes(b.grad_data) == 0 for b in model.buffers)
    assert all(_nbytes(p) == 0 for p in ref.parameters())
    off.after_sync()
    assert all(_nbytes(p) == 0 for p in model.parameters())
    assert off.reload() == expected

    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]), n
    for t, before in zip(_opt_tensors(opt), states):
        assert torch.equal(t, before)
    assert all(torch.equal(p, b) for p, b in zip(ref.parameters(), ref_params))
    assert all(torch.count_nonzero(b.grad_data) == 0 for b in model.buffers)
    for m, o in ((model, opt), (twin, twin_opt)):
        _step(m, o, seed=2)
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), n
    for a, b in zip(_opt_tensors(opt), _opt_tensors(twin_opt)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype, dist_opt", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False)])
def test_offload_round_trip_with_transformer_engines_fused_adam_layout(megatron_world, monkeypatch, dtype, dist_opt):
    """The GPU optimizer's state layout (TE FusedAdam: step in the param groups, master_param in the state, scales
    beside it; tests/megatron/te_layout_adam.py) through the same offload: every state tensor and scale is emptied and
    comes back bit-identical, the group step is untouched, and training continues as a twin that never offloaded."""
    from megatron_searchr1.megatron.offload import _optimizer_tensors
    from tests.megatron.te_layout_adam import TeLayoutAdam, te_layout_adam

    with te_layout_adam(monkeypatch):
        model, opt = _actor(dtype, dist_opt)
        twin, twin_opt = _actor(dtype, dist_opt, state=model.module.state_dict())
    inner = [o.optimizer for o in getattr(opt, "chained_optimizers", [opt])]
    assert all(isinstance(o, TeLayoutAdam) for o in inner)
    for m, o in ((model, opt), (twin, twin_opt)):
        _step(m, o, seed=1)
    for o in inner:  # the layout: no per-parameter step, a step per non-empty group, master weights in the state
        o.master_weights = True
        for group in o.param_groups:
            for p in group["params"]:
                o.state[p]["master_param"] = p.detach().clone().float() + 1
                o._scales.setdefault(p, {})["exp_avg"] = torch.full([1], 2.0)
        assert all("step" not in st for st in o.state.values())
    steps = [g.get("step") for o in inner for g in o.param_groups]
    assert 1 in steps
    states = [t.clone() for t in _optimizer_tensors(opt)]
    masters = [st["master_param"] for o in inner for st in o.state.values()]
    scales = [s["exp_avg"] for o in inner for s in o._scales.values()]
    off = GenerationOffload(_flags(optimizer_offload=True), actor=model, actor_opt=opt)
    off.before_wake()
    assert all(_nbytes(t) == 0 for t in masters + scales), "TE's master_param or _scales stayed on the device"
    assert all(_nbytes(t) == 0 for t in _optimizer_tensors(opt))
    moved = off.reload()["optimizer"]
    assert moved == sum(t.numel() * t.element_size() for t in states)
    assert all(torch.equal(a, b) for a, b in zip(_optimizer_tensors(opt), states, strict=True))
    assert [g.get("step") for o in inner for g in o.param_groups] == steps
    for o in inner:
        o.master_weights = False
        for st in o.state.values():
            del st["master_param"]
        o._scales.clear()
    for m, o in ((model, opt), (twin, twin_opt)):
        _step(m, o, seed=2)
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), n


def test_a_float8_state_wrapper_is_offloaded_through_its_inner_data():
    """TE keeps an fp8 Adam state as a Float8Tensor, a wrapper whose bytes are its `_data` (and `_scale_inv`): the
    offload empties and restores those."""
    from megatron_searchr1.megatron.offload import _state_tensors, offload_optimizer

    class Float8Like(torch.Tensor):
        @staticmethod
        def __new__(cls, data, scale_inv):
            t = torch.Tensor._make_subclass(cls, torch.empty(0), False)
            t._data, t._scale_inv = data, scale_inv
            return t

    data, scale = torch.arange(16, dtype=torch.uint8), torch.tensor([0.5])
    fp8 = Float8Like(data, scale)
    assert _state_tensors(fp8) == [data, scale] and _state_tensors(data) == [data]
    param = torch.nn.Parameter(torch.zeros(16))
    inner = SimpleNamespace(state={param: {"exp_avg": fp8}})
    stash = Stash()
    offload_optimizer(SimpleNamespace(optimizer=inner), stash)
    assert _nbytes(data) == 0 and _nbytes(scale) == 0 and stash.moved_bytes == {"optimizer": 16 + 4}
    stash.reload()
    assert torch.equal(fp8._data, torch.arange(16, dtype=torch.uint8)) and torch.equal(fp8._scale_inv, scale)


FLAGS = {"param_offload": {"params"}, "grad_offload": {"grads"}, "optimizer_offload": {"optimizer"},
         "ref_offload": {"ref"}}


@pytest.mark.parametrize("flag", list(FLAGS))
@pytest.mark.parametrize("dtype, dist_opt", [(torch.float32, False), (torch.bfloat16, True)])
def test_each_flag_moves_exactly_its_own_buffers(megatron_world, flag, dtype, dist_opt):
    """One flag on: only its storages are emptied (their exact byte count), every other one keeps its size."""
    from megatron_searchr1.trainer.roles import build_reference

    model, opt = _actor(dtype, dist_opt)
    _step(model, opt, seed=1)
    ref = build_reference(_hf_config(), params_dtype=dtype)
    groups = {"params": list(model.parameters()), "grads": [b.grad_data for b in model.buffers],
              "optimizer": _opt_tensors(opt), "ref": list(ref.parameters())}
    sizes = {k: [_nbytes(t) for t in ts] for k, ts in groups.items()}
    off = GenerationOffload(_flags(**{flag: True}), actor=model, actor_opt=opt, ref=ref)
    off.before_wake()
    off.after_sync()
    for kind, tensors in groups.items():
        emptied = [_nbytes(t) == 0 for t in tensors]
        assert all(emptied) if kind in FLAGS[flag] else not any(emptied), kind
    moved = off.reload()
    assert set(moved) == FLAGS[flag]
    kind = next(iter(FLAGS[flag]))
    assert moved[kind] == _expected_bytes(model, opt, ref)[kind]
    assert {k: [_nbytes(t) for t in ts] for k, ts in groups.items()} == sizes


def test_no_flag_touches_nothing(megatron_world):
    model, opt = _actor(torch.float32, False)
    _step(model, opt, seed=1)
    off = GenerationOffload(_flags(), actor=model, actor_opt=opt)
    off.before_wake()
    off.after_sync()
    assert off.stash.empty and off.reload() == {}


def test_offloading_twice_moves_nothing_more(megatron_world):
    """An emptied storage is skipped (an engine woken twice before the reload does not lose the host copy)."""
    model, opt = _actor(torch.float32, False)
    stash = Stash()
    offload_grads(model, stash)
    offload_grads(model, stash)
    assert len(stash.freed) == len(model.buffers)
    stash.reload()
    assert all(_nbytes(b.grad_data) > 0 for b in model.buffers)


@pytest.mark.slow
def test_grpo_with_every_offload_flag_equals_the_run_without(grpo_run, world, tiny_model, server, rl_root):
    """The trainer's wiring (trainer/roles.py RolloutWorker.sync / sleep) on the CPU demo's GRPO at TP=2 with the vllm
    engine and a reference model: 2 steps with every model.*_offload flag give the same metrics, bit for bit, as
    the first 2 steps of the same run without offload (tests/rl_fixtures.py's grpo_run, which other tests share):
    the offload is exercised and changes nothing."""
    from tests.test_train import STEP_FIELDS_THAT_VARY, rl_args, step_metrics

    plain_out, plain_log = grpo_run
    out = os.path.join(rl_root, "offload")
    flags = ["model.param_offload=true", "model.grad_offload=true", "model.optimizer_offload=true",
             "model.ref_offload=true"]
    proc = run_module("megatron_searchr1.train", rl_args(world, tiny_model, server, out, "trainer.total_steps=2",
                                                         "trainer.save_freq=0", "trainer.export_hf=false", *flags),
                      nproc=2)
    want, got = step_metrics(plain_out), step_metrics(out)
    assert "offloaded to host memory" not in plain_log
    line = [x for x in (proc.stdout + proc.stderr).splitlines() if "offloaded to host memory" in x][-1]
    assert all(kind in line for kind in ("grads", "optimizer", "params", "ref")), line
    assert sorted(got) == [1, 2]
    for step in (1, 2):
        keys = [k for k in want[step] if not k.startswith(STEP_FIELDS_THAT_VARY)]
        diff = {k: (want[step][k], got[step].get(k)) for k in keys if want[step][k] != got[step].get(k)}
        assert not diff, f"step {step} differs: {diff}"
    assert want[2]["actor/entropy"] != want[1]["actor/entropy"]  # the update moved the policy: not vacuous
