"""Which weights a model starts from: an HF directory, a converted Megatron checkpoint, or a training run's step.

    source = pin_model_source(cfg.model.megatron_ckpt or cfg.model.path)   # every rank: one concrete directory
    load = weights_loader(hf_config, source)                               # load(bare_model)

A run root (`<run>/checkpoints`, with `latest`) moves while that run trains on, so the RL trainer pins it once, on
rank 0 for every rank, to one step directory: the actor's start and the frozen reference use it, the checkpoints
record it, and a resumed run reloads the reference from the recorded directory (the KL term keeps one anchor).
"""
from __future__ import annotations

import json
import os

import torch.distributed as dist
from transformers import GenerationConfig

from megatron_searchr1.checkpoint import MARKER_FILE, latest_step, step_dir
from megatron_searchr1.cli import UsageError
from megatron_searchr1.models.convert import (
    SafetensorsReader, bind_mapping, load_hf_weights, load_megatron_checkpoint,
)


def weights_loader(hf_config, source: str):
    """`load(bare_model)` from a converted Megatron checkpoint dir, a run's checkpoint root or step, or an HF dir
    (a critic's value head stays zero)."""
    source = resolve_model_source(source)
    refuse_adapter_only(source)
    if os.path.isfile(os.path.join(source, "metadata.json")):
        return lambda m: load_megatron_checkpoint(m, source)
    reader = SafetensorsReader(source)
    return lambda m: load_hf_weights(m, reader, bind_mapping(hf_config, m))


def refuse_adapter_only(source: str) -> None:
    """A LoRA run's checkpoint holds its adapters only (checkpoint.json's `lora_models`), not weights to start a
    model from: a UsageError naming what to use instead."""
    marker = os.path.join(os.path.dirname(os.path.abspath(source)), MARKER_FILE)
    if not os.path.isfile(marker):
        return
    with open(marker) as f:
        lora_models = json.load(f).get("lora_models", [])
    if os.path.basename(os.path.abspath(source)) in lora_models:
        raise UsageError(f"{source} holds LoRA adapters only, not a whole model: start from that run's merged export "
                         "(<its output_dir>/hf) as model.path, with model.megatron_ckpt=null")


def resolve_model_source(path: str) -> str:
    """A training run's checkpoint root (it has `latest`) means its latest actor: `<root>/step_N/actor`; one step
    directory (`<root>/step_N`) means that step's actor."""
    if os.path.isfile(os.path.join(path, "actor", "metadata.json")):
        return os.path.join(path, "actor")
    for root in (path, os.path.join(path, "checkpoints")):
        if os.path.isfile(os.path.join(root, "latest")):
            step = latest_step(root)
            if step is not None:
                return os.path.join(step_dir(root, step), "actor")
    return path


def pin_model_source(path: str) -> str:
    """`resolve_model_source` once, decided on rank 0 for every rank: a run root means its latest step, which moves
    while that run trains on (and two nodes could read different `latest` files). The actor's start and the frozen
    reference use this one step directory; the trainer records it in its checkpoints and, on resume, reloads the
    reference from the recorded one (`Policy.load_weights`), so the KL term keeps one anchor across restarts."""
    several = dist.is_initialized() and dist.get_world_size() > 1
    source = resolve_model_source(path) if not several or dist.get_rank() == 0 else None
    if source is not None and os.path.exists(source):
        source = os.path.abspath(source)
    box = [source]
    if several:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def stop_token_ids(tokenizer, hf_dir: str) -> tuple[int, ...]:
    """End-of-turn ids (eos of the tokenizer and the generation config): a turn that ends with one is invalid."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    try:
        eos = GenerationConfig.from_pretrained(hf_dir).eos_token_id
        ids.update([eos] if isinstance(eos, int) else list(eos or []))
    except Exception:  # noqa: BLE001 - no generation_config.json: the tokenizer's eos is enough
        pass
    return tuple(sorted(ids))
