"""Freeze fine-tuning (LLaMA-Factory's `finetuning_type: freeze`) on Megatron: the real weights of a few decoder
layers train, everything else is frozen.

    settings = FreezeSettings(trainable_layers=2, trainable_modules=("all",), extra_modules=("norm",))
    apply_freeze(model, settings, bind_mapping(hf_config, model))    # bare stage, after its weights load

Which parameters train is LLaMA-Factory's rule (src/llamafactory/model/adapter.py, `_setup_freeze_tuning`), applied
to the HF names each Megatron tensor is built from (models/families: `hf_sources`), so it means the same here:
- the trainable layers: `trainable_layers` N > 0 = the last N decoder layers, N < 0 = the first |N| (clamped to the
  model's layers; 0 = none);
- within them `trainable_modules`: `all`, or some of the layer's HF children `self_attn`, `mlp`,
  `input_layernorm`, `post_attention_layernorm` (LLaMA-Factory refuses anything else, e.g. `q_proj`);
- plus `extra_modules`: non-layer modules `embed_tokens`, `norm`, `lm_head` (not when tied to the embedding: it
  is no parameter of its own there, and LLaMA-Factory refuses it too).
A parameter trains when one of the patterns `.{i}.{module}` (`.{i}.` for all) or an extra module name is a
SUBSTRING of its HF name, as there: `norm` therefore also trains every layer's `*_layernorm` and Qwen3's
`q_norm` / `k_norm`, in every layer, exactly as LLaMA-Factory does.

Megatron fuses several HF tensors into one (q/k/v, gate/up); they always share an HF child module, so a fused
tensor is either wholly trainable or wholly frozen. Frozen parameters get `requires_grad=False` before DDP and the
optimizer are built (no gradient buffer, no Adam state); the checkpoint keys their Adam state per layer
(checkpoint.py: `_optimizer_model_state`). Torch-free to import: the configs validate with `FreezeSettings`.
"""
from __future__ import annotations

from dataclasses import dataclass

LAYER_MODULES = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
EXTRA_MODULES = ("embed_tokens", "norm", "lm_head")


def _names(value) -> tuple[str, ...]:
    if isinstance(value, str):  # "mlp,self_attn" as LLaMA-Factory's YAML writes it
        value = value.split(",")
    return tuple(str(v).strip() for v in value if str(v).strip())


@dataclass(frozen=True)
class FreezeSettings:
    """LLaMA-Factory's freeze_trainable_layers, freeze_trainable_modules and freeze_extra_modules."""

    trainable_layers: int = 2
    """N > 0: the last N decoder layers train; N < 0: the first |N|; 0: none (only the extra modules)."""
    trainable_modules: tuple[str, ...] = ("all",)
    """Within the trainable layers: `all` or some of LAYER_MODULES."""
    extra_modules: tuple[str, ...] = ()
    """Non-layer modules that train too: some of EXTRA_MODULES."""

    def __post_init__(self):
        object.__setattr__(self, "trainable_modules", _names(self.trainable_modules))
        object.__setattr__(self, "extra_modules", _names(self.extra_modules))
        if isinstance(self.trainable_layers, bool) or not isinstance(self.trainable_layers, int):
            raise ValueError(f"freeze trainable_layers must be an integer, got {self.trainable_layers!r}")
        bad = [m for m in self.trainable_modules if m != "all" and m not in LAYER_MODULES]
        if bad or not self.trainable_modules:
            raise ValueError(f"freeze trainable_modules {list(self.trainable_modules)}: choose `all` or some of "
                             f"{', '.join(LAYER_MODULES)} (a decoder layer's HF children; unknown: {bad})")
        bad = [m for m in self.extra_modules if m not in EXTRA_MODULES]
        if bad:
            raise ValueError(f"freeze extra_modules {list(self.extra_modules)}: choose some of "
                             f"{', '.join(EXTRA_MODULES)} (unknown: {bad})")
        if self.trainable_layers == 0 and not self.extra_modules:
            raise ValueError("freeze trainable_layers=0 with no extra_modules trains nothing: set trainable_layers "
                             "(N > 0: the last N layers, N < 0: the first |N|) or extra_modules")

    def layer_ids(self, num_layers: int) -> range:
        """The trainable decoder layers (global indices), LLaMA-Factory's rule.

        >>> FreezeSettings(2).layer_ids(6), FreezeSettings(-2).layer_ids(6), FreezeSettings(9).layer_ids(6)
        (range(4, 6), range(0, 2), range(0, 6))
        """
        n = self.trainable_layers
        return range(max(0, num_layers - n), num_layers) if n > 0 else range(min(-n, num_layers))

    def patterns(self, num_layers: int) -> list[str]:
        """The substrings that make an HF parameter name trainable (LLaMA-Factory's `trainable_layers` list)."""
        out = [f".{i}.{'' if m == 'all' else m}" for m in self.trainable_modules for i in self.layer_ids(num_layers)]
        return out + list(self.extra_modules)

    def trains(self, hf_name: str, num_layers: int) -> bool:
        """Whether the HF parameter `hf_name` trains.

        >>> s = FreezeSettings(1, ("mlp",), ("norm",))
        >>> [s.trains(f"model.layers.{n}.weight", 2) for n in ("1.mlp.up_proj", "0.mlp.up_proj", "1.self_attn.q_proj",
        ...                                                   "0.input_layernorm")]
        [True, False, False, True]
        """
        return any(p in hf_name for p in self.patterns(num_layers))


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
