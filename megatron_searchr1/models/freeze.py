"""Freeze fine-tuning (LLaMA-Factory's `finetuning_type: freeze`) on Megatron: the real weights of a few decoder
layers train, everything else is frozen.

    settings = FreezeSettings(trainable_layers=2, trainable_modules=("all",), extra_modules=("norm",))
    apply_freeze(model, settings, bind_mapping(hf_config, model))    # bare stage, after its weights load

Which parameters train is LLaMA-Factory's rule, kept with the settings record in config/finetune.py
(`FreezeSettings.trains`: the trainable layers, the modules within them, the extra modules), applied here to the HF
names each Megatron tensor is built from (models/families: `hf_sources`), so it means the same as there. `lm_head`
is refused when the model ties it to the embedding: it is no parameter of its own there (LLaMA-Factory refuses it
too).

Megatron fuses several HF tensors into one (q/k/v, gate/up); they always share an HF child module, so a fused
tensor is either wholly trainable or wholly frozen. Frozen parameters get `requires_grad=False` before DDP and the
optimizer are built (no gradient buffer, no Adam state); the checkpoint keys their Adam state per layer
(checkpoint/optimizer.py: `optimizer_model_state`).
"""
from __future__ import annotations

from megatron_searchr1.config.finetune import FreezeSettings


def apply_freeze(model, settings: FreezeSettings, mapping) -> list[str]:
    """Set `requires_grad` on every parameter of `model` (a bare GPTModel stage, before wrap_ddp: DDP sizes its
    gradient buffers for what trains when it wraps) by `settings`; returns the global Megatron names that train on
    this stage. `mapping`: the model's family mapping (models/convert.py `bind_mapping`). Marks the model
    (`model.freeze_settings`): checkpoints key its optimizer state per layer."""
    from megatron_searchr1.models.convert import global_names
    from megatron_searchr1.models.forward import unwrap

    if unwrap(model) is not model:
        raise ValueError("apply_freeze takes the bare model, before wrap_ddp: DDP sizes its gradient buffers for "
                         "the parameters that are trainable when it wraps the model")
    dims = mapping.dims
    if "lm_head" in settings.extra_modules and dims.tie_embeddings:
        raise ValueError("freeze extra module lm_head: this model ties its output layer to the input embedding "
                         "(tie_word_embeddings), so lm_head is no parameter of its own (LLaMA-Factory refuses it "
                         "too): name embed_tokens, which trains both")
    trainable = []
    for local, name, p in global_names(model):
        flags = {settings.trains(hf, dims.num_layers) for hf in mapping.hf_sources(name)}
        if len(flags) != 1:  # cannot happen for the dense families: a fused tensor's sources share a module
            raise ValueError(f"{name}: its HF tensors {mapping.hf_sources(name)} would train only partly")
        p.requires_grad_(flags.pop())
        if p.requires_grad:
            trainable.append(name)
    model.freeze_settings = settings
    return trainable


def is_frozen_subset(model) -> bool:
    """Whether `model` (bare or DDP-wrapped) trains a subset chosen by `apply_freeze`."""
    from megatron_searchr1.models.forward import unwrap

    return getattr(unwrap(model), "freeze_settings", None) is not None
