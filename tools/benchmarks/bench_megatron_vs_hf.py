# Run: OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 python tools/benchmarks/bench_megatron_vs_hf.py
#      (options: --threads 2 --batch 4 --seq 512 --iters 5; --profile prints the top ops of each model;
#       on a GPU: --device cuda, and --te to time the Transformer Engine spec instead of the local one)
"""Megatron GPTModel (local spec + our SDPAttention) vs Hugging Face Qwen2ForCausalLM (sdpa): fwd+bwd on one device.

The same ~20M-parameter Qwen2-shaped random model is built in both frameworks (HF weights loaded into Megatron through
the families mapping, the converter's; logits asserted equal within 1e-4, exit status 1 otherwise), then each runs forward + cross-entropy + backward on the same batch, interleaved
iteration by iteration so machine load hits all of them alike. Printed: median seconds per fwd+bwd for
HF, ours, and Megatron's original local spec (DotProductAttention), and the ratio Megatron / HF
(target <= 1.0). Every model runs on the same device (`--device`, default: the GPU when there is one), and both
Megatron models use the same spec family (local; `--te` builds ours with Transformer Engine and skips the original).
"""
from __future__ import annotations

import statistics
import sys
import time
import warnings

from megatron_searchr1.cli import ArgumentParser, UsageError, at_least, run_main

TOL = 1e-4  # max |logits difference| (fp32) for the Megatron models to count as the same model as HF's


def load_hf_into_megatron(hf_model, megatron_model, cfg, mapping_cls=None) -> None:
    """TP=1, PP=1: fill a Megatron model from an HF model's state dict with the families mapping (as the converter)."""
    from megatron_searchr1.models.families import get_family

    mapping = (mapping_cls or get_family(cfg)).from_hf_config(cfg, padded_vocab_size=megatron_model.vocab_size)
    sd = hf_model.state_dict()
    out = {name: mapping.hf_to_megatron(name, sd) for name, _ in megatron_model.named_parameters()}
    missing, unexpected = megatron_model.load_state_dict(out, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"weight load mismatch: missing={missing} unexpected={unexpected}")


def resolve_device(name: str) -> str:
    """'auto' -> 'cuda' when torch sees a GPU, else 'cpu'; 'cuda' without one is a UsageError."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but torch sees no GPU")
    return name


def main(argv=None, mapping_cls=None) -> int:
    """Run the benchmark; returns 1 when a Megatron model's logits differ from HF's by more than TOL."""
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=at_least(1), default=2, help="torch CPU threads")
    p.add_argument("--batch", type=at_least(1), default=4, help="sequences per fwd+bwd")
    p.add_argument("--seq", type=at_least(1), default=512, help="tokens per sequence")
    p.add_argument("--hidden", type=at_least(1), default=384, help="model width")
    p.add_argument("--ffn", type=at_least(1), default=1024, help="MLP width")
    p.add_argument("--layers", type=at_least(1), default=8, help="transformer layers")
    p.add_argument("--heads", type=at_least(1), default=6, help="query heads")
    p.add_argument("--kv-heads", type=at_least(1), default=2, help="key/value heads")
    p.add_argument("--vocab", type=at_least(2), default=8192, help="vocabulary")
    p.add_argument("--warmup", type=at_least(0), default=2, help="untimed iterations")
    p.add_argument("--iters", type=at_least(1), default=5, help="timed iterations (median)")
    p.add_argument("--no-original", action="store_true", help="skip Megatron's original local-spec attention")
    p.add_argument("--profile", action="store_true", help="print the top ops per model (one extra iteration)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where every model runs (auto: cuda when available)")
    p.add_argument("--te", action="store_true", help="build ours with the Transformer Engine spec (GPU only)")
    args = p.parse_args(argv)
    if args.hidden % args.heads or args.heads % args.kv_heads or (args.hidden // args.heads) % 2:
        raise UsageError(f"--hidden {args.hidden} must be a multiple of --heads {args.heads} with an even quotient "
                         f"(RoPE), and --heads a multiple of --kv-heads {args.kv_heads}")
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    if args.te and device != "cuda":
        raise UsageError("--te needs --device cuda (Transformer Engine runs on GPUs only)")
    if args.te:
        args.no_original = True  # the original is Megatron's *local* spec; compare like with like
    # Megatron's start-up warnings say nothing about this benchmark: a deprecated default of its own config, and,
    # on the CPU, that Transformer Engine / Apex (GPU libraries) are missing.
    warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")
    if device != "cuda":
        for pattern in (".*Apex.*", ".*Transformer Engine.*", ".*transformer_engine.*", ".*apex.*"):
            warnings.filterwarnings("ignore", message=pattern)

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megatron_searchr1.megatron.initialize import initialize_megatron
    from megatron_searchr1.models.gpt import build_gpt_model, gpt_model_kwargs, transformer_config_from_hf

    initialize_megatron(tp=1, pp=1, device=device)
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
    hf = hf.to(device)
    ours = build_gpt_model(cfg, use_te=args.te).to(device)
    load_hf_into_megatron(hf, ours, cfg, mapping_cls)
    models = {"hf_sdpa": hf, "megatron_ours": ours}
    if not args.no_original:
        kwargs = gpt_model_kwargs(cfg, transformer_config_from_hf(cfg), use_te=False)
        kwargs["transformer_layer_spec"] = get_gpt_layer_local_spec(normalization="RMSNorm")
        orig = GPTModel(**kwargs).to(device)
        load_hf_into_megatron(hf, orig, cfg, mapping_cls)
        models["megatron_original"] = orig
    n_params = sum(prm.numel() for prm in hf.parameters())

    ids = torch.randint(0, args.vocab, (args.batch, args.seq)).to(device)
    labels = torch.randint(0, args.vocab, (args.batch, args.seq)).to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)  # time the kernels, not their launch

    def step(name, model):
        if name == "hf_sdpa":
            logits = model(input_ids=ids, use_cache=False).logits
        else:
            logits = model(ids, None, None)[..., : args.vocab]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
        loss.backward()

    for m in models.values():
        m.train()
    with torch.no_grad():
        ref = hf(input_ids=ids, use_cache=False).logits
        for name in models:
            if name != "hf_sdpa":
                diff = (models[name](ids, None, None)[..., : args.vocab] - ref).abs().max().item()
                print(f"max |logits({name}) - logits(hf)| = {diff:.2e}")
                if not diff <= TOL:  # timing different models would be meaningless
                    print(f"error: {name} logits differ from HF's by {diff:.2e} > {TOL:.0e}", file=sys.stderr)
                    return 1

    times = {name: [] for name in models}
    for it in range(args.warmup + args.iters):
        for name, model in models.items():
            model.zero_grad(set_to_none=True)
            sync()
            t0 = time.perf_counter()
            step(name, model)
            sync()
            if it >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"device {device}, {'TE' if args.te else 'local'} spec; model: Qwen2-shaped, {n_params / 1e6:.1f}M params, "
          f"fp32; batch {args.batch} x seq {args.seq}, {args.threads} threads, median of {args.iters} fwd+bwd (after {args.warmup} warm-up)")
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
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
