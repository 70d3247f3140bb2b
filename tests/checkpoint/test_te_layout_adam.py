"""The checkpoint's optimizer code (checkpoint/optimizer.py) with the GPU optimizer's state layout: Transformer
Engine's FusedAdam keeps Adam's step in the param groups, not per parameter (tests/megatron/te_layout_adam.py is a CPU
stand-in with that layout). A save and a load into fresh objects give back every state tensor and the group step, and
the next step is bit-identical to the run that never stopped (plain and distributed optimizer, bf16 with fp32 master
weights); a freeze run's rank without a step still saves the one another rank has (share_adam_step)."""
from __future__ import annotations

import pytest
import torch

from megatron_searchr1.checkpoint import load_checkpoint, save_checkpoint
from megatron_searchr1.checkpoint import optimizer as ckpt_opt
from tests.megatron.te_layout_adam import TeLayoutAdam, te_layout_adam
from tests.megatron.test_offload import _actor, _opt_tensors, _step, megatron_world  # noqa: F401 (fixture)


@pytest.mark.parametrize("dist_opt", [False, True])
def test_save_and_load_with_fused_adams_layout_resume_bit_identically(megatron_world, monkeypatch, tmp_path,
                                                                      dist_opt):
    with te_layout_adam(monkeypatch):
        model, opt = _actor(torch.bfloat16, dist_opt)
        for seed in (1, 2):
            _step(model, opt, seed)
        inner = [o.optimizer for o in getattr(opt, "chained_optimizers", [opt])]
        assert all(isinstance(o, TeLayoutAdam) for o in inner)
        assert all("step" not in st for o in inner for st in o.state.values())
        assert {g["step"] for o in inner for g in o.param_groups if g["params"]} == {2}
        root = str(tmp_path / "ckpt")
        save_checkpoint(root, 2, {"actor": model}, {"actor": opt}, {}, {})
        fresh, fresh_opt = _actor(torch.bfloat16, dist_opt)
        load_checkpoint(root, "latest", {"actor": fresh}, {"actor": fresh_opt}, {})
        fresh_inner = [o.optimizer for o in getattr(fresh_opt, "chained_optimizers", [fresh_opt])]
        assert [g.get("step") for o in fresh_inner for g in o.param_groups if g["params"]] == \
            [g.get("step") for o in inner for g in o.param_groups if g["params"]]
        for a, b in zip(_opt_tensors(opt), _opt_tensors(fresh_opt), strict=True):
            assert torch.equal(a, b)
        for m, o in ((model, opt), (fresh, fresh_opt)):
            _step(m, o, seed=3)
    for (n, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q), n


def test_a_rank_without_a_step_saves_the_group_step_another_rank_has(monkeypatch):
    # rank 0 of a freeze run trains nothing: its groups have no "step" (TE bumps only groups with parameters); rank 1
    # has step 7 in its groups. What rank 0 writes to common.pt must carry it, or a resume restarts Adam's bias
    # correction at step 1
    mine = {"optimizer": {"state": {}, "param_groups": [{"params": [], "lr": 1.0}, {"params": [], "lr": 2.0}]}}
    other = [(None, [7])]
    monkeypatch.setattr(ckpt_opt, "_world_size", lambda: 2)
    monkeypatch.setattr(ckpt_opt.dist, "all_gather_object", lambda out, obj: out.__setitem__(slice(None),
                                                                                               [obj, other]))
    ckpt_opt.share_adam_step(mine)
    assert [g["step"] for g in mine["optimizer"]["param_groups"]] == [7, 7]
    assert "common_step" not in mine["optimizer"]["state"]  # torch's per-parameter step: nobody had one
