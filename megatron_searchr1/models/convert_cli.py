"""The conversion command lines: checkpoints_convert/{hf_to_megatron,megatron_to_hf}.py and the console scripts
searchr1-hf-to-megatron / searchr1-megatron-to-hf (the conversion itself: models/convert.py).

    python checkpoints_convert/hf_to_megatron.py --hf-dir HF --out-dir CKPT [--tp 2 --pp 2 under torchrun]
    python checkpoints_convert/megatron_to_hf.py --ckpt-dir CKPT --out-dir HF2 [--dtype bfloat16]

This module imports neither torch nor megatron: the flags, the input and output directories and the HF files
(config.json parses, tokenizer files present, safetensors whole: models/hf_files.py) are checked before convert.py
loads (a mistake is one `error:` line in about a second, not after ten seconds of imports).
What needs the model (its architecture, whether TP/PP fit it and the world size, the tensors) convert.py checks
next, and reports the same way: one `error:` line naming the flag to change, exit code 2.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

from megatron_searchr1.cli import ArgumentParser, UsageError, at_least, console
from megatron_searchr1.models.hf_files import check_hf_files

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")  # convert.DTYPES, plus auto (a test keeps them equal)


def _common_args(p: ArgumentParser) -> None:
    p.add_argument("--tp", type=at_least(1), default=1,
                   help="tensor-parallel size (world size must be a multiple of tp*pp)")
    p.add_argument("--pp", type=at_least(1), default=1, help="pipeline-parallel size")
    p.add_argument("--ep", type=at_least(1), default=1,
                   help="expert-parallel size, MoE models (world size must be a multiple of tp*pp*ep)")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="weight dtype (auto: the dtype in config.json)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")


def check_dirs(in_flag: str, in_dir: str, out_dir: str, overwrite: bool, need_file: Optional[str] = None) -> None:
    """UsageError for a missing input directory, an output that is the input, a file, or a non-empty directory
    without --overwrite (convert.py checks the same again: it is also called from Python)."""
    if not os.path.isdir(in_dir):
        raise UsageError(f"{in_flag} {in_dir!r} does not exist" if not os.path.exists(in_dir)
                         else f"{in_flag} {in_dir!r} is a file: give a directory")
    if need_file and not os.path.isfile(os.path.join(in_dir, need_file)):
        raise UsageError(f"{in_flag} {in_dir!r} has no {need_file}: not a Hugging Face model directory")
    if os.path.realpath(out_dir) == os.path.realpath(in_dir):
        raise UsageError(f"--out-dir {out_dir!r} is the input directory: choose another")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UsageError(f"--out-dir {out_dir!r} is a file: give a directory")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise UsageError(f"--out-dir {out_dir!r} is not empty: pass --overwrite or choose another")


def _convert(name: str, kwargs: dict) -> int:
    """Import convert.py (torch, megatron) and run `convert.<name>(**kwargs)`; its input errors become UsageErrors."""
    import warnings

    # Start-up noise that says nothing about the conversion (no Apex/TE on the CPU, DCP deprecations).
    for pattern in (".*Apex.*", ".*Transformer Engine.*", ".*Please use DTensor instead.*",
                    ".*`load_state_dict` is deprecated.*", ".*full scope is deprecated.*"):
        warnings.filterwarnings("ignore", message=pattern)
    from megatron_searchr1.models import convert

    try:
        getattr(convert, name)(**kwargs)
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
    check_dirs("--hf-dir", a.hf_dir, a.out_dir, a.overwrite, need_file="config.json")
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
    return _convert("megatron_to_hf", dict(ckpt_dir=a.ckpt_dir, out_dir=a.out_dir, tp=a.tp, pp=a.pp, ep=a.ep,
                                           dtype=a.dtype,
                                           overwrite=a.overwrite))


hf_to_megatron_cli = console(hf_to_megatron_main)
megatron_to_hf_cli = console(megatron_to_hf_main)
