"""The run configuration: one YAML per experiment, dotted overrides on the command line.

    cfg = load_config("examples/grpo_tiny_cpu.yaml", ["rollout.max_turns=4", "algo.adv_estimator=grpo"])
    cfg.rollout.max_turns            # 4

- `rl.py`: the RL run's sections (`Config`: data, model, parallel, rollout, retrieval, algo, optim, trainer,
  logging) and the checks that span them; `rl_rollout.py` holds the rollout and retrieval sections.
- `sft.py`: the SFT warm-up's `SFTConfig` (its own data and trainer sections, the RL run's others).
- `loader.py`: the schema-free engine: YAML + `key=value` overrides into the dataclasses, `save_config`,
  `describe` (the `--help-config` lines), `ConfigError`, `check`.
- `finetune.py`: the LoRA and freeze settings records `model.lora` / `model.freeze` turn into (models/ applies them).
- `layout.py`: the rank arithmetic behind the check that every vLLM engine serves one Megatron replica.

Nothing here imports the code it configures (models/, rollout/, ...): those import from here.

Every name callers import stays importable from `megatron_searchr1.config`.
"""
from __future__ import annotations

from typing import Optional

from megatron_searchr1.config import loader
from megatron_searchr1.config.loader import ConfigError, apply_overrides, save_config, to_dict
from megatron_searchr1.config.rl import (
    ESTIMATORS, KL_KINDS, LOSS_AGG_MODES, AlgoConfig, Config, DataConfig, LoggingConfig, ModelConfig, OptimConfig,
    ParallelConfig, RetrievalConfig, RolloutConfig, TrainerConfig,
)
from megatron_searchr1.config.sft import SFTConfig, SFTDataConfig, SFTTrainerConfig


def load_config(path: Optional[str] = None, overrides: Optional[list[str]] = None, cls=Config, translate=None):
    """Read the YAML (if any), apply dotted overrides, build and check each section (the RL `Config` unless `cls`
    names another schema, e.g. `SFTConfig`; `translate` reads a foreign YAML, e.g. llamafactory.translate)."""
    return loader.load(cls, path, overrides, translate)


def describe(cls=Config, prefix: str = "") -> list[str]:
    """`section.field (default): docstring` lines for --help-config."""
    return loader.describe(cls, prefix)


__all__ = [
    "ConfigError", "load_config", "save_config", "describe", "apply_overrides", "to_dict",
    "Config", "DataConfig", "ModelConfig", "ParallelConfig", "RolloutConfig", "RetrievalConfig", "AlgoConfig",
    "OptimConfig", "TrainerConfig", "LoggingConfig", "ESTIMATORS", "KL_KINDS", "LOSS_AGG_MODES",
    "SFTConfig", "SFTDataConfig", "SFTTrainerConfig",
]
