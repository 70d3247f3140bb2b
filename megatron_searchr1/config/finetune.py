"""The two partial fine-tuning types as validated records, LLaMA-Factory's `finetuning_type: lora` and `freeze`.

    LoraSettings(rank=8, alpha=16, dropout=0.05, targets=("q_proj", "v_proj"))      # models/lora.py applies it
    FreezeSettings(trainable_layers=2, extra_modules=("norm",))                     # models/freeze.py applies it

They live in the configuration layer because `model.lora` / `model.freeze` are checked with them before a command
line imports anything heavy, and the model code takes them from here: no torch, no model import. Names are HF
module names, the ones a LLaMA-Factory user writes; models/ maps them onto Megatron's fused linears.

Which parameters freeze tuning trains is LLaMA-Factory's rule (src/llamafactory/model/adapter.py,
`_setup_freeze_tuning`), applied to the HF names each Megatron tensor is built from:
- the trainable layers: `trainable_layers` N > 0 = the last N decoder layers, N < 0 = the first |N| (clamped to the
  model's layers; 0 = none);
- within them `trainable_modules`: `all`, or some of the layer's HF children `self_attn`, `mlp`,
  `input_layernorm`, `post_attention_layernorm` (LLaMA-Factory refuses anything else, e.g. `q_proj`);
- plus `extra_modules`: non-layer modules `embed_tokens`, `norm`, `lm_head`.
A parameter trains when one of the patterns `.{i}.{module}` (`.{i}.` for all) or an extra module name is a
SUBSTRING of its HF name, as there: `norm` therefore also trains every layer's `*_layernorm` and Qwen3's
`q_norm` / `k_norm`, in every layer, exactly as LLaMA-Factory does.
"""
from __future__ import annotations

from dataclasses import dataclass

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The HF projections LoRA can adapt, in the order adapters are made (models/lora_settings.py maps each onto its
Megatron linear)."""
LAYER_MODULES = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
"""A decoder layer's HF children that freeze tuning can train."""
EXTRA_MODULES = ("embed_tokens", "norm", "lm_head")
"""The non-layer HF modules that freeze tuning can train."""


def _names(value) -> tuple[str, ...]:
    """A tuple of names from a tuple or a comma list.

    >>> _names("mlp, self_attn"), _names(["norm"])
    (('mlp', 'self_attn'), ('norm',))
    """
    if isinstance(value, str):  # "mlp,self_attn" as LLaMA-Factory's YAML writes it
        value = value.split(",")
    return tuple(str(v).strip() for v in value if str(v).strip())


@dataclass(frozen=True)
class LoraSettings:
    """LoRA hyper-parameters, with LLaMA-Factory's meanings (lora_rank, lora_alpha, lora_dropout, lora_target)."""

    rank: int = 8
    """r: the adapters' inner width."""
    alpha: float | None = None
    """Scale numerator: a layer adds (alpha / rank) * B A x. None = 2 * rank (LLaMA-Factory's default)."""
    dropout: float = 0.0
    """Dropout probability on the adapters' input (training mode only)."""
    targets: tuple[str, ...] = ("all",)
    """HF module names to adapt (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) or `all`."""

    def __post_init__(self):
        if isinstance(self.targets, str):  # "q_proj,v_proj" as LLaMA-Factory's YAML writes it
            object.__setattr__(self, "targets", tuple(t.strip() for t in self.targets.split(",") if t.strip()))
        object.__setattr__(self, "targets", tuple(self.targets))
        if self.rank < 1:
            raise ValueError(f"lora rank must be >= 1, got {self.rank}")
        if self.alpha is None:
            object.__setattr__(self, "alpha", float(2 * self.rank))
        if self.alpha <= 0:
            raise ValueError(f"lora alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora dropout must be in [0, 1), got {self.dropout}")
        unknown = [t for t in self.targets if t != "all" and t not in LORA_TARGETS]
        if unknown or not self.targets:
            raise ValueError(f"lora targets {list(self.targets)}: choose `all` or some of {', '.join(LORA_TARGETS)} "
                             f"(unknown: {unknown}; the output layer / lm_head is not adaptable here)")

    @property
    def scale(self) -> float:
        """alpha / rank (PEFT's `scaling`; no rsLoRA).

        >>> LoraSettings(rank=4, alpha=12).scale
        3.0
        """
        return self.alpha / self.rank

    @property
    def projections(self) -> tuple[str, ...]:
        """The targeted HF projections, in LORA_TARGETS' order (`all` expanded).

        >>> LoraSettings(targets="v_proj,q_proj").projections
        ('q_proj', 'v_proj')
        """
        return tuple(p for p in LORA_TARGETS if "all" in self.targets or p in self.targets)


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
