"""The two checkpoint conversions as whole programs: each starts Megatron's world at the asked TP/PP/EP, builds this
rank's stage, fills it and writes the other format. What the converters' command lines run (models/convert_cli.py,
checkpoints_convert/), and infer.py for a Megatron checkpoint it is given.

    hf_to_megatron("HF", "CKPT", tp=2, pp=2)        # every rank of a torchrun world of 4 (or one plain process)
    megatron_to_hf("CKPT", "HF2", dtype="bfloat16")

They live apart from models/convert.py, the library that trainers, the weight sync and the checkpoint code import
(the name mapping, the loaders, the HF writer), because starting the world is the job of an entry point: convert.py
runs inside a world its caller made and imports nothing above models/. Both check what needs no world first (the
config, TP/PP/EP against the model and WORLD_SIZE, the tensor names, the output directory), so a mistake is reported
before any process group starts.
"""
from __future__ import annotations

import os
import shutil
from typing import Any

import torch

from megatron_searchr1.models.config import check_parallel_sizes
from megatron_searchr1.models.convert import (
    DTYPES, HF_SUBDIR, ConversionError, SafetensorsReader, bind_mapping, check_hf_tensor_names, load_hf_config,
    load_hf_weights, load_megatron_checkpoint, read_checkpoint_metadata, write_checkpoint_metadata, write_hf_dir,
)
from megatron_searchr1.models.families import get_family


def check_sizes(hf_config: Any, tp: int, pp: int, ep: int = 1) -> None:
    """`check_parallel_sizes` for this model, TP/PP/EP and torchrun's world size, as a ConversionError naming the
    flags, before any process group starts."""
    try:
        # expert_tp=tp: the converter's initialize_megatron keeps Megatron's default expert-TP (= TP)
        check_parallel_sizes(hf_config, tp, pp, world_size=int(os.environ.get("WORLD_SIZE", "1")), ep=ep,
                             expert_tp=tp)
    except ValueError as e:
        raise ConversionError(f"{e} (--tp/--pp{'/--ep' if ep > 1 else ''})") from None


def all_ranks_ok(fn, *args, **kwargs):
    """Run `fn` on every rank; if it fails on ANY rank, raise ConversionError on ALL ranks (nobody hangs in the
    next collective). A shape mismatch, say, may only show on the pipeline stage that holds the bad layer."""
    import torch.distributed as dist

    result, err = None, None
    try:
        result = fn(*args, **kwargs)
    except (ConversionError, ValueError, KeyError, RuntimeError) as e:
        err = f"rank {dist.get_rank()}: {e}"
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, err)
    errors = [e for e in errors if e]
    if errors:
        more = f" (and {len(errors) - 1} more rank(s) failed)" if len(errors) > 1 else ""
        raise ConversionError(errors[0] + more)
    return result


def _resolve_dtype(name: str, hf_config: Any) -> torch.dtype:
    if name == "auto":
        d = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
        return getattr(torch, d) if isinstance(d, str) else d
    return DTYPES[name]


def _prepare_out_dir(out_dir: str, overwrite: bool, input_dir: str) -> None:
    if os.path.realpath(out_dir) == os.path.realpath(input_dir):
        raise ConversionError(f"output directory {out_dir!r} is the input directory: choose another")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise ConversionError(f"output directory {out_dir!r} is not empty: pass --overwrite or choose another")


def hf_to_megatron(hf_dir: str, out_dir: str, *, tp: int = 1, pp: int = 1, dtype: str = "auto",
                   overwrite: bool = False, ep: int = 1) -> None:
    """Convert an HF dir to a Megatron dist checkpoint; every rank of the (tp*pp*dp) world calls this."""
    hf_config = load_hf_config(hf_dir)
    check_sizes(hf_config, tp, pp, ep)
    reader = SafetensorsReader(hf_dir)
    mapping = get_family(hf_config).from_hf_config(hf_config)
    check_hf_tensor_names(mapping, reader)
    _prepare_out_dir(out_dir, overwrite, hf_dir)
    params_dtype = _resolve_dtype(dtype, hf_config)

    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_searchr1.megatron.initialize import initialize_megatron
    from megatron_searchr1.models.gpt import build_gpt_model

    initialize_megatron(tp=tp, pp=pp, ep=ep)
    rank = dist.get_rank()
    model = all_ranks_ok(build_gpt_model, hf_config, params_dtype=params_dtype)
    mapping = bind_mapping(hf_config, model)
    all_ranks_ok(load_hf_weights, model, reader, mapping, progress=rank == 0)
    if rank == 0:
        if overwrite and os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.makedirs(out_dir, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), out_dir)
    dist.barrier()
    if rank == 0:
        write_checkpoint_metadata(out_dir, hf_dir, tp=tp, pp=pp, padded_vocab_size=mapping.dims.padded_vocab_size,
                                  dtype=params_dtype)
        print(f"wrote Megatron checkpoint (saved at TP={tp} PP={pp}; loads at any TP/PP) to {out_dir}")
    dist.barrier()


def megatron_to_hf(ckpt_dir: str, out_dir: str, *, tp: int = 1, pp: int = 1, dtype: str = "auto",
                   overwrite: bool = False, ep: int = 1) -> None:
    """Convert a Megatron dist checkpoint (saved at any TP/PP) to an HF safetensors dir, loading it at TP/PP."""
    meta = read_checkpoint_metadata(ckpt_dir)
    hf_aux = os.path.join(ckpt_dir, HF_SUBDIR)
    hf_config = load_hf_config(hf_aux)
    check_sizes(hf_config, tp, pp, ep)
    _prepare_out_dir(out_dir, overwrite, ckpt_dir)
    params_dtype = DTYPES[meta.get("dtype", "float32")]
    out_dtype = _resolve_dtype(dtype, hf_config)

    import torch.distributed as dist

    from megatron_searchr1.megatron.initialize import initialize_megatron
    from megatron_searchr1.models.gpt import build_gpt_model

    initialize_megatron(tp=tp, pp=pp, ep=ep)
    rank = dist.get_rank()
    model = all_ranks_ok(build_gpt_model, hf_config, params_dtype=params_dtype)
    all_ranks_ok(load_megatron_checkpoint, model, ckpt_dir)
    write_hf_dir(model, bind_mapping(hf_config, model), hf_aux, out_dir, out_dtype, overwrite=overwrite,
                 progress=rank == 0)
    if rank == 0:
        print(f"wrote HF checkpoint ({str(out_dtype).replace('torch.', '')}) to {out_dir}")
    dist.barrier()
