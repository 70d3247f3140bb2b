"""Megatron workers: log-probs, values and PPO/SFT updates over token-budget micro-batches (see schedule.py)."""
