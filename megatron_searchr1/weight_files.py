"""Whole safetensors files, checked with the standard library alone: every shard a model.safetensors.index.json
lists is there, and each *.safetensors file holds its header and every tensor's bytes. Headers and sizes only, so a
copy cut short is refused in milliseconds, naming the file, before anything loads it.

A leaf of the package (it imports nothing of it): the converters' checks (models/hf_files.py) and the trainer's
config check (config/rl.py) both call it and turn `WeightFileError` into their own one-line error.

    check_weight_files("/models/qwen2.5-3b", "model.path", require=False)   # WeightFileError naming the file
"""
from __future__ import annotations

import json
import os
import struct


class WeightFileError(ValueError):
    """A safetensors file or shard that is missing, cut short or corrupt; the message names it and what to do."""


def check_weight_files(hf_dir: str, flag: str = "--hf-dir", require: bool = True) -> None:
    """WeightFileError unless every shard model.safetensors.index.json lists is there and every *.safetensors file is
    whole (`check_safetensors`): headers and sizes only, so the converter and the trainer's config check refuse a
    copy cut short in milliseconds, naming the file. require: no *.safetensors at all is an error too."""
    shards = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):  # a sharded model: every shard its index lists must be there
        try:
            with open(index, encoding="utf-8") as f:
                listed = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise WeightFileError(f"{index} is not a valid safetensors index (JSON with a weight_map): copy it "
                             "again") from None
        missing = [name for name in listed if name not in shards]
        if missing:
            raise WeightFileError(f"{hf_dir}: shard file(s) {', '.join(missing)} listed in model.safetensors.index.json "
                             "are missing: copy or download them")
    if not shards and require:
        raise WeightFileError(f"{flag} {hf_dir!r} has no *.safetensors weights: save the model with "
                         "save_pretrained(dir, safe_serialization=True)")
    for name in shards:
        check_safetensors(os.path.join(hf_dir, name))


def check_safetensors(path: str) -> None:
    """WeightFileError naming `path` when it is not a whole safetensors file: an 8-byte little-endian header length, a
    JSON header, then the tensor bytes, whose largest end offset must fit in the file."""
    size = os.path.getsize(path)
    fix = "the file is truncated or corrupt: copy or download it again"
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise WeightFileError(f"{path} has {size} bytes, too few for a safetensors header: {fix}")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise WeightFileError(f"{path}: its header claims {n} bytes but the file has {size}: {fix}")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise WeightFileError(f"{path}: its header is not valid JSON: {fix}") from None
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)
            and "data_offsets" in t]
    if ends and 8 + n + max(ends) > size:
        raise WeightFileError(f"{path} has {size} bytes but its tensors need {8 + n + max(ends)}: {fix}")
