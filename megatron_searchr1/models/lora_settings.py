"""LoRA's hyper-parameters and the HF projection names they target, without torch: the configs validate
`model.lora` with them before a command line imports anything heavy (models/lora.py re-exports them)."""
from __future__ import annotations

from dataclasses import dataclass

# HF projection -> (Megatron linear suffix within a layer, TP kind)
PROJECTIONS: dict[str, tuple[str, str]] = {
    "q_proj": ("self_attention.linear_qkv", "column"),
    "k_proj": ("self_attention.linear_qkv", "column"),
    "v_proj": ("self_attention.linear_qkv", "column"),
    "o_proj": ("self_attention.linear_proj", "row"),
    "gate_proj": ("mlp.linear_fc1", "column"),
    "up_proj": ("mlp.linear_fc1", "column"),
    "down_proj": ("mlp.linear_fc2", "row"),
}
# HF module path of each projection within `model.layers.{i}.` (PEFT's key names)
HF_MODULE = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
             "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
             "down_proj": "mlp.down_proj"}


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
        unknown = [t for t in self.targets if t != "all" and t not in PROJECTIONS]
        if unknown or not self.targets:
            raise ValueError(f"lora targets {list(self.targets)}: choose `all` or some of {', '.join(PROJECTIONS)} "
                             f"(unknown: {unknown}; the output layer / lm_head is not adaptable here)")

    @property
    def scale(self) -> float:
        """alpha / rank (PEFT's `scaling`; no rsLoRA)."""
        return self.alpha / self.rank

    @property
    def projections(self) -> tuple[str, ...]:
        """The targeted HF projections, in PROJECTIONS' order (`all` expanded)."""
        return tuple(p for p in PROJECTIONS if "all" in self.targets or p in self.targets)
