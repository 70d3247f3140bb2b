# python tools/make_tiny_model.py --output-dir /tmp/tiny-qwen2 --arch qwen2 [--text corpus.txt ...] [--overwrite]
"""Write a random tiny Qwen2/Qwen3/Llama/Mistral (or Qwen3-MoE / Qwen2-MoE: --arch qwen3_moe, qwen2_moe) Hugging Face
checkpoint with a locally trained BPE chat tokenizer (no hub).

Thin wrapper over `megatron_searchr1.models.tiny.main`; `python tools/make_tiny_model.py --help` lists the options.
"""
from megatron_searchr1.cli import run_main
from megatron_searchr1.models.tiny_cli import main

if __name__ == "__main__":
    raise SystemExit(run_main(main))
