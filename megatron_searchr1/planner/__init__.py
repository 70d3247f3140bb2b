"""The memory planner's parts (the command line is megatron_searchr1/plan.py):

  counts.py   parameters per rank from the model built on the meta device; the weight sync's buckets;
  memory.py   GPU memory of every phase of an RL step, per GPU: the byte arithmetic, every assumption written down;
  render.py   the per-phase table and the one-line summary.
"""
