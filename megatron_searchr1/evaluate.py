r"""Evaluate a policy: greedy search rollouts on validation/test files, EM / sub-EM / F1, mean searches and finish
reasons per data_source and split, as a table and as JSON.

    python tools/evaluate.py examples/grpo_tiny_cpu.yaml model.megatron_ckpt=runs/cpu_demo/grpo/checkpoints \
        data.val_files=[runs/cpu_demo/world/test.parquet] --json runs/cpu_demo/test_report.json
    torchrun --nproc_per_node 2 tools/evaluate.py CONFIG parallel.tp=2 ...      # any TP/PP, like training

The RL trainer's config and validation code (`trainer.val_only=true`), so evaluation and training validation are
the same computation; `rollout.max_turns=0` gives the no-search baseline. The protocol is the config's:
`rollout.protocol=tool_calls` (with `rollout.tools`) evaluates a policy that calls tools in its own format, on data
whose prompts are the protocol's (make_world --protocol tool_calls).
"""
from __future__ import annotations

import json
import os
import sys
from typing import Optional, Sequence

from megatron_searchr1.cli import UsageError, check_data, check_retrieval, parse, run_main
from megatron_searchr1.console import quiet_third_party_warnings


def main(argv: Optional[Sequence[str]] = None) -> int:
    quiet_third_party_warnings()  # torch / Megatron / vLLM deprecation noise; ours still shows
    argv = list(sys.argv[1:] if argv is None else argv)
    json_path = None
    if "--json" in argv:
        i = argv.index("--json")
        if i + 1 >= len(argv):
            raise UsageError("--json needs a file path")
        json_path = argv.pop(i + 1)
        argv.pop(i)
    cfg = parse([*argv, "trainer.val_only=true"], prog_doc=__doc__)
    if json_path and os.path.isdir(json_path):
        raise UsageError(f"--json {json_path!r} is a directory: give a file path")
    check_data(cfg)  # footers only: a second, before the retriever and torch
    check_retrieval(cfg)
    from megatron_searchr1.trainer.rl import Trainer  # after the arguments: torch, Megatron and vLLM load here

    trainer = Trainer(cfg)
    try:
        report = trainer.fit()
    finally:
        trainer.close()
    if json_path and trainer.rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {json_path}")
    return 0


def cli() -> int:
    """Console-script entry: user mistakes become one `error:` line and exit code 2; a retrieval server that fails
    more than retrieval.max_error_rate of the searches, one line and exit code 3 (its table is printed as invalid)."""
    return run_main(main)


if __name__ == "__main__":
    sys.exit(cli())
