"""megatron-searchr1: Search-R1 style agentic RL on Megatron-core (torchrun-native, no Ray)."""

__version__ = "0.1.0"
