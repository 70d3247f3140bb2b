"""`python -m megatron_searchr1.train ...` whose trainer ranks stop early at step ASYNC_STOP_AT as
trainer.stop_on_collapse stops them (Trainer.collapsed returns True: a checkpoint, then the end), while the rollout
ranks are still generating the next batch: tests/trainer/test_async_rl.py checks that every rank exits cleanly (the
rollout ranks' parts are drained, not left blocked in their sends) and that a resume continues from there.

With ASYNC_VERSIONS_FILE (a run with rollout.partial=true), the last rollout rank holds its part of batch 1 before its
second turn until the next policy version has arrived (so that part really continues under new weights: partial
rollouts), and trainer rank 0 writes every trained sample's per-token versions, loss mask and rollout rank there, one
JSON line per sample."""
from __future__ import annotations

import json
import os
import sys
import time


def hold_batch_one_for_new_weights() -> None:
    """The last rollout rank: before its part of batch 1's second turn, wait (up to 5 minutes) for a version newer than the engine's."""
    from megatron_searchr1.rollout import loop, remote_receiver

    receivers, real_init, real_run, batches = [], remote_receiver.WeightReceiver.__init__, loop.run_rollout, []

    def init(self, *args, **kw):
        real_init(self, *args, **kw)
        receivers.append(self)

    def run_rollout(*args, weights=None, **kw):
        if weights is None:  # validation
            return real_run(*args, **kw)
        batches.append(1)
        turns = []

        def held() -> int:
            turns.append(1)
            if len(batches) == 2 and len(turns) == 2:
                r, deadline = receivers[0], time.time() + 300
                while r.latest_version <= r.applied_version and time.time() < deadline:
                    time.sleep(0.1)
            return weights()

        return real_run(*args, weights=held, **kw)

    remote_receiver.WeightReceiver.__init__ = init
    loop.run_rollout = run_rollout  # serve_rollouts calls it through the module


def record_versions(path: str) -> None:
    """Trainer rank 0: one line per trained sample, {step, versions, mask, rank}."""
    from megatron_searchr1.trainer.async_rl import AsyncTrainer

    real = AsyncTrainer.generate_batch

    def generate_batch(self):
        out = real(self)
        with open(path, "a") as f:
            for tr in out[0]:
                f.write(json.dumps({"step": self.step_no, "versions": tr.versions, "mask": tr.loss_mask,
                                    "rank": tr.meta["rollout_rank"]}) + "\n")
        return out

    AsyncTrainer.generate_batch = generate_batch


if __name__ == "__main__":
    from megatron_searchr1.trainer.rl import Trainer

    stop_at = int(os.environ["ASYNC_STOP_AT"])
    Trainer.collapsed = lambda self, metrics: self.step_no == stop_at
    versions_file = os.environ.get("ASYNC_VERSIONS_FILE")
    if versions_file:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if rank == world - 1:
            hold_batch_one_for_new_weights()
        elif rank == 0:
            record_versions(versions_file)
    from megatron_searchr1.train import cli

    sys.exit(cli())
