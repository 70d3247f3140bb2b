# python tools/infer.py --model runs/cpu_demo/grpo/hf --url http://127.0.0.1:8000 --question "Where was X born?"
"""Thin wrapper over `megatron_searchr1.infer.main` (see its module docstring for the full usage)."""
from megatron_searchr1.cli import run_main
from megatron_searchr1.infer import main

if __name__ == "__main__":  # Megatron's checkpointing starts worker processes: the guard is required
    raise SystemExit(run_main(main))
