"""Export a LoRA-adapted Megatron model the two ways LLaMA-Factory users expect (every rank calls both):

    export_merged_hf(model, hf_config, hf_src_dir="base_model", out_dir="runs/x/merged")   # plain HF model
    write_peft_adapter(model, out_dir="runs/x/adapter", base_model_name_or_path="base_model")

`export_merged_hf` writes `W + (alpha / r) * B A` folded into every adapted weight (`llamafactory-cli export`): the
merged tensors of `lora.merged_weights`, TP-gathered and renamed by the family mapping (`tp_merge`,
`megatron_to_hf`, both through `convert.gather_hf_weights`), saved by rank 0 as one safetensors file and completed
with the source's config and tokenizer files (`convert.finish_hf_dir`). The base weights are never changed in place.

`write_peft_adapter` writes what `peft.PeftModel.from_pretrained(hf_base, dir)` loads: `adapter_config.json`
(peft_type LORA, task_type CAUSAL_LM, r, lora_alpha, lora_dropout, target_modules, base_model_name_or_path) and
`adapter_model.safetensors` with PEFT's keys, `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`
(r, in) and `...lora_B.weight` (out, r).

Pipeline stages send their tensors to rank 0 as pickled CPU tensors (`gather_object`): fine for adapters (small) and
for the merged model of the sizes this is tested on; a multi-billion-parameter merged export at PP > 1 holds the
whole model on rank 0's host once.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

import torch

from megatron_searchr1.models.lora import HF_MODULE, LoraSettings, _bare, gather_adapter_state, merged_weights

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _collect_on_rank0(tensors: dict[str, torch.Tensor], keep: bool) -> dict[str, torch.Tensor]:
    """Union over the world of the `keep` ranks' {name: tensor} (CPU), on rank 0; {} elsewhere."""
    dist = _dist()
    mine = {n: t.cpu() for n, t in tensors.items()} if keep else {}
    if dist is None or dist.get_world_size() == 1:
        return mine
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0)
    out: dict[str, torch.Tensor] = {}
    for part in parts or []:
        out.update(part)
    return out


def _writes_stage() -> bool:
    """TP rank 0 of DP replica 0: the one rank per pipeline stage that contributes its stage's tensors."""
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0


def merged_hf_tensors(model: torch.nn.Module, hf_config: Any) -> dict[str, torch.Tensor]:
    """This pipeline stage's merged weights as full HF tensors (every TP rank of the stage must call it: the TP
    shards are all-gathered; all of them get the tensors)."""
    from megatron_searchr1.models.convert import bind_mapping, gather_hf_weights
    from megatron_searchr1.models.families import rename_layer

    bare = _bare(model)
    index = [layer.layer_number - 1 for layer in bare.decoder.layers] if hasattr(bare, "decoder") else []
    merged = ((rename_layer(name, index), t) for name, t in merged_weights(bare))
    return dict(gather_hf_weights(bare, bind_mapping(hf_config, bare), weights=merged))


def export_merged_hf(model: torch.nn.Module, hf_config: Any, hf_src_dir: str, out_dir: str,
                     dtype: torch.dtype = torch.float32) -> None:
    """Write the merged model (base + scale * B A) as a plain HF directory; every rank calls this, rank 0 writes.
    `hf_src_dir`: the base model's HF directory (config and tokenizer files are copied from it)."""
    from safetensors.torch import save_file

    from megatron_searchr1.models.convert import finish_hf_dir

    tensors = _collect_on_rank0(merged_hf_tensors(model, hf_config), keep=_writes_stage())
    dist = _dist()
    if dist is None or dist.get_rank() == 0:
        os.makedirs(out_dir, exist_ok=True)
        host = {n: t.detach().to(dtype).cpu().contiguous() for n, t in sorted(tensors.items())}
        save_file(host, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        finish_hf_dir(hf_src_dir, out_dir, dtype)
    if dist is not None:
        dist.barrier()


def peft_config(settings: LoraSettings, base_model_name_or_path: Optional[str]) -> dict:
    """adapter_config.json's fields (PEFT's LoraConfig, no rsLoRA, no DoRA, biases untouched)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": sorted(settings.projections),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
        "revision": None,
    }


def write_peft_adapter(model: torch.nn.Module, out_dir: str, base_model_name_or_path: Optional[str] = None,
                       dtype: Optional[torch.dtype] = None) -> None:
    """Write a PEFT LoRA adapter directory for `model` (apply_lora'd); every rank calls it, rank 0 writes.
    `dtype`: of the saved tensors (default: the adapters' own)."""
    from safetensors.torch import save_file

    settings: LoraSettings = _bare(model).lora_settings
    state = _collect_on_rank0(gather_adapter_state(model), keep=_writes_stage())
    dist = _dist()
    if dist is None or dist.get_rank() == 0:
        os.makedirs(out_dir, exist_ok=True)
        tensors = {PEFT_PREFIX + n: (t.to(dtype) if dtype else t).contiguous() for n, t in sorted(state.items())}
        save_file(tensors, os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
            json.dump(peft_config(settings, base_model_name_or_path), f, indent=2)
    if dist is not None:
        dist.barrier()


def read_peft_adapter(adapter_dir: str) -> tuple[LoraSettings, dict[str, torch.Tensor]]:
    """(settings, full adapter tensors) of a PEFT LoRA directory (ours or PEFT's), for `load_adapter_state`."""
    from safetensors.torch import load_file

    with open(os.path.join(adapter_dir, ADAPTER_CONFIG)) as f:
        cfg = json.load(f)
    if cfg.get("peft_type") != "LORA" or cfg.get("use_rslora") or cfg.get("use_dora"):
        raise ValueError(f"{adapter_dir}: only plain LoRA adapters (no rsLoRA / DoRA) load here, got "
                         f"peft_type={cfg.get('peft_type')}, use_rslora={cfg.get('use_rslora')}")
    targets = cfg["target_modules"]
    targets = [targets] if isinstance(targets, str) else sorted(targets)
    known = set(HF_MODULE)
    if not set(targets) <= known:
        raise ValueError(f"{adapter_dir}: target_modules {targets} include modules other than {sorted(known)}")
    settings = LoraSettings(rank=cfg["r"], alpha=cfg["lora_alpha"], dropout=cfg.get("lora_dropout", 0.0),
                            targets=tuple(targets))
    return settings, load_file(os.path.join(adapter_dir, ADAPTER_WEIGHTS))
