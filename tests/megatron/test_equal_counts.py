"""schedule.equal_micro_batch_count and the padding it adds, without processes: two DP ranks of an EP=2 MoE model are
simulated by a fake DP all-reduce (the torchrun run at EP=2 is tests/megatron/test_moe_training.py)."""
from types import SimpleNamespace

import pytest
import torch

from megatron_searchr1.megatron import schedule
from megatron_searchr1.megatron.batching import make_micro_batches


def _seqs(n):
    return [{"prompt_ids": [1, 2, 3], "response_ids": [4, 5, 6], "loss_mask": torch.ones(3)} for _ in range(n)]


class _Model(torch.nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.config = SimpleNamespace(num_moe_experts=experts, grad_scale_func=None)
        self.router = torch.nn.Linear(2, 2)  # named like a Megatron MoE layer's router below
        self.mlp = torch.nn.Module()
        self.mlp.router = torch.nn.Linear(2, 2)


@pytest.fixture
def dp2(monkeypatch):
    """Two DP ranks at EP=2; `calls` records every all-reduce, whose MAX spans the counts in `ranks`."""
    world = {"counts": [], "calls": []}

    def all_reduce(t, op=None, group=None):
        world["calls"].append((t.device.type, t.dtype, op, group))
        t.fill_(max(world["counts"]))

    monkeypatch.setattr(schedule.mpu, "get_expert_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(schedule.mpu, "get_data_parallel_world_size", lambda: 2)
    monkeypatch.setattr(schedule.mpu, "get_data_parallel_group", lambda: "dp-group")
    monkeypatch.setattr(schedule.dist, "all_reduce", all_reduce)
    return world


def test_every_rank_runs_the_largest_count_and_the_padding_has_no_loss_tokens(dp2):
    per_rank = [make_micro_batches(_seqs(n), 6) for n in (3, 1)]  # one sequence per micro-batch
    dp2["counts"] = [len(mbs) for mbs in per_rank]
    padded = [schedule.equal_micro_batch_count(_Model(4), mbs) for mbs in per_rank]
    assert [len(p) for p in padded] == [3, 3]
    assert dp2["calls"] == [("cpu", torch.int64, torch.distributed.ReduceOp.MAX, "dp-group")] * 2
    assert all(a is b for a, b in zip(padded[1], per_rank[1]))  # the real ones first, unchanged
    for pad in padded[1][1:]:
        assert pad.num_rows == 1 and float(pad["loss_mask"].sum()) == 0.0
    assert padded[0] == per_rank[0]  # the rank with the most adds nothing


def test_dense_models_and_ep1_keep_their_own_count(dp2, monkeypatch):
    mbs = make_micro_batches(_seqs(2), 6)
    dp2["counts"] = [5]
    assert schedule.equal_micro_batch_count(_Model(None), mbs) == mbs
    monkeypatch.setattr(schedule.mpu, "get_expert_model_parallel_world_size", lambda: 1)
    assert schedule.equal_micro_batch_count(_Model(4), mbs) == mbs
    assert dp2["calls"] == []


def test_padding_forward_runs_routers_in_eval_and_the_loss_scale_is_restored():
    model = _Model(4)
    with schedule._routers_in_eval(model, True):
        assert not model.mlp.router.training and model.router.training  # only `...mlp.router` modules
    assert model.mlp.router.training
    model.config.grad_scale_func = lambda t: t * 2.0
    with schedule._scaled_for_real_count(model, 3.0):
        assert float(model.config.grad_scale_func(torch.ones(1))) == 6.0
    assert float(model.config.grad_scale_func(torch.ones(1))) == 2.0
