# python checkpoints_convert/hf_to_megatron.py --hf-dir /tmp/tiny-qwen2 --out-dir /tmp/tiny-qwen2-mcore
# torchrun --nproc_per_node 4 checkpoints_convert/hf_to_megatron.py --hf-dir HF --out-dir CKPT --tp 2 --pp 2
"""Hugging Face Qwen2/Qwen3/Llama/Mistral dir -> Megatron dist checkpoint (loads at any TP/PP; one process is enough).

Thin wrapper over `megatron_searchr1.models.convert_cli.hf_to_megatron_main`; `--help` lists the options.
"""
from megatron_searchr1.cli import run_main
from megatron_searchr1.models.convert_cli import hf_to_megatron_main  # light: checks arguments before torch loads

if __name__ == "__main__":  # dist_checkpointing starts worker processes: the guard is required
    raise SystemExit(run_main(hf_to_megatron_main))
