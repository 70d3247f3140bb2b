"""The multi-turn search rollout: engines (vLLM, hf), the per-sample state machine, the weight sync.

For the disaggregated placement: the staleness rule and batch buffer (async_buffer.py), and the role worlds and
bridge that carry weights and batches between trainer and rollout ranks (remote_sync.py; the weight buckets over
NCCL: remote_nccl.py).

Tree rollouts (Tree-GRPO): tree.py grows trees of trajectories from turn boundaries on the state machine's turns.
"""
