"""`python -m megatron_searchr1.train ...` whose trainer ranks stop early at step ASYNC_STOP_AT as
trainer.stop_on_collapse stops them (Trainer.collapsed returns True: a checkpoint, then the end), while the rollout
rank is still generating the next batch: tests/trainer/test_async_rl.py checks that every rank exits cleanly (the
rollout rank's batch is drained, not left blocked in its send) and that a resume continues from there."""
from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    from megatron_searchr1.trainer.rl import Trainer

    stop_at = int(os.environ["ASYNC_STOP_AT"])
    Trainer.collapsed = lambda self, metrics: self.step_no == stop_at
    from megatron_searchr1.train import cli

    sys.exit(cli())
