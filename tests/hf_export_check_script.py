"""Compare an exported HF model's logits with the Megatron checkpoint it came from (one process, TP=1).

    python -m tests.hf_export_check_script <hf_dir> <megatron_actor_ckpt_dir>

Prints `max_abs_diff=<x> max_abs_logit=<y>` (tests/test_train.py parses it).
"""
import sys

import torch


def main(hf_dir: str, ckpt_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    from megatron_searchr1.megatron.initialize import initialize_megatron
    from megatron_searchr1.models.convert import load_hf_config, load_megatron_checkpoint
    from megatron_searchr1.models.forward import forward_logits
    from megatron_searchr1.models.gpt import build_gpt_model

    initialize_megatron(tp=1, pp=1)
    hf_config = load_hf_config(hf_dir)
    model = build_gpt_model(hf_config).eval()
    load_megatron_checkpoint(model, ckpt_dir)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, hf_config.vocab_size, (2, 40), generator=g)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        got = forward_logits(model, ids)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    print(f"max_abs_diff={(got - ref).abs().max().item():.3e} max_abs_logit={ref.abs().max().item():.3e}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
