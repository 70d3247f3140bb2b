"""Write a random tiny chat model and its tokenizer from the command line (models/tiny.py makes them).

    python -m megatron_searchr1.models.tiny_cli --output-dir /tmp/tiny-qwen2 --arch qwen2 [--text corpus.txt ...]

The installed console script is `searchr1-make-tiny-model`; a mistake is one `error:` line naming the flag.
"""
from __future__ import annotations

import os
import shutil

from megatron_searchr1.cli import ArgumentParser, UsageError, above, at_least, console, run_main
from megatron_searchr1.models.tiny import ARCHITECTURES, TinyModelConfig, make_tiny_model


def parse_args(argv=None) -> TinyModelConfig:
    """The command line -> a validated TinyModelConfig; mistakes are UsageErrors (one `error:` line, exit 2)."""
    p = ArgumentParser(description="Write a random tiny Qwen2/Qwen3/Llama/Mistral HF checkpoint with a locally "
                                   "trained BPE chat tokenizer (no model hub needed).")
    p.add_argument("--output-dir", required=True, help="directory to write (must be empty, or pass --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --output-dir")
    p.add_argument("--arch", default="qwen2", choices=sorted(ARCHITECTURES))
    p.add_argument("--text", nargs="*", default=[], help="text files for the tokenizer (default: built-in text)")
    p.add_argument("--vocab-size", type=at_least(64), default=1000)
    p.add_argument("--hidden-size", type=at_least(2), default=128)
    p.add_argument("--intermediate-size", type=at_least(1), default=None, help="default: 2 x hidden size")
    p.add_argument("--num-layers", type=at_least(1), default=2)
    p.add_argument("--num-heads", type=at_least(1), default=4)
    p.add_argument("--num-kv-heads", type=at_least(1), default=2)
    p.add_argument("--max-position-embeddings", type=at_least(1), default=2048)
    p.add_argument("--rope-theta", type=above(0.0), default=10000.0)
    p.add_argument("--tie-embeddings", action="store_true", help="share the input embedding and the lm_head")
    p.add_argument("--init-std", type=above(0.0), default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-search-tag-tokens", action="store_true", help="leave <search> etc. to BPE pieces")
    p.add_argument("--num-experts", type=at_least(1), default=8, help="MoE archs: routed experts per layer")
    p.add_argument("--experts-per-token", type=at_least(1), default=2, help="MoE archs: top-k")
    p.add_argument("--moe-intermediate-size", type=at_least(1), default=64, help="MoE archs: one expert's width")
    a = p.parse_args(argv)
    if os.path.exists(a.output_dir) and not os.path.isdir(a.output_dir):
        raise UsageError(f"--output-dir {a.output_dir!r} is a file: give a directory")
    if os.path.isdir(a.output_dir) and os.listdir(a.output_dir) and not a.overwrite:
        raise UsageError(f"--output-dir {a.output_dir!r} is not empty: pass --overwrite or choose another")
    try:
        cfg = TinyModelConfig(
            output_dir=a.output_dir, arch=a.arch, text_files=a.text, vocab_size=a.vocab_size,
            hidden_size=a.hidden_size, intermediate_size=a.intermediate_size or 2 * a.hidden_size,
            num_layers=a.num_layers, num_heads=a.num_heads, num_kv_heads=a.num_kv_heads,
            max_position_embeddings=a.max_position_embeddings, rope_theta=a.rope_theta,
            tie_embeddings=a.tie_embeddings, init_std=a.init_std, seed=a.seed,
            search_tags_as_tokens=not a.no_search_tag_tokens, num_experts=a.num_experts,
            experts_per_token=a.experts_per_token, moe_intermediate_size=a.moe_intermediate_size,
        )
    except FileNotFoundError as e:
        raise UsageError(f"--text: {e}") from None
    except ValueError as e:  # TinyModelConfig's own checks name the fields
        raise UsageError(f"{e} (--hidden-size, --num-heads, --num-kv-heads, --num-experts, --experts-per-token)"
                         ) from None
    return cfg


def main(argv=None) -> int:
    cfg = parse_args(argv)
    if os.path.isdir(cfg.output_dir) and os.listdir(cfg.output_dir):  # parse_args refused it without --overwrite
        shutil.rmtree(cfg.output_dir)  # no stale files of an earlier model left beside the new one
    out = make_tiny_model(cfg)
    print(f"wrote tiny {cfg.arch} model to {out}")
    return 0


cli = console(main)  # the console script (setup.py)


if __name__ == "__main__":
    raise SystemExit(run_main(main))
