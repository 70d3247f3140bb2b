# python tools/evaluate.py examples/grpo_tiny_cpu.yaml model.megatron_ckpt=CKPT data.val_files=[test.parquet] --json out.json
"""Thin wrapper over `megatron_searchr1.evaluate.main` (see its module docstring for the full usage)."""
from megatron_searchr1.cli import run_main
from megatron_searchr1.evaluate import main

if __name__ == "__main__":  # Megatron's checkpointing starts worker processes: the guard is required
    raise SystemExit(run_main(main))
