"""`python -m megatron_searchr1.train ...` whose rollout rank (the last one) dies hard (os._exit(9), no message) when it
starts generating its second batch: tests/trainer/test_async_rl.py checks that the trainer ranks stop with an error
naming it instead of waiting."""
from __future__ import annotations

import os
import sys

from megatron_searchr1.rollout import loop

if __name__ == "__main__":
    if int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:
        real, calls = loop.run_rollout, []

        def dying_run_rollout(*args, **kw):
            calls.append(1)
            if len(calls) == 2:
                os._exit(9)
            return real(*args, **kw)

        loop.run_rollout = dying_run_rollout  # serve_rollouts calls it through the module
    from megatron_searchr1.train import cli

    sys.exit(cli())
