"""Supervised warm-up on Megatron: full-parameter or LoRA SFT at any TP/PP, loss on the assistant's tokens only.

    torchrun --nproc_per_node 2 -m megatron_searchr1.sft examples/sft_tiny_cpu.yaml parallel.tp=2
    python -m megatron_searchr1.sft examples/qwen3_lora_sft.yaml     # LLaMA-Factory's YAML (config/llamafactory.py)
    python -m megatron_searchr1.sft --help-config

Data: a LLaMA-Factory-style `dataset_info.json` naming alpaca or sharegpt files (data/sft_data.py). Each example is
tokenized segment by segment exactly as the rollout produces it (prompt, assistant turns, observations inline), so
SFT trains on the token sequences RL later samples; the loss mask is 1 on assistant tokens only (the prompt and the
`<information>` blocks are masked, as Search-R1's SFT does).
Training (megatron_searchr1/trainer/sft.py): token-budget micro-batches through Megatron's pipeline schedule,
token-mean NLL over each global batch, Adam with warmup/decay, checkpoints like the RL trainer's (its actor subdir is
what `model.megatron_ckpt` of the RL config points at), TensorBoard, and an HF export at the end.
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from megatron_searchr1.cli import UsageError, parse, run_main
from megatron_searchr1.console import quiet_third_party_warnings
from megatron_searchr1.config import SFTConfig, llamafactory


def main(argv: Optional[Sequence[str]] = None) -> int:
    quiet_third_party_warnings()  # torch / Megatron / vLLM deprecation noise; ours still shows
    cfg = parse(argv, cls=SFTConfig, prog_doc=__doc__, translate=llamafactory.translate)
    check_sft_data(cfg)
    from megatron_searchr1.trainer.sft import train_sft  # after the arguments: torch and Megatron load here

    train_sft(cfg)
    return 0


def check_sft_data(cfg) -> None:
    """Dataset names and their entries in dataset_info.json, before torch loads (the records are read later,
    with the tokenizer): a mistake is one `error:` line naming the field and the names the file has."""
    from megatron_searchr1.data.sft_data import SFTDataError, check_sft_datasets

    try:
        check_sft_datasets(cfg.data.dataset_dir, list(cfg.data.datasets))
        if cfg.data.val_datasets:
            check_sft_datasets(cfg.data.dataset_dir, list(cfg.data.val_datasets), field="data.val_datasets")
    except SFTDataError as e:
        raise UsageError(str(e)) from None


def cli() -> int:
    """Console-script entry: user mistakes become one `error:` line and exit code 2."""
    return run_main(main)


if __name__ == "__main__":
    sys.exit(cli())
