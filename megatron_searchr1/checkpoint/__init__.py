"""Training checkpoints (RL trainer and SFT): Megatron dist checkpoints of every model and optimizer, plus the
scheduler, RNG and loop state, written so that a crash mid-save never damages the previous checkpoint.

    save_checkpoint(root, step, {"actor": actor, "critic": critic}, {"actor": actor_opt, "critic": critic_opt},
                    {"actor": actor_sched}, extra={"data_cursor": 96, "kl_ctl": kl_ctl.state_dict()},
                    hf_dirs={"actor": hf_dir}, keep_last=3)                   # every rank calls it
    step = latest_step(root)                                                 # trainer.resume=auto: None = fresh
    extra = load_checkpoint(root, "latest", models, optimizers, schedulers)  # every rank calls it

    save_roles(root, step, {"actor": policy.state(), "critic": critic.state()}, extra, hf_dirs=...)   # the trainers
    extra = load_roles(root, "latest", {"actor": policy.state(), "critic": critic.state()})

Layout of one checkpoint (`<root>/step_000010/`):

    actor/                  the model's `sharded_state_dict()` (Megatron dist checkpoint: metadata.json, common.pt,
                            *.distcp), keys UNPREFIXED, so it loads at any TP/PP and models/convert.py's
                            `megatron_to_hf` converts it as is (with `hf_dirs`, it also holds the converter's
                            searchr1_checkpoint.json and hf/ config + tokenizer)
                            (a LoRA model: its adapters only, `lora.adapter_sharded_state_dict`)
    critic/                 the same for every other model
    optimizer/actor/        `optimizer.sharded_state_dict(model_sharded_state_dict)`: Adam moments keyed by the
                            model's tensor names (Megatron's own format, so it reshards with TP/PP too; the
                            distributed optimizer's `dp_reshardable` layout reshards over DP only;
                            a freeze run's keys are per layer; checkpoint/optimizer.py)
    rng/rank_00000.pt       each rank's python / numpy / torch / CUDA RNG and Megatron's RNG-tracker states
    trainer_state.pt        scheduler state dicts and `extra` (anything picklable: data cursor, KL controller, ...)
    checkpoint.json         written LAST by rank 0: step, world layout, what the checkpoint holds

Atomicity: everything is written into `step_000010.tmp/`; after all ranks finish (barrier) rank 0 writes
checkpoint.json, renames the directory to `step_000010/` and only then points `<root>/latest` at it (a temp file
and os.replace). A crash at any point leaves `latest` on the previous complete checkpoint, and `latest_step` /
`load_checkpoint` accept only directories with checkpoint.json. Stale `*.tmp` directories of crashed saves are
removed at start (`agreed_resume_target`, `check_shared_dir(..., ckpt_root=)`) and by the next save; `keep_last`
keeps the newest k checkpoints.

A save that fails on any rank fails on every rank (the outcome is gathered after each phase), with its partial
`.tmp` removed; a write the filesystem refuses (full, quota, read-only) is one CheckpointStorageError line saying
where, how much is free and about how much a checkpoint needs (checkpoint/space.py). When the disk is short before
a save, `keep_last` prunes first (down to keep_last - 1, never the newest complete checkpoint).

RNG states are restored only when the world size matches the saved one (each rank gets its own state back);
otherwise a warning says that random streams restart from the live seeds. Models must be the same architecture
and may be loaded at another TP/PP (the dist checkpoint reshards); optimizer state reshards likewise.

Several nodes: all of this assumes `<root>` is one directory on a filesystem every node shares (rank 0 creates
the step directory, every rank writes its RNG file into it, rank 0 renames it). `check_shared_dir` proves that at
start (every rank writes a marker, every rank must see them all) and refuses otherwise, and `agreed_resume_target`
lets rank 0 alone decide which step to resume and tells the others, so ranks never load different steps.

The optimizer's side (the sharding metadata it is saved with, the layouts it loads at, the load across EP sizes)
is checkpoint/optimizer.py; CheckpointError and the metadata constants are importable from here too.

Resuming a step saved twice (a resumed run saving a step again): the old directory is renamed to a `.tmp` name
before the new one takes its place, so a crash between the two renames leaves `latest` on a missing directory;
`latest_step` then falls back to the newest complete checkpoint.
"""
from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import socket
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np
import torch
import torch.distributed as dist

from megatron_searchr1.checkpoint.optimizer import (  # noqa: F401  (names of this module's API, re-exported)
    DISTRIBUTED_OPTIMIZER_METADATA, OPTIMIZER_METADATA, CheckpointError, check_optimizer_layouts, freeze_marker,
    load_optimizer, optimizer_metadata, optimizer_model_state, prepare_for_load, share_adam_step,
)
from megatron_searchr1.checkpoint.space import (
    CheckpointStorageError, dir_size, free_bytes, looks_full, make_room, resume_room_problem, storage_cause,
    storage_error,
)
from megatron_searchr1.models.forward import unwrap
from megatron_searchr1.models.freeze import is_frozen_subset
from megatron_searchr1.models.lora import adapter_sharded_state_dict, has_lora

FORMAT = "megatron_searchr1.training_checkpoint"
LATEST_FILE = "latest"
MARKER_FILE = "checkpoint.json"
STATE_FILE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")
@dataclass(frozen=True)
class RoleState:
    """What one role (trainer/roles.py: Policy, Critic) keeps in a checkpoint: its model and, when it trains, its
    optimizer and LR schedule. The live objects, not copies: saving reads them, loading writes into them in place
    (Megatron's dist checkpointing matches saved shards to the live parameters' sharded state dicts)."""

    model: Any
    optimizer: Any = None
    scheduler: Any = None


def _split(roles: dict[str, RoleState]) -> tuple[dict, dict, dict]:
    """name -> RoleState as save_checkpoint's three dicts (models, optimizers, schedulers): the format on disk is
    theirs, one subdirectory per name."""
    return ({n: s.model for n, s in roles.items()},
            {n: s.optimizer for n, s in roles.items() if s.optimizer is not None},
            {n: s.scheduler for n, s in roles.items() if s.scheduler is not None})


def save_roles(ckpt_root: str, step: int, roles: dict[str, RoleState], extra: Optional[dict] = None, *,
               hf_dirs: Optional[dict[str, str]] = None, keep_last: Optional[int] = None) -> str:
    """save_checkpoint for roles: `roles` maps a name ("actor", "critic") to what `role.state()` returns."""
    return save_checkpoint(ckpt_root, step, *_split(roles), extra, hf_dirs=hf_dirs, keep_last=keep_last)


def load_roles(ckpt_root: str, step: Union[str, int], roles: dict[str, RoleState]) -> dict:
    """load_checkpoint for roles: loads into the objects of each `role.state()`; returns the saved `extra`."""
    return load_checkpoint(ckpt_root, step, *_split(roles))


def step_dir(ckpt_root: str, step: int) -> str:
    """`<root>/step_000010`."""
    return os.path.join(ckpt_root, f"step_{step:06d}")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _complete_steps(ckpt_root: str) -> list[int]:
    if not os.path.isdir(ckpt_root):
        return []
    steps = []
    for name in os.listdir(ckpt_root):
        m = _STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(ckpt_root, name, MARKER_FILE)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def latest_step(ckpt_root: str) -> Optional[int]:
    """The step `<root>/latest` names, if that checkpoint is complete; else the newest complete one; None if none."""
    try:
        with open(os.path.join(ckpt_root, LATEST_FILE)) as f:
            step = int(f.read().strip())
        if os.path.isfile(os.path.join(step_dir(ckpt_root, step), MARKER_FILE)):
            return step
    except (OSError, ValueError):
        pass
    steps = _complete_steps(ckpt_root)
    return steps[-1] if steps else None


def resume_target(resume: str, ckpt_root: str) -> Optional[tuple[str, Union[str, int]]]:
    """Where `trainer.resume` points: (root, step) for load_checkpoint, or None to start fresh.

    "disable": None; "auto": the latest complete checkpoint under `ckpt_root`, None when there is none; anything
    else: a `step_N` directory of some run.
    """
    if resume == "disable":
        return None
    if resume == "auto":
        return (ckpt_root, "latest") if latest_step(ckpt_root) is not None else None
    path = os.path.abspath(resume)
    m = _STEP_DIR.match(os.path.basename(path))
    if m is None:
        raise CheckpointError(f"trainer.resume={resume!r} is not a step directory (<root>/step_N); use auto, disable "
                              "or such a directory")
    return os.path.dirname(path), int(m.group(1))


def agreed_resume_target(resume: str, ckpt_root: str, keep_last=None, check_room: bool = False
                         ) -> Optional[tuple[str, int]]:
    """`resume_target` decided by rank 0 alone, with "latest" resolved to its step, and broadcast to every rank.

    Each node reading its own `latest` could pick different steps (a save finishing while another node starts, a
    stale file cache); one decision cannot. A mistake in `trainer.resume` is raised on every rank, not only on rank
    0 while the others wait in the broadcast. check_room: a resume into `ckpt_root` whose next save cannot fit
    (free space, plus what `keep_last` would prune, below the size of the checkpoint resumed from) is a
    CheckpointStorageError now, on every rank, instead of after a step of training.
    """
    box: list = [None]
    if _rank() == 0:
        try:
            remove_stale_saves(ckpt_root)  # before any save: a crashed save's tree may be what fills the disk
            target = resume_target(resume, ckpt_root)
            if target is not None:
                target = (target[0], _resolve_step(*target))
            problem = None
            if check_room and target is not None and os.path.abspath(target[0]) == os.path.abspath(ckpt_root):
                problem = resume_room_problem(ckpt_root, target[1], keep_last, _complete_steps(ckpt_root),
                                              lambda s: dir_size(step_dir(ckpt_root, s)))
            box = [("storage", str(problem))] if problem is not None else [("ok", target)]
        except CheckpointError as e:
            box = [("error", str(e))]
        except OSError as e:  # removing a crashed save's tree, or reading the root
            code = storage_cause(e)
            box = [("storage", str(storage_error(f"preparing {ckpt_root} for this run", ckpt_root, code, need=None,
                                                 need_from="unknown")))
                   if code is not None else ("error", f"{ckpt_root}: {e}")]
    if _world() > 1:
        dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "storage":
        raise CheckpointStorageError(value)
    if kind == "error":
        raise CheckpointError(value)
    return value


def check_shared_dir(path: str, wait_s: float = 30.0, ckpt_root: Optional[str] = None) -> None:
    """Every rank calls this at start: refuse (CheckpointError on every rank) unless `path` is one directory that
    all ranks see, i.e. a shared filesystem when ranks sit on several nodes, and that they can write.

    Each rank writes a marker named after this launch (a token from rank 0) and its rank, then every rank looks for
    all markers, for up to `wait_s` seconds (a network filesystem may show another node's new file late). The
    findings are gathered, so every rank raises the same error or none does; the markers are removed again in
    every case. A write the filesystem refuses (full, read-only, no permission) is a CheckpointStorageError naming
    the directory and the cause. `ckpt_root`: rank 0 first removes what crashed saves left there (`*.tmp`), which
    may be what fills the disk.
    """
    error = None
    try:
        os.makedirs(path, exist_ok=True)
        if ckpt_root is not None and _rank() == 0:
            remove_stale_saves(ckpt_root)
    except OSError as e:
        error = e
    token = [uuid.uuid4().hex if _rank() == 0 else None]
    if _world() > 1:
        dist.broadcast_object_list(token, src=0)

    def marker(rank: int) -> str:
        return os.path.join(path, f".shared_dir_check.{token[0]}.rank{rank:05d}")

    missing: list = []
    try:
        if error is None:
            try:
                with open(marker(_rank()), "w") as f:
                    f.write(f"{socket.gethostname()}\n")
            except OSError as e:
                error = e
        _barrier()
        deadline = time.time() + wait_s
        while _world() > 1 and error is None:
            missing = [r for r in range(_world()) if not os.path.exists(marker(r))]
            if not missing or time.time() >= deadline:
                break
            time.sleep(0.5)
        mine = (socket.gethostname(), missing, None if error is None else (storage_cause(error), str(error)))
        seen: list = [mine]
        if _world() > 1:
            seen = [None] * _world()
            dist.all_gather_object(seen, mine)  # also: every rank is done looking
    finally:
        try:
            os.remove(marker(_rank()))
        except OSError:
            pass
    broken = [(r, host, err) for r, (host, _, err) in enumerate(seen) if err is not None]
    if broken:
        r, host, (code, text) = broken[0]
        if code is not None:
            raise storage_error(f"checking trainer.output_dir (rank {r} on {host} writing there)", path, code,
                                need=None, need_from="unknown before the first save")
        raise CheckpointError(f"trainer.output_dir={path!r} cannot be used: rank {r} on {host}: {text}")
    blind = [(r, host, miss) for r, (host, miss, _) in enumerate(seen) if miss]
    if blind:
        r, host, miss = blind[0]
        raise CheckpointError(
            f"trainer.output_dir={path!r} is not one directory shared by all {_world()} ranks: rank {r} on {host} "
            f"does not see the marker files that ranks {miss} wrote there ({len(blind)} rank(s) miss some). "
            "Checkpoints and resume need the same directory on every node: put trainer.output_dir on a shared "
            "filesystem (NFS, Lustre, ...) mounted at the same path on every node")


# ----------------------------------------------------------------------------------------------------------------
# RNG
# ----------------------------------------------------------------------------------------------------------------
def rng_state() -> dict:
    """This rank's random states: python, numpy, torch (CPU), CUDA (when present) and Megatron's RNG tracker
    (the model-parallel streams used for TP-region dropout and initialisation; CPU tensors on the CPU)."""
    from megatron.core import tensor_parallel

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` returned."""
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if state["tracker"]:
        tensor_parallel.get_cuda_rng_tracker().set_states({k: v.clone() for k, v in state["tracker"].items()})


# ----------------------------------------------------------------------------------------------------------------
# Save
# ----------------------------------------------------------------------------------------------------------------
def _parallel_layout() -> dict:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return {"tp": 1, "pp": 1, "dp": _world()}
    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size()}


def _check_names(models: dict, optimizers: dict) -> None:
    lone = sorted(set(optimizers) - set(models))
    if lone:
        raise CheckpointError(f"optimizer(s) {lone} have no model of the same name: an optimizer's state is keyed by "
                              f"its model's tensors, so pass models={{name: model}} for each (have {sorted(models)})")


def _write_convert_metadata(model_dir: str, model: torch.nn.Module, hf_dir: str, layout: dict) -> None:
    """Rank 0: the converter's searchr1_checkpoint.json + hf/ files, so `megatron_to_hf(model_dir, ...)` works."""
    from megatron_searchr1.models.convert import bind_mapping, load_hf_config, write_checkpoint_metadata

    bare = unwrap(model)
    mapping = bind_mapping(load_hf_config(hf_dir), bare)
    dtype = next(bare.parameters()).dtype
    write_checkpoint_metadata(model_dir, hf_dir, tp=layout["tp"], pp=layout["pp"],
                              padded_vocab_size=mapping.dims.padded_vocab_size, dtype=dtype)


def _model_state(model: torch.nn.Module) -> dict:
    """What a model's checkpoint directory holds: its sharded state dict, or for a LoRA model its adapters only
    (the frozen base is the run's pinned start, rebuilt from it at resume; models/lora.py)."""
    return adapter_sharded_state_dict(model) if has_lora(model) else unwrap(model).sharded_state_dict()


def _load_adapters(model: torch.nn.Module, model_dir: str) -> None:
    """Load a LoRA model's adapters (saved by `_model_state`) into it; the base is left as built."""
    from megatron.core import dist_checkpointing

    from megatron_searchr1.models.convert import ConversionError

    try:
        state = dist_checkpointing.load(adapter_sharded_state_dict(model), model_dir)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise ConversionError(f"loading the LoRA adapters from {model_dir!r} failed (a full-model checkpoint, or "
                              f"another lora rank / targets?): {type(e).__name__}: {str(e)[-1000:]}") from None
    unwrap(model).load_state_dict(state, strict=False)


def remove_stale_saves(ckpt_root: str) -> None:
    """Rank 0, where no save runs: remove the leftovers of saves that crashed (`*.tmp` directories and files)."""
    if not os.path.isdir(ckpt_root):
        return
    for name in os.listdir(ckpt_root):
        if name.endswith(".tmp"):
            path = os.path.join(ckpt_root, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def _prune(ckpt_root: str, keep_last: int, protect: int) -> None:
    for step in _complete_steps(ckpt_root)[:-keep_last]:
        if step != protect:
            shutil.rmtree(step_dir(ckpt_root, step))


def save_checkpoint(ckpt_root: str, step: int, models: dict[str, torch.nn.Module], optimizers: dict,
                    schedulers: dict, extra: Optional[dict] = None, *, hf_dirs: Optional[dict[str, str]] = None,
                    keep_last: Optional[int] = None) -> str:
    """Write `<root>/step_<step>/` atomically and point `<root>/latest` at it; every rank must call this.

    models: name -> Megatron model (bare or DDP-wrapped, one chunk per rank); optimizers: name -> Megatron optimizer
    of the model with that name; schedulers: name -> object with state_dict()/load_state_dict() (e.g. Megatron's
    OptimizerParamScheduler); extra: picklable loop state (data cursor, KL controller, step counters...).
    hf_dirs: name -> HF directory (config + tokenizer) the model was built from: those model subdirectories also
    get the converter's metadata, so models/convert.py's megatron_to_hf can export them directly.
    keep_last: keep only the newest k complete checkpoints (None keeps all). Returns the checkpoint directory.
    """
    from megatron.core import dist_checkpointing

    if step < 0:
        raise CheckpointError(f"step must be >= 0, got {step}")
    if keep_last is not None and keep_last < 1:
        raise CheckpointError(f"keep_last must be >= 1 (or None to keep every checkpoint), got {keep_last}")
    _check_names(models, optimizers)
    unknown = sorted(set(hf_dirs or {}) - set(models))
    if unknown:
        raise CheckpointError(f"hf_dirs names {unknown}, which are not among the models {sorted(models)}")
    for name, hf_dir in (hf_dirs or {}).items():  # checked on every rank, before any collective
        if not os.path.isfile(os.path.join(hf_dir, "config.json")):
            raise CheckpointError(f"hf_dirs[{name!r}] = {hf_dir!r} has no config.json: pass the Hugging Face "
                                  "directory (config + tokenizer) the model was built from")
    rank, layout = _rank(), _parallel_layout()
    final, tmp = step_dir(ckpt_root, step), step_dir(ckpt_root, step) + ".tmp"
    need = None  # rank 0: the size of the newest complete checkpoint, what this one will take about

    failure = None
    if rank == 0:
        try:
            os.makedirs(ckpt_root, exist_ok=True)
            remove_stale_saves(ckpt_root)
            need = make_room(ckpt_root, keep_last, _complete_steps(ckpt_root),
                             lambda s: dir_size(step_dir(ckpt_root, s)),
                             lambda s: shutil.rmtree(step_dir(ckpt_root, s)))
            for sub in [*models, *(os.path.join("optimizer", n) for n in optimizers), "rng"]:
                os.makedirs(os.path.join(tmp, sub))
        except OSError as e:
            failure = e
    _fail_together(failure, step, ckpt_root, need, keep_last)

    try:
        for name, model in models.items():
            dist_checkpointing.save(_model_state(model), os.path.join(tmp, name))
            if name in optimizers:
                # The optimizer's state is keyed by the model's sharded tensors (matched by parameter identity);
                # a fresh model sharded state dict, since save() rewrites the one it is given in place.
                opt_sd = optimizers[name].sharded_state_dict(optimizer_model_state(model),
                                                             metadata=optimizer_metadata(optimizers[name]))
                if is_frozen_subset(model):
                    share_adam_step(opt_sd)
                dist_checkpointing.save(opt_sd, os.path.join(tmp, "optimizer", name))
        torch.save(rng_state(), os.path.join(tmp, "rng", f"rank_{rank:05d}.pt"))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001  (torch's CheckpointException is a BaseException; made collective)
        failure = e
    _fail_together(failure, step, ckpt_root, need, keep_last)  # also the barrier: every rank's files are on disk

    if rank == 0:
        try:
            _finish(ckpt_root, step, tmp, final, models, optimizers, schedulers, extra, hf_dirs, layout, keep_last)
        except Exception as e:  # noqa: BLE001
            failure = e
    _fail_together(failure, step, ckpt_root, need, keep_last)
    return final


def _finish(ckpt_root, step, tmp, final, models, optimizers, schedulers, extra, hf_dirs, layout, keep_last) -> None:
    """Rank 0, after every rank wrote its files: metadata and the marker, the rename, `latest`, the clean-up."""
    for name, hf_dir in (hf_dirs or {}).items():
        if has_lora(models[name]):
            continue  # adapters only: not a model the converter can write (the merged HF export is)
        _write_convert_metadata(os.path.join(tmp, name), models[name], hf_dir, layout)
    torch.save({"step": step, "schedulers": {n: s.state_dict() for n, s in schedulers.items()},
                "extra": extra or {}}, os.path.join(tmp, STATE_FILE))
    marker = {"format": FORMAT, "version": 1, "step": step, "world_size": _world(), **layout,
              "models": sorted(models), "optimizers": sorted(optimizers), "schedulers": sorted(schedulers),
              "lora_models": sorted(n for n in models if has_lora(models[n])),
              "freeze": {n: freeze_marker(models[n]) for n in optimizers if is_frozen_subset(models[n])},
              "time": time.time()}
    with open(os.path.join(tmp, MARKER_FILE), "w") as f:
        json.dump(marker, f, indent=2)
    if os.path.exists(final):  # the same step saved again: move the old one aside first
        os.replace(final, final + ".replaced.tmp")
    os.replace(tmp, final)
    latest_tmp = os.path.join(ckpt_root, LATEST_FILE + ".tmp")
    with open(latest_tmp, "w") as f:
        f.write(f"{step}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest_tmp, os.path.join(ckpt_root, LATEST_FILE))
    remove_stale_saves(ckpt_root)
    if keep_last is not None:
        _prune(ckpt_root, keep_last, protect=step)


def _fail_together(failure: Optional[BaseException], step: int, ckpt_root: str, need: Optional[int],
                   keep_last: Optional[int] = None) -> None:
    """A save is collective, so is its failure: every rank learns whether any rank failed (a rank raising alone
    would leave the others waiting in the next collective). On a failure rank 0 removes the partial
    `step_N.tmp` and words one message for all; every rank raises it: CheckpointStorageError (one `error:` line
    at the entry points) when the filesystem refused a write, else a CheckpointError chained to this rank's own
    exception (a bug: its traceback matters)."""
    mine = None if failure is None else (storage_cause(failure), f"{type(failure).__name__}: {str(failure)[-300:]}")
    seen = [mine]
    if _world() > 1:
        seen = [None] * _world()
        dist.all_gather_object(seen, mine)
    failed = [(r, f) for r, f in enumerate(seen) if f is not None]
    if not failed:
        return
    box: list = [None]
    if _rank() == 0:
        tmp = step_dir(ckpt_root, step) + ".tmp"
        written, free = dir_size(tmp), free_bytes(ckpt_root)  # as it failed, before the partial tree goes
        if not any(f[0] is not None for _, f in failed) and looks_full(ckpt_root):
            failed = [(r, (errno.ENOSPC, msg)) for r, (_, msg) in failed]  # a writer that lost the errno
        shutil.rmtree(tmp, ignore_errors=True)
        left = latest_step(ckpt_root)
        kept = (f"step {left} (complete) is untouched and trainer.resume=auto continues from it" if left is not None
                else "no earlier checkpoint exists")
        storage = [(r, f) for r, f in failed if f[0] is not None]
        if storage:
            need_from = ("the size of the previous checkpoint" if need is not None
                         else "at least what was written before it failed")
            err = storage_error(f"saving checkpoint step {step} to {step_dir(ckpt_root, step)} (rank "
                                f"{storage[0][0]})", ckpt_root, storage[0][1][0],
                                need=need if need is not None else written, need_from=need_from, free=free,
                                keep_last=keep_last)
            box = [("storage", f"{err}; the partial {os.path.basename(tmp)} was removed, {kept}")]
        else:
            r, (_, msg) = failed[0]
            box = [("error", f"saving checkpoint step {step} to {step_dir(ckpt_root, step)} failed on rank {r} "
                             f"({msg}); the partial {os.path.basename(tmp)} was removed, {kept}")]
    if _world() > 1:
        dist.broadcast_object_list(box, src=0)
    kind, msg = box[0]
    if kind == "storage":
        raise CheckpointStorageError(msg) from None
    raise CheckpointError(msg) from failure


# ----------------------------------------------------------------------------------------------------------------
# Load
# ----------------------------------------------------------------------------------------------------------------
def _resolve_step(ckpt_root: str, step: Union[str, int]) -> int:
    if step == "latest":
        found = latest_step(ckpt_root)
        if found is None:
            raise CheckpointError(f"no complete checkpoint under {ckpt_root!r} (a directory step_N/ with "
                                  f"{MARKER_FILE}); start without resuming or point the checkpoint root elsewhere")
        return found
    if isinstance(step, bool) or not isinstance(step, int):
        raise CheckpointError(f"step must be 'latest' or an int, got {step!r}")
    if not os.path.isfile(os.path.join(step_dir(ckpt_root, step), MARKER_FILE)):
        have = _complete_steps(ckpt_root)
        raise CheckpointError(f"no complete checkpoint for step {step} under {ckpt_root!r}; complete steps: {have}")
    return step


def load_checkpoint(ckpt_root: str, step: Union[str, int], models: dict[str, torch.nn.Module], optimizers: dict,
                    schedulers: dict) -> dict:
    """Load `step` ("latest" or an int) into the given models, optimizers and schedulers (every rank calls this);
    returns the saved `extra` (with "step" added). Names must be among those saved; a name not passed is not loaded.

    Load before training starts; optimizers must be built over the models already (the optimizer state is matched
    to the parameters through the models' sharded state dicts, as Megatron-LM does).
    """
    from megatron_searchr1.models.convert import ConversionError, load_megatron_checkpoint

    _check_names(models, optimizers)
    step = _resolve_step(ckpt_root, step)
    path = step_dir(ckpt_root, step)
    with open(os.path.join(path, MARKER_FILE)) as f:
        marker = json.load(f)
    for kind, have in (("models", models), ("optimizers", optimizers), ("schedulers", schedulers)):
        missing = sorted(set(have) - set(marker[kind]))
        if missing:
            raise CheckpointError(f"{path} has no {kind} {missing} (it holds {marker[kind]})")
    check_optimizer_layouts(path, marker, _parallel_layout(), models, optimizers)
    prepare_for_load(optimizers)
    for name, model in models.items():
        try:
            if has_lora(model):
                _load_adapters(model, os.path.join(path, name))
            else:
                load_megatron_checkpoint(unwrap(model), os.path.join(path, name))
        except ConversionError as e:
            raise CheckpointError(f"model {name!r}: {e}") from None
    for name, opt in optimizers.items():
        # no_grad: the distributed optimizer copies the loaded fp32 shards into views of parameters that require
        # grad (an in-place error under autograd)
        with torch.no_grad():
            load_optimizer(opt, models[name], os.path.join(path, "optimizer", name))

    state = torch.load(os.path.join(path, STATE_FILE), weights_only=False)
    for name, sched in schedulers.items():
        sched.load_state_dict(state["schedulers"][name])

    if marker["world_size"] == _world():
        set_rng_state(torch.load(os.path.join(path, "rng", f"rank_{_rank():05d}.pt"), weights_only=False))
    elif _rank() == 0:
        warnings.warn(f"{path} was saved by {marker['world_size']} ranks, this run has {_world()}: random states are "
                      "not restored (sampling and dropout streams restart from this run's seeds)")
    _barrier()
    return {**state["extra"], "step": step}
