"""The conversion command lines: checkpoints_convert/{hf_to_megatron,megatron_to_hf}.py and the console scripts
searchr1-hf-to-megatron / searchr1-megatron-to-hf (the conversions themselves: models/convert_megatron.py, over the
library models/convert.py).

    python checkpoints_convert/hf_to_megatron.py --hf-dir HF --out-dir CKPT [--tp 2 --pp 2 under torchrun]
    python checkpoints_convert/megatron_to_hf.py --ckpt-dir CKPT --out-dir HF2 [--dtype bfloat16]

This module imports neither torch nor megatron. Before the conversion loads, it checks what files and flags alone
decide (models/hf_files.py): the input directory and its config.json, the architecture, whether --tp/--pp/--ep fit
the model's heads, layers and experts and torchrun's world size, the tokenizer files, whole safetensors files (or,
for megatron_to_hf, the checkpoint's own metadata files), and an output directory that can be written. A mistake is
one `error:` line naming the file or flag and what to do, exit code 2, in about a second rather than after the
imports. What needs the tensors (their names and shapes against config.json, a loadable dist checkpoint) the
conversion checks next, and reports the same way.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

from megatron_searchr1.cli import ArgumentParser, UsageError, at_least, console
from megatron_searchr1.models.hf_files import (
    check_architecture, check_hf_files, check_parallel_fit, check_writable_dir, read_config, read_json_object,
)

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")  # convert.DTYPES, plus auto (a test keeps them equal)
# convert.META_FILE / HF_SUBDIR / META_FORMAT, which this module may not import (torch); a test keeps them equal
META_FILE, HF_SUBDIR, META_FORMAT = "searchr1_checkpoint.json", "hf", "megatron_searchr1.model_checkpoint"


def _common_args(p: ArgumentParser) -> None:
    p.add_argument("--tp", type=at_least(1), default=1,
                   help="tensor-parallel size (world size must be a multiple of tp*pp)")
    p.add_argument("--pp", type=at_least(1), default=1, help="pipeline-parallel size")
    p.add_argument("--ep", type=at_least(1), default=1,
                   help="expert-parallel size, MoE models (world size must be a multiple of tp*pp*ep)")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="weight dtype (auto: the dtype in config.json)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")


def check_dirs(in_flag: str, in_dir: str, out_dir: str, overwrite: bool) -> None:
    """UsageError for a missing input directory, an output that is the input, a file, a non-empty directory
    without --overwrite, or one that cannot be written (convert_megatron.py checks the first ones again: it is also
    called from Python)."""
    if not os.path.isdir(in_dir):
        raise UsageError(f"{in_flag} {in_dir!r} does not exist" if not os.path.exists(in_dir)
                         else f"{in_flag} {in_dir!r} is a file: give a directory")
    if os.path.realpath(out_dir) == os.path.realpath(in_dir):
        raise UsageError(f"--out-dir {out_dir!r} is the input directory: choose another")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UsageError(f"--out-dir {out_dir!r} is a file: give a directory")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise UsageError(f"--out-dir {out_dir!r} is not empty: pass --overwrite or choose another")
    check_writable_dir(out_dir)


def world_size() -> int:
    """torchrun's WORLD_SIZE (1 in a plain process)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_checkpoint_files(ckpt_dir: str, flag: str = "--ckpt-dir") -> dict:
    """The metadata of a checkpoint hf_to_megatron wrote (its META_FILE as a dict), checked without torch: the
    metadata parses and has our format, the copied HF config (hf/config.json) is there and of a supported
    architecture, and Megatron's own index files (.metadata, metadata.json) exist. Whether the shard files the
    index lists are all there convert.py checks (reading .metadata needs torch)."""
    path = os.path.join(ckpt_dir, META_FILE)
    if not os.path.isfile(path):
        raise UsageError(f"{flag} {ckpt_dir!r} has no {META_FILE}: not a checkpoint written by hf_to_megatron, or its "
                         "conversion did not finish (convert the model again)")
    meta = read_json_object(path, "convert the model again")
    if meta.get("format") != META_FORMAT:
        raise UsageError(f"{path} has format {meta.get('format')!r}, expected {META_FORMAT!r}: not a checkpoint "
                         "written by hf_to_megatron")
    for name in (".metadata", "metadata.json"):
        if not os.path.isfile(os.path.join(ckpt_dir, name)):
            raise UsageError(f"{flag} {ckpt_dir!r} has no {name}: the Megatron dist checkpoint is incomplete "
                             "(convert the model again)")
    hf_aux = os.path.join(ckpt_dir, HF_SUBDIR)
    if not os.path.isfile(os.path.join(hf_aux, "config.json")):
        raise UsageError(f"{flag} {ckpt_dir!r} has no {HF_SUBDIR}/config.json (the HF config copied at conversion): "
                         "convert the model again")
    config = read_config(hf_aux, flag=flag)
    check_architecture(config, os.path.join(hf_aux, "config.json"))
    return meta


def _convert(name: str, kwargs: dict) -> int:
    """Import the conversions (torch, megatron) and run `convert_megatron.<name>(**kwargs)`; their input errors become
    UsageErrors. Megatron's world, which the conversion started, is taken down on the way out, also after an
    error."""
    import warnings

    # Start-up noise that says nothing about the conversion (no Apex/TE on the CPU, DCP deprecations).
    for pattern in (".*Apex.*", ".*Transformer Engine.*", ".*Please use DTensor instead.*",
                    ".*`load_state_dict` is deprecated.*", ".*full scope is deprecated.*"):
        warnings.filterwarnings("ignore", message=pattern)
    from megatron_searchr1.models import convert, convert_megatron

    try:
        getattr(convert_megatron, name)(**kwargs)
    except (convert.ConversionError, ValueError) as e:  # ValueError: what the builder / the mapping reject
        raise UsageError(str(e)) from None
    finally:
        try:
            from megatron_searchr1.megatron.initialize import destroy_megatron

            destroy_megatron()
        except Exception:  # noqa: BLE001 - nothing was started, or it is already down
            pass
    return 0


def hf_to_megatron_main(argv: Optional[Sequence[str]] = None) -> int:
    p = ArgumentParser(description="Convert a Hugging Face Qwen2/Qwen3/Llama/Mistral dir to a Megatron dist "
                                   "checkpoint that loads at any TP/PP.")
    p.add_argument("--hf-dir", required=True, help="HF model directory (config.json + safetensors + tokenizer)")
    p.add_argument("--out-dir", required=True, help="checkpoint directory to write")
    _common_args(p)
    a = p.parse_args(argv)
    check_dirs("--hf-dir", a.hf_dir, a.out_dir, a.overwrite)
    config = read_config(a.hf_dir)
    where = os.path.join(a.hf_dir, "config.json")
    check_architecture(config, where)
    check_parallel_fit(config, a.tp, a.pp, a.ep, world_size(), where=where,
                       script="checkpoints_convert/hf_to_megatron.py")
    check_hf_files(a.hf_dir)
    return _convert("hf_to_megatron", dict(hf_dir=a.hf_dir, out_dir=a.out_dir, tp=a.tp, pp=a.pp, ep=a.ep, dtype=a.dtype,
                                           overwrite=a.overwrite))


def megatron_to_hf_main(argv: Optional[Sequence[str]] = None) -> int:
    p = ArgumentParser(description="Convert a Megatron dist checkpoint (saved at any TP/PP) to a Hugging Face "
                                   "safetensors dir with config and tokenizer.")
    p.add_argument("--ckpt-dir", required=True, help="checkpoint directory written by hf_to_megatron")
    p.add_argument("--out-dir", required=True, help="HF directory to write")
    _common_args(p)
    a = p.parse_args(argv)
    check_dirs("--ckpt-dir", a.ckpt_dir, a.out_dir, a.overwrite)
    check_checkpoint_files(a.ckpt_dir)
    where = os.path.join(a.ckpt_dir, HF_SUBDIR, "config.json")
    check_parallel_fit(read_config(os.path.join(a.ckpt_dir, HF_SUBDIR)), a.tp, a.pp, a.ep, world_size(), where=where,
                       script="checkpoints_convert/megatron_to_hf.py")
    return _convert("megatron_to_hf", dict(ckpt_dir=a.ckpt_dir, out_dir=a.out_dir, tp=a.tp, pp=a.pp, ep=a.ep,
                                           dtype=a.dtype, overwrite=a.overwrite))


hf_to_megatron_cli = console(hf_to_megatron_main)
megatron_to_hf_cli = console(megatron_to_hf_main)
