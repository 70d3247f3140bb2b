"""The multi-turn search rollout: engines (vLLM, hf), the per-sample state machine, the weight sync."""
