"""The RL trainer: PPO / GRPO with a search engine in the loop, Megatron actor (and critic, reference), vLLM rollouts.

    torchrun --nproc_per_node 2 -m megatron_searchr1.train examples/grpo_tiny_cpu.yaml parallel.tp=2
    python -m megatron_searchr1.train --help-config          # every field, its default and what it means

Every rank runs this same program (SPMD): the trainer is megatron_searchr1/trainer/rl.py. The package, from the
bottom up:
  config/             the run's dataclass sections (YAML + dotted overrides), checked before anything heavy loads;
  data/ reward/ search/   prompts and parquet rows, the rule rewards, the retrieval client and server;
  models/             Megatron GPT models from HF configs, the HF <-> Megatron name mapping, conversion;
  megatron/           start-up on CPU or GPU, token-budget micro-batches and the forward/backward schedule;
  algo/               pure tensor functions: advantages, policy / value losses, KL;
  rollout/            the multi-turn search loop over a generation engine (vLLM or HF) and the weight sync into it;
  trainer/            the roles (policy, reference, critic, rollout worker), every loss callback (losses.py) and
                      the step that drives them.
One step (`Trainer.step`):
  1. this DP rank's prompts, each repeated `rollout.n` times under its group id (`extra_info.uid`);
  2. weight sync actor -> rollout engine (weight_sync.py: TP gather, PP broadcast, HF names, buckets);
  3. rollout: the multi-turn search loop (rollout/loop.py); the ranks of one DP rank split its trajectories
     between their engines and exchange the results;
  4. the engine sleeps (frees its memory) while the trainer runs: generation and training never overlap;
  5. reward (EM on the response), old / reference log-probs and critic values (Megatron forward passes over
     token-budget micro-batches);
  6. advantages (GRPO, GAE, RLOO, REINFORCE++), critic update, actor update (PPO clip; KL as a loss or in the
     reward); retrieved tokens are masked everywhere (algo/);
  7. metrics to TensorBoard and the console, sampled trajectories to JSONL, checkpoints, validation.
With parallel.rollout_placement=disaggregated the last parallel.rollout_ranks ranks only generate and the others only
train, at once, within rollout.max_staleness (trainer/async_rl.py; examples/async.md).
A run whose retrieval server is gone or hung (more than retrieval.max_error_rate of a step's searches failed, or
retrieval.max_failed_rounds rounds in a row) stops on every rank with one `error:` line naming the server and exit
code 3 (search/client.py RetrievalDown, cli.run_main); bring the server back and start it again to resume.
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from megatron_searchr1.cli import check_data, check_retrieval, parse, run_main
from megatron_searchr1.console import quiet_third_party_warnings


def main(argv: Optional[Sequence[str]] = None) -> int:
    quiet_third_party_warnings()  # torch / Megatron / vLLM deprecation noise; ours still shows
    cfg = parse(argv, prog_doc=__doc__)
    check_data(cfg)  # footers only: a second, before the retriever and torch
    check_retrieval(cfg)
    if cfg.parallel.rollout_placement == "disaggregated":  # trainer ranks and rollout ranks: trainer/async_rl.py
        from megatron_searchr1.trainer.async_rl import run_disaggregated

        return run_disaggregated(cfg)
    from megatron_searchr1.trainer.rl import Trainer  # after the arguments: torch, Megatron and vLLM load here

    trainer = Trainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return 0


def cli() -> int:
    """Console-script entry: user mistakes become one `error:` line and exit code 2."""
    return run_main(main)


if __name__ == "__main__":
    sys.exit(cli())
