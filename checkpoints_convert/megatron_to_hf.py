# python checkpoints_convert/megatron_to_hf.py --ckpt-dir /tmp/tiny-qwen2-mcore --out-dir /tmp/tiny-qwen2-back
# torchrun --nproc_per_node 4 checkpoints_convert/megatron_to_hf.py --ckpt-dir CKPT --out-dir HF --tp 2 --pp 2
"""Megatron dist checkpoint (saved at any TP/PP) -> Hugging Face safetensors dir with config and tokenizer.

Thin wrapper over `megatron_searchr1.models.convert_cli.megatron_to_hf_main`; `--help` lists the options.
"""
from megatron_searchr1.cli import run_main
from megatron_searchr1.models.convert_cli import megatron_to_hf_main  # light: checks arguments before torch loads

if __name__ == "__main__":  # dist_checkpointing starts worker processes: the guard is required
    raise SystemExit(run_main(megatron_to_hf_main))
