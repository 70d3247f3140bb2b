"""Megatron models from Hugging Face configs, and the HF <-> Megatron name mapping per model family.

The public names, stable for users' scripts across the package's internal moves:

    from megatron_searchr1.models import build_gpt_model, load_megatron_checkpoint, forward_logits, get_family

    initialize_megatron(tp=2, pp=1)                       # megatron_searchr1.megatron.initialize
    model = build_gpt_model(hf_config)                    # this rank's stage, random weights
    load_megatron_checkpoint(model, "runs/ckpt")          # any TP/PP it was saved at
    logits = forward_logits(model, input_ids)             # (B, T, V) on the last pipeline stage

- building: ``build_gpt_model``, ``build_critic_model`` (the same trunk with a value head);
- checkpoints: ``load_megatron_checkpoint``, ``hf_to_megatron``, ``megatron_to_hf`` (what
  ``checkpoints_convert/`` runs);
- forward passes: ``forward_logits``, ``forward_values``;
- the family registry: ``FAMILIES``, ``SUPPORTED_ARCHITECTURES``, ``get_family``, ``mapping_for``, ``read_dims``,
  ``ModelFamily``, ``ModelDims``.

Each name is imported on first use (PEP 562): importing this package costs nothing, so the converters' and the
tiny-model maker's command lines, which live in this package, still check their arguments before torch loads.
"""
from __future__ import annotations

import importlib
from typing import Any

# public name -> the module that defines it (the one place to update when code moves)
_EXPORTS = {
    "build_gpt_model": "megatron_searchr1.models.gpt",
    "build_critic_model": "megatron_searchr1.models.critic",
    "load_megatron_checkpoint": "megatron_searchr1.models.convert",
    "hf_to_megatron": "megatron_searchr1.models.convert_megatron",
    "megatron_to_hf": "megatron_searchr1.models.convert_megatron",
    "forward_logits": "megatron_searchr1.models.forward",
    "forward_values": "megatron_searchr1.models.forward",
    "FAMILIES": "megatron_searchr1.models.families",
    "SUPPORTED_ARCHITECTURES": "megatron_searchr1.models.families",
    "get_family": "megatron_searchr1.models.families",
    "mapping_for": "megatron_searchr1.models.families",
    "read_dims": "megatron_searchr1.models.families",
    "ModelFamily": "megatron_searchr1.models.families",
    "ModelDims": "megatron_searchr1.models.families",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
