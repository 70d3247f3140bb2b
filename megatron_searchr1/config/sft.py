"""The SFT warm-up stage's configuration (megatron_searchr1/sft.py): its own data and trainer sections; model (with
`model.lora`: LoRA when its rank is > 0), parallel, optim and logging are the RL run's sections (rl.py), so one model
dir, one LoRA setting and one parallel layout serve both.

LLaMA-Factory's flat YAML (`model_name_or_path`, `finetuning_type`, `lora_rank`, ...) is read by llamafactory.py,
which translates it into these sections.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from megatron_searchr1.config.loader import check
from megatron_searchr1.config.rl import LoggingConfig, ModelConfig, OptimConfig, ParallelConfig
from megatron_searchr1.config.tools import TOOL_PARSERS

TEMPLATES = ("qwen3_nothink", "qwen", "default", "alpaca")


@dataclass
class SFTDataConfig:
    dataset_dir: str = ""
    """Directory holding dataset_info.json (LLaMA-Factory style) and the files it names."""
    datasets: list[str] = field(default_factory=list)
    """Names in dataset_info.json to train on (e.g. [synthetic_sft_train])."""
    max_length: int = 1024
    """Examples longer than this (tokens) are dropped and counted, never cut."""
    batch_size: int = 16
    """Examples per optimizer step over all DP ranks."""
    shuffle: bool = True
    """Shuffle every epoch (seeded by trainer.seed and the epoch)."""
    template: str = ""
    """Empty: Search-R1's rollout layout (data/sft_data.py); or a LLaMA-Factory template every conversation is
    rendered with (chat layout, end-of-turn learned): qwen3_nothink (the tokenizer's chat template, thinking off),
    qwen, default, alpaca."""
    max_samples: Optional[int] = None
    """Read at most this many records of each dataset, the first ones (LLaMA-Factory's max_samples)."""
    train_on_prompt: bool = False
    """Put the loss on every token (the prompt and the observations too), not only on the assistant's
    (LLaMA-Factory's train_on_prompt)."""
    val_datasets: list[str] = field(default_factory=list)
    """Names in dataset_info.json held out for validation (LLaMA-Factory's eval_dataset): every trainer.val_freq
    steps the trainer reports their loss and their exact share (trainer/sft.py); empty = no validation."""
    val_max_samples: Optional[int] = None
    """Validate on at most this many records of each validation dataset, the first ones."""
    tool_parser: str = "hermes"
    """Tool records: the call format, as rollout.tool_parser (LLaMA-Factory's tool_format: qwen = hermes, ...)."""
    chat_template_kwargs: dict = field(default_factory=dict)
    """Tool records: extra chat-template variables, as rollout.chat_template_kwargs (LLaMA-Factory: enable_thinking)."""
    stop_at_call_end: bool = True
    """Tool records: one call per turn, ended at the call's closing string, as rollout.stop_at_call_end."""

    def __post_init__(self):
        check(self.max_length >= 16, f"data.max_length must be >= 16, got {self.max_length}")
        check(self.batch_size >= 1, f"data.batch_size must be >= 1, got {self.batch_size}")
        check(self.template in ("",) + TEMPLATES,
              f"data.template={self.template!r} is not known: choose one of {', '.join(TEMPLATES)} (or leave it "
              "empty for the rollout layout)")
        check(self.max_samples is None or self.max_samples >= 1, "data.max_samples must be >= 1 (or null)")
        check(self.val_max_samples is None or self.val_max_samples >= 1,
              "data.val_max_samples must be >= 1 (or null)")
        check(self.tool_parser in TOOL_PARSERS,
              f"data.tool_parser must be one of {', '.join(TOOL_PARSERS)} (the rollout's rollout.tool_parser), got "
              f"{self.tool_parser!r}")
        check(isinstance(self.chat_template_kwargs, dict) and all(
            isinstance(k, str) and (v is None or isinstance(v, (bool, int, float, str)))
            for k, v in self.chat_template_kwargs.items()),
            "data.chat_template_kwargs must map names to scalars, as rollout.chat_template_kwargs (e.g. "
            f"{{enable_thinking: false}}), got {self.chat_template_kwargs!r}")


@dataclass
class SFTTrainerConfig:
    output_dir: str = "runs/sft"
    """Where the resolved config, TensorBoard events, checkpoints and the HF export go."""
    total_steps: int = 500
    """Optimizer steps."""
    save_freq: int = 0
    """Checkpoint every k steps (0 = only at the end)."""
    keep_last: int = 1
    """Checkpoints kept."""
    resume: str = "auto"
    """auto (latest checkpoint in output_dir if any), disable, or a checkpoint step directory."""
    export_hf: bool = True
    """Write the final model as a Hugging Face dir (<output_dir>/hf)."""
    seed: int = 1
    """Seed of data order and init."""
    num_epochs: Optional[float] = None
    """Train this many passes over the data instead (total_steps = ceil(num_epochs * examples // data.batch_size))."""
    log_every: int = 0
    """Print `step k: loss ...` on rank 0 every k steps (0 = the progress bar only)."""
    val_freq: int = 0
    """Validate on data.val_datasets every k steps and at the end (0 = at the end only, when there are any)."""
    stop_at_val_exact: Optional[float] = None
    """Stop early, at a validation, once the validation exact share (the share of held-out examples whose every
    loss-mask token the model predicts greedily, trainer/sft.py) reaches this value; total_steps stays the cap.
    A warm-up that must have learned a skill (reading an answer from the retrieved passages) before RL starts can
    stop as soon as it has, instead of after a fixed step count that is too short on one seed and too long on
    another. Null: train to total_steps."""

    def __post_init__(self):
        check(self.total_steps >= 1, "trainer.total_steps must be >= 1")
        check(self.num_epochs is None or self.num_epochs > 0, "trainer.num_epochs must be > 0 (or null)")
        check(self.log_every >= 0, "trainer.log_every must be >= 0")
        check(self.val_freq >= 0, "trainer.val_freq must be >= 0")
        check(self.stop_at_val_exact is None or 0.0 < self.stop_at_val_exact <= 1.0,
              "trainer.stop_at_val_exact must be in (0, 1] (or null)")
        check(self.save_freq >= 0 and self.keep_last >= 1, "trainer.save_freq >= 0 and trainer.keep_last >= 1")
        check(self.resume in ("auto", "disable") or os.path.isdir(self.resume),
              f"trainer.resume must be auto, disable or an existing checkpoint dir, got {self.resume!r}")


@dataclass
class SFTConfig:
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    """The RL run's model section: `model.lora.rank` > 0 trains LoRA adapters only (trainer/sft.py)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    trainer: SFTTrainerConfig = field(default_factory=SFTTrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self, world_size: Optional[int] = None, check_files: bool = True) -> None:
        p, d = self.parallel, self.data
        if world_size is not None:
            dp = p.data_parallel_size(world_size)
            check(d.batch_size % dp == 0, f"data.batch_size={d.batch_size} must be a multiple of the DP size {dp}")
        check(self.trainer.stop_at_val_exact is None or bool(d.val_datasets),
              "trainer.stop_at_val_exact needs data.val_datasets (the held-out examples it is measured on)")

        if not check_files:
            return
        check(bool(self.model.path) and os.path.isfile(os.path.join(self.model.path, "config.json")),
              f"model.path={self.model.path!r} is not a Hugging Face model dir with config.json")
        check(os.path.isfile(os.path.join(d.dataset_dir, "dataset_info.json")),
              f"data.dataset_dir={d.dataset_dir!r} has no dataset_info.json (tools/make_synthetic_world.py writes "
              "one under <out-dir>/sft)")
        check(bool(d.datasets), "data.datasets is empty: name the datasets of dataset_info.json to train on")
