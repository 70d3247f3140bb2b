# Run: OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 python tools/benchmarks/bench_megatron_vs_hf.py
#      (options: --threads 2 --batch 4 --seq 512 --iters 5; --profile prints the top ops of each model)
"""Megatron GPTModel (local spec + our SDPAttention) vs Hugging Face Qwen2ForCausalLM (sdpa): fwd+bwd on the CPU.

The same ~20M-parameter Qwen2-shaped random model is built in both frameworks (HF weights copied into Megatron,
logits checked equal), then each runs forward + cross-entropy + backward on the same batch, interleaved
iteration by iteration so machine load hits all of them alike. Printed: median seconds per fwd+bwd for
HF, ours, and Megatron's original local spec (DotProductAttention), and the ratio Megatron / HF
(target <= 1.0).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F


def copy_hf_into_megatron(hf_model, megatron_model, cfg) -> None:
    """TP=1, PP=1 weight copy HF Qwen2/Llama -> Megatron local spec (the bench stays independent of the mapping)."""
    sd = hf_model.state_dict()
    nq, ng = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // nq
    vocab_pad = megatron_model.vocab_size

    def pad(t):
        out = torch.zeros(vocab_pad, t.shape[1], dtype=t.dtype)
        out[: t.shape[0]] = t
        return out

    def per_group(q, k, v):  # Megatron interleaves q/k/v per query group
        return torch.cat([q.reshape(ng, -1, *q.shape[1:]), k.reshape(ng, -1, *k.shape[1:]),
                          v.reshape(ng, -1, *v.shape[1:])], dim=1).reshape(-1, *q.shape[1:])

    out = {"embedding.word_embeddings.weight": pad(sd["model.embed_tokens.weight"]),
           "decoder.final_layernorm.weight": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["output_layer.weight"] = pad(sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = h + "self_attn."
        out[m + "input_layernorm.weight"] = sd[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = sd[h + "post_attention_layernorm.weight"]
        for kind in ("weight", "bias"):
            if a + f"q_proj.{kind}" in sd:
                out[m + f"self_attention.linear_qkv.{kind}"] = per_group(
                    sd[a + f"q_proj.{kind}"], sd[a + f"k_proj.{kind}"], sd[a + f"v_proj.{kind}"])
        out[m + "self_attention.linear_proj.weight"] = sd[a + "o_proj.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([sd[h + "mlp.gate_proj.weight"], sd[h + "mlp.up_proj.weight"]])
        out[m + "mlp.linear_fc2.weight"] = sd[h + "mlp.down_proj.weight"]
    missing, unexpected = megatron_model.load_state_dict(out, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"weight copy mismatch: missing={missing} unexpected={unexpected}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--no-original", action="store_true", help="skip Megatron's original local-spec attention")
    p.add_argument("--profile", action="store_true", help="print the top ops per model (one extra iteration)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megatron_searchr1.megatron.initialize import initialize_megatron
    from megatron_searchr1.models.gpt import build_gpt_model, gpt_model_kwargs, transformer_config_from_hf

    initialize_megatron(tp=1, pp=1)
    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=max(2048, args.seq),
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # HF zero-inits biases; random ones make the equality check meaningful
        for name, prm in hf.named_parameters():
            if name.endswith("bias"):
                prm.normal_(0, 0.02)
    ours = build_gpt_model(cfg)
    copy_hf_into_megatron(hf, ours, cfg)
    models = {"hf_sdpa": hf, "megatron_ours": ours}
    if not args.no_original:
        kwargs = gpt_model_kwargs(cfg, transformer_config_from_hf(cfg), use_te=False)
        kwargs["transformer_layer_spec"] = get_gpt_layer_local_spec(normalization="RMSNorm")
        orig = GPTModel(**kwargs)
        copy_hf_into_megatron(hf, orig, cfg)
        models["megatron_original"] = orig
    n_params = sum(prm.numel() for prm in hf.parameters())

    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    labels = torch.randint(0, args.vocab, (args.batch, args.seq))

    def step(name, model):
        if name == "hf_sdpa":
            logits = model(input_ids=ids, use_cache=False).logits
        else:
            logits = model(ids, None, None)[..., : args.vocab]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
        loss.backward()
        return logits.detach()

    for m in models.values():
        m.train()
    with torch.no_grad():
        ref = hf(input_ids=ids, use_cache=False).logits
        for name in models:
            if name != "hf_sdpa":
                diff = (models[name](ids, None, None)[..., : args.vocab] - ref).abs().max().item()
                print(f"max |logits({name}) - logits(hf)| = {diff:.2e}")

    times = {name: [] for name in models}
    for it in range(args.warmup + args.iters):
        for name, model in models.items():
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            step(name, model)
            if it >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"model: Qwen2-shaped, {n_params / 1e6:.1f}M params, fp32; batch {args.batch} x seq {args.seq}, "
          f"{args.threads} threads, median of {args.iters} fwd+bwd (after {args.warmup} warm-up)")
    for name, t in med.items():
        print(f"  {name:<18} {t:7.3f} s   (min {min(times[name]):.3f}, max {max(times[name]):.3f})")
    best = {name: min(ts) for name, ts in times.items()}
    # On a shared machine the minimum is the least disturbed sample; print both.
    print(f"ratio megatron_ours / hf_sdpa = {med['megatron_ours'] / med['hf_sdpa']:.3f} median, "
          f"{best['megatron_ours'] / best['hf_sdpa']:.3f} min  (target <= 1.0)")
    if "megatron_original" in med:
        print(f"ratio megatron_original / hf_sdpa = {med['megatron_original'] / med['hf_sdpa']:.3f} median, "
              f"{best['megatron_original'] / best['hf_sdpa']:.3f} min")

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for name, model in models.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step(name, model)
            print(f"--- {name}")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


if __name__ == "__main__":
    main()
