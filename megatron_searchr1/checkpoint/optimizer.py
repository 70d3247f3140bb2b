"""An optimizer's state in a training checkpoint (checkpoint/__init__.py) and the layouts it comes back at: the
sharding metadata it is saved with, the model sharded state dict it is keyed by, the checks that refuse a layout it
cannot load at, and the load itself across expert-parallel sizes.

    opt_sd = optimizer.sharded_state_dict(optimizer_model_state(model), metadata=optimizer_metadata(optimizer))
    check_optimizer_layouts(path, marker, here, models, optimizers)     # before any tensor is read
    prepare_for_load(optimizers); ...load the models...; load_optimizer(optimizer, model, opt_dir)

What reshards: a plain optimizer's Adam moments are keyed by the model's tensor names (Megatron's own format), so they
load at any TP/PP/DP and at another EP (`load_optimizer` re-nests the param groups); the distributed optimizer's
`dp_reshardable` state loads at the TP/PP/EP it was saved at, any DP; a freeze run's state covers its trainable set
only. Everything here is called by the package's save_checkpoint / load_checkpoint on every rank.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_searchr1.models.forward import unwrap
from megatron_searchr1.models.freeze import is_frozen_subset

# The distributed optimizer's layout: `dp_reshardable` (Megatron-LM's default; each rank writes its own buffer slice,
# no gather). In megatron-core 0.16 `fully_sharded_model_space` fails to save (ShardedTensor.flattened_range is no
# longer supported) and `fully_reshardable` fails to load ('step'); dp_reshardable reshards over DP only, so a
# distributed-optimizer checkpoint resumes at the TP/PP it was saved at (load_checkpoint says so).
# Only a distributed optimizer is given the sharding type: with a non-fully-reshardable type Megatron's ChainedOptimizer
# prefixes its sub-optimizers' keys (`chained_0.`), which would tie a plain optimizer's state to the number of
# sub-optimizers (2 at EP > 1, 1 at EP = 1) and break a resume at another EP.
OPTIMIZER_METADATA = {"chained_optim_avoid_prefix": True}
DISTRIBUTED_OPTIMIZER_METADATA = {**OPTIMIZER_METADATA, "distrib_optim_sharding_type": "dp_reshardable"}


class CheckpointError(Exception):
    """A checkpoint that cannot be written or loaded as asked; the message says what to change."""


def optimizer_model_state(model: torch.nn.Module) -> dict:
    """The model sharded state dict an optimizer's state is keyed by (matched by parameter identity).

    Megatron stacks a weight of all decoder layers into one checkpoint tensor (`decoder.layers.<suffix>`, global
    shape (num_layers, ...)) and refuses to save one whose shards do not cover every layer ("Invalid access
    pattern"): a freeze run (models/freeze.py) has Adam state for a few layers only, so its optimizer state is keyed
    per layer instead (Megatron's `non_homogeneous_layers`: `decoder.layers.<global i>.<suffix>`), which any subset
    covers (global layer numbers: the keys do not depend on the PP split). Every stage of such a run is marked
    (`model.freeze_settings`), so all ranks agree even where a stage trains nothing or everything."""
    metadata = {"non_homogeneous_layers": True} if is_frozen_subset(model) else None
    return unwrap(model).sharded_state_dict(metadata=metadata)


def _torch_optimizer_dicts(sd: Any) -> list[dict]:
    """The torch optimizer state dicts ({"state", "param_groups"}) inside a Megatron optimizer's state dict."""
    if not isinstance(sd, dict):
        return []
    if isinstance(sd.get("state"), dict) and "param_groups" in sd:
        return [sd]
    return [d for v in sd.values() for d in _torch_optimizer_dicts(v)]


def share_adam_step(opt_sd: dict) -> None:
    """Every rank's optimizer state dict gets the Adam step (in place; every rank calls it).

    Where the step lives depends on the optimizer megatron-core built. torch's Adam (the CPU) keeps one per
    parameter, which Megatron saves once, as `state.common_step`; Transformer Engine's FusedAdam (GPUs) keeps it in
    each param group (`param_groups[i]["step"]`), and only for groups that hold parameters. Both are non-sharded
    values that only rank 0 writes (common.pt) and every rank reads back. A freeze run's rank 0 may train nothing
    (PP stage 0 when the last layers train) and so has no step: the checkpoint would lose it, and the other ranks'
    load fail (torch's Adam: KeyError 'step') or restart the bias correction at step 1 (TE's: a drifting resume).
    The step is the same wherever there is one; take it from a rank that has it."""
    dicts = _torch_optimizer_dicts(opt_sd)
    mine = [(d["state"].get("common_step"), [g["step"] for g in d["param_groups"] if "step" in g][:1])
            for d in dicts]
    every = [mine]
    if _world_size() > 1:
        every = [None] * _world_size()
        dist.all_gather_object(every, mine)
    for i, d in enumerate(dicts):
        steps = [m[i][0] for m in every if i < len(m) and m[i][0] is not None]
        if steps and "common_step" not in d["state"]:
            d["state"]["common_step"] = steps[0]
        group_steps = [m[i][1][0] for m in every if i < len(m) and m[i][1]]
        for g in d["param_groups"] if group_steps else ():
            g.setdefault("step", group_steps[0])


def freeze_marker(model: torch.nn.Module) -> Optional[dict]:
    """What checkpoint.json records of a freeze run's trainable set (its optimizer state has those keys only)."""
    if not is_frozen_subset(model):
        return None
    return json.loads(json.dumps(asdict(unwrap(model).freeze_settings)))  # as it reads back from the JSON


def _sub_dicts(sd: dict) -> list:
    """One state dict per sub-optimizer: a ChainedOptimizer of several has {0: ..., 1: ...}; of one, it is that
    sub-optimizer's own dict."""
    return [sd[k] for k in sorted(sd)] if sd and all(isinstance(k, int) for k in sd) else [sd]


def _torch_state(sub: dict) -> dict:
    """The torch optimizer's own state dict (`state`, `param_groups`) in a sub-optimizer's state dict (Megatron's
    Float16 optimizer nests it under "optimizer")."""
    return sub["optimizer"] if "optimizer" in sub else sub


def _group_layout(subs: list) -> list:
    """Which param groups hold expert-parallel parameters, per sub-optimizer: differs between EP = 1 and EP > 1."""
    return [[bool(g.get("is_expert_parallel")) for g in _torch_state(s)["param_groups"]] for s in subs]


def optimizer_metadata(opt) -> dict:
    """The metadata an optimizer's sharded state dict is built with (save and load alike)."""
    return dict(DISTRIBUTED_OPTIMIZER_METADATA if is_distributed(opt) else OPTIMIZER_METADATA)


def is_distributed(opt) -> bool:
    """Whether a Megatron optimizer (or any of a ChainedOptimizer's) is the distributed optimizer."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(o, DistributedOptimizer) for o in getattr(opt, "chained_optimizers", [opt]))


def _untie_adam_steps(opt) -> None:
    """Give every parameter of a loaded distributed optimizer its own Adam step tensor.

    The cause of a resume that drifted after one step: without Apex/TE, megatron-core 0.16's
    DistributedOptimizer.load_state_dict puts ONE step tensor into every parameter's torch-Adam state, and torch's
    Adam increments each parameter's step in place, so after the next step it reads step + (number of shards) and
    the bias correction is wrong. A copy per parameter restores torch's own layout (with TE's FusedAdam the step
    lives in the param groups and nothing is shared)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for sub in getattr(opt, "chained_optimizers", [opt]):
        if isinstance(sub, DistributedOptimizer):
            for state in sub.optimizer.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].clone()


def load_optimizer(opt, model: torch.nn.Module, opt_dir: str) -> None:
    """Load one optimizer's state, also when it was saved under another expert-parallel size.

    Megatron keeps expert parameters in their own sub-optimizer and param group only at EP > 1 (they are DP
    all-reduced like the rest at EP = 1), so an EP=2 checkpoint's common part holds {0: dense, 1: experts} while an
    EP=1 optimizer expects one dict. The Adam moments are keyed by parameter name and load at either layout; the
    param-group hyperparameters and the shared step live in common.pt in the SAVED nesting, and dist_checkpointing
    merges only the live `params` lists into it: a live group then has no `wd_mult` (KeyError 'pre_wd_mult' in
    Megatron's _filter_and_reorder_param_groups). Then each live group takes the saved group with the same
    (wd_mult, lr_mult, is_decoupled_lr) and the live is_expert_parallel, and every sub-optimizer the saved step.
    The same layout loads as Megatron does (bit-exact resume).
    """
    from megatron.core import dist_checkpointing

    model_sd = optimizer_model_state(model)
    opt_sd = opt.sharded_state_dict(model_sd, is_loading=True, metadata=optimizer_metadata(opt))
    saved = _sub_dicts(dist_checkpointing.load_common_state_dict(opt_dir))
    live = _sub_dicts(opt_sd)
    if any("param_state" in s for s in saved + live):  # the distributed optimizer's own format
        if len(saved) != len(live):
            raise CheckpointError(f"{opt_dir} was saved with {len(saved)} distributed sub-optimizer(s), this run has "
                                  f"{len(live)}: resume the distributed optimizer at the parallel.ep it was saved at")
        opt.load_state_dict(dist_checkpointing.load(opt_sd, opt_dir))
        _untie_adam_steps(opt)
        return
    if _group_layout(saved) == _group_layout(live):
        opt.load_state_dict(dist_checkpointing.load(opt_sd, opt_dir))
        return

    def group_key(g):
        return g["wd_mult"], g["lr_mult"], g["is_decoupled_lr"]

    by_key = {group_key(g): g for s in saved for g in _torch_state(s)["param_groups"]}
    live_groups = [[{k: v for k, v in g.items() if k != "params"} for g in _torch_state(s)["param_groups"]]
                   for s in live]  # read before load(), which rewrites opt_sd
    scaled = ["grad_scaler" in s for s in live]
    steps = [_torch_state(s)["state"]["common_step"] for s in saved if "common_step" in _torch_state(s)["state"]]
    loaded = dist_checkpointing.load(opt_sd, opt_dir)  # tensors and `params` at the live paths
    subs = ([loaded[i] for i in range(len(live))] if len(live) > 1
            else [{k: v for k, v in loaded.items() if not isinstance(k, int)}])  # less the saved nesting
    for sub, sub_groups, has_scaler in zip(subs, live_groups, scaled):
        state = _torch_state(sub)
        groups = []
        for g, live_g in zip(state["param_groups"], sub_groups):
            if group_key(live_g) not in by_key:
                raise CheckpointError(f"{opt_dir} has no parameter group like {group_key(live_g)} "
                                      f"(wd_mult, lr_mult, is_decoupled_lr); it holds {sorted(by_key)}")
            groups.append({**by_key[group_key(live_g)], "is_expert_parallel": live_g["is_expert_parallel"],
                           "params": g["params"]})
        state["param_groups"] = groups
        state["state"] = {k: v for k, v in state["state"].items() if isinstance(k, int)}
        if steps:
            state["state"]["common_step"] = steps[0]
        if has_scaler and "grad_scaler" in saved[0]:
            sub["grad_scaler"] = saved[0]["grad_scaler"]
    opt.load_state_dict({i: s for i, s in enumerate(subs)} if len(live) > 1 else subs[0])


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def check_optimizer_layouts(path: str, marker: dict, here: dict, models: dict, optimizers: dict) -> None:
    """Refuse (CheckpointError, the same on every rank) to load an optimizer state the live layout cannot take: a
    distributed optimizer's at another TP/PP (`here`: this run's {"tp", "pp"}), or a freeze run's for another
    trainable set. `marker` is the checkpoint's checkpoint.json."""
    for name, opt in optimizers.items():  # the distributed optimizer's dp_reshardable state reshards over DP only
        if is_distributed(opt) and (marker.get("tp"), marker.get("pp")) != (here["tp"], here["pp"]):
            raise CheckpointError(f"{path}: the distributed optimizer's state of {name!r} was saved at "
                                  f"tp={marker.get('tp')} pp={marker.get('pp')} and loads at that TP/PP only (any "
                                  f"DP); this run has tp={here['tp']} pp={here['pp']}: resume at the saved "
                                  "parallel.tp / parallel.pp, or start a new run from the checkpoint's model "
                                  "(model.megatron_ckpt)")
    for name in optimizers:  # a freeze run's optimizer state covers its trainable set only
        saved, live = marker.get("freeze", {}).get(name), freeze_marker(models[name])
        if saved != live:
            raise CheckpointError(f"{path}: the optimizer state of {name!r} was saved for the trainable set "
                                  f"{saved or 'all parameters'} (freeze settings), this model trains "
                                  f"{live or 'all parameters'}: resume with the same model.freeze")


def prepare_for_load(optimizers: dict) -> None:
    """Before the models load: give a fresh distributed optimizer Megatron's placeholder Adam state.

    Its sharded_state_dict reads the step of existing Adam state, and the placeholder is one zero-gradient step whose
    weight decay moves the weights, so it must run before the weights load (which, with the optimizer load, then
    overwrites everything it touched)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in optimizers.values():
        for sub in getattr(opt, "chained_optimizers", [opt]):
            if isinstance(sub, DistributedOptimizer) and not sub.optimizer.state:
                sub._init_optimizer_states_with_dummy_values()
