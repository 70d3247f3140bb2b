"""The trainers: RL (rl.py) and SFT (sft.py) on role objects (roles.py: Policy, Critic, RolloutWorker) that
build.py makes from a config, with their data and loss callbacks in losses.py; sources.py says which weights a model
starts from; reports.py renders rollouts.
async_rl.py runs the disaggregated placement: the RL trainer on the trainer ranks, fed finished batches by the
rollout ranks (rollout_rank.py serve_rollouts: each generates a share of every batch).

The entry points (megatron_searchr1/train.py, sft.py, evaluate.py) parse their arguments, then import from here.
"""
