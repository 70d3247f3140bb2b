"""The trainers: RL (rl.py) and SFT (sft.py) on role objects (roles.py: Policy, Critic, RolloutWorker) that
build.py makes from a config; sources.py says which weights a model starts from; reports.py renders rollouts.

The entry points (megatron_searchr1/train.py, sft.py, evaluate.py) parse their arguments, then import from here.
"""
