# python tools/preflight.py [--config examples/grpo_qwen2.5-7b.yaml --nodes 2]     (on the node, before a first launch)
"""The node preflight: vLLM engine cycles, engine vs Megatron log-probs, the async bridge and the planner's memory
figures on this node, at toy size, as a pass/fail table with what to change; exit 0 when all pass, else 1.

Thin wrapper over `megatron_searchr1.preflight.main` (it starts torchrun itself); `--help` lists the options.
"""
from megatron_searchr1.cli import run_main
from megatron_searchr1.preflight import main

if __name__ == "__main__":
    raise SystemExit(run_main(main))
