"""Write a live Megatron actor as a Hugging Face directory, through the weight sync (one gather path for both).

    export_hf(actor, mapping, hf_src_dir="base_model", out_dir="runs/x/hf")     # every rank calls it

The weight sync already gathers TP shards, maps names with the family mapping, trims the padded vocabulary and
brings every pipeline stage's tensors to the ranks that feed an engine. Exporting is the same with a different
receiver: `SafetensorsSink` on rank 0 collects the tensors and writes `model.safetensors` plus the source's
config and tokenizer files, so the result loads with `transformers` and vLLM.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Iterable

import torch

from megatron_searchr1.models.convert import HF_AUX_FILES


class SafetensorsSink:
    """A weight-sync receiver that writes an HF directory when the sync finishes."""

    def __init__(self, out_dir: str, hf_src_dir: str, dtype: torch.dtype):
        self.out_dir, self.hf_src_dir, self.dtype = out_dir, hf_src_dir, dtype
        self.tensors: dict[str, torch.Tensor] = {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in weights:  # the sync hands out views of its bucket buffer: copy
            self.tensors[name] = t.detach().to(self.dtype).cpu().clone().contiguous()

    def finish_weight_sync(self) -> None:
        from safetensors.torch import save_file

        os.makedirs(self.out_dir, exist_ok=True)
        save_file(self.tensors, os.path.join(self.out_dir, "model.safetensors"), metadata={"format": "pt"})
        for name in HF_AUX_FILES:
            src = os.path.join(self.hf_src_dir, name)
            if os.path.isfile(src):
                shutil.copy2(src, os.path.join(self.out_dir, name))
        cfg_path = os.path.join(self.out_dir, "config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        cfg["dtype"] = str(self.dtype).replace("torch.", "")
        cfg.pop("torch_dtype", None)
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2)


def export_hf(model, mapping, hf_src_dir: str, out_dir: str, dtype: torch.dtype = torch.float32) -> None:
    """Every rank calls this; rank 0 writes `out_dir` (config/tokenizer copied from `hf_src_dir`)."""
    import torch.distributed as dist

    from megatron_searchr1.rollout.weight_sync import sync_weights

    rank = dist.get_rank() if dist.is_initialized() else 0
    sink = SafetensorsSink(out_dir, hf_src_dir, dtype) if rank == 0 else None
    sync_weights(model, sink, mapping, dtype=dtype)
    if dist.is_initialized():
        dist.barrier()
