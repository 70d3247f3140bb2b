"""Data: prompt templates and tags (prompts), FlashRAG QA -> Search-R1 parquet (qa), the synthetic world for the
CPU demo and tests (synthetic), and gold trajectories for supervised warm-up (oracle)."""
