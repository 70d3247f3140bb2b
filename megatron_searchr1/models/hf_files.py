"""What a Hugging Face model directory must hold, checked without torch: a parseable config.json, tokenizer files,
whole safetensors files. The converters run these before torch loads; the trainer's tokenizer check uses the same
file list.

    check_hf_files("/models/qwen2.5-3b")     # UsageError naming the file and what to do, or nothing
"""
from __future__ import annotations

import json
import os
import struct

from megatron_searchr1.cli import UsageError

# Any one of these makes a tokenizer transformers can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def check_hf_files(hf_dir: str, flag: str = "--hf-dir") -> None:
    """What can be read without torch: config.json parses, a tokenizer is there (the trainer and vLLM need it next
    to the weights), and every *.safetensors file is whole (its header parses and its tensors end inside the file;
    a copy cut short otherwise fails deep inside the reader without naming the file)."""
    cfg_path = os.path.join(hf_dir, "config.json")
    try:
        with open(cfg_path) as f:
            json.load(f)
    except ValueError as e:
        raise UsageError(f"{cfg_path} is not valid JSON ({e}): copy the model's config.json again") from None
    if not any(os.path.isfile(os.path.join(hf_dir, f)) for f in TOKENIZER_FILES):
        raise UsageError(f"{flag} {hf_dir!r} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): copy the model's "
                         "tokenizer into it (tokenizer.save_pretrained(dir)); the converted model is useless without it")
    shards = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    if not shards:
        raise UsageError(f"{flag} {hf_dir!r} has no *.safetensors weights: save the model with "
                         "save_pretrained(dir, safe_serialization=True)")
    for name in shards:
        check_safetensors(os.path.join(hf_dir, name))


def check_safetensors(path: str) -> None:
    """UsageError naming `path` when it is not a whole safetensors file: an 8-byte little-endian header length, a
    JSON header, then the tensor bytes, whose largest end offset must fit in the file."""
    size = os.path.getsize(path)
    fix = "the file is truncated or corrupt: copy or download it again"
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise UsageError(f"{path} has {size} bytes, too few for a safetensors header: {fix}")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise UsageError(f"{path}: its header claims {n} bytes but the file has {size}: {fix}")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise UsageError(f"{path}: its header is not valid JSON: {fix}") from None
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)
            and "data_offsets" in t]
    if ends and 8 + n + max(ends) > size:
        raise UsageError(f"{path} has {size} bytes but its tensors need {8 + n + max(ends)}: {fix}")
