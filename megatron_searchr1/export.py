"""Write a live Megatron actor (the trainers' end-of-run export) as a Hugging Face directory.

    export_hf(actor, mapping, hf_src_dir="base_model", out_dir="runs/x/hf")     # every rank calls it

The same gather path as the checkpoint converter (models/convert.py `write_hf_dir`: TP shards all-gathered, names
mapped by the family, padded vocabulary trimmed, one file per pipeline stage), with the config and tokenizer files
of the model the run started from, so the result loads with `transformers` and vLLM.
"""
from __future__ import annotations

import torch

from megatron_searchr1.models.convert import write_hf_dir
from megatron_searchr1.models.forward import unwrap


def export_hf(model, mapping, hf_src_dir: str, out_dir: str, dtype: torch.dtype = torch.float32) -> None:
    """Every rank calls this; the writing ranks fill `out_dir` (config/tokenizer copied from `hf_src_dir`)."""
    write_hf_dir(unwrap(model), mapping, hf_src_dir, out_dir, dtype)
