# python tools/benchmarks/bench_lora.py                       (tiny Qwen3, CPU, about 30 s)
# python tools/benchmarks/bench_lora.py --hidden 256 --layers 4 --steps 10 --rank 16
"""LoRA vs full fine-tuning on Megatron, side by side in one process: gradient + optimizer bytes and step time.

Both runs build the same random Qwen3-shaped model (models/gpt.py, local spec, TP=1) and train it on the same
random token batches through the trainers' step (megatron/schedule.py, Megatron DDP + Adam): `full` with every weight
trainable, `lora` after models/lora.py's apply_lora (base frozen, adapters on every decoder linear). Measured:
  * gradient bytes: Megatron DDP's gradient buffers (fp32, only trainable parameters get one);
  * optimizer bytes: every tensor of Adam's state (exp_avg, exp_avg_sq) plus the fp32 master copies of a bf16 model;
  * step time: mean wall time of a training step after one warm-up step.
Then the same count by formula for Qwen3-4B (bf16 weights; fp32 gradients, fp32 master + two Adam moments: 16 bytes
per trainable parameter), rank 8, every projection. Parameters themselves are the same in both and not counted.
"""
from __future__ import annotations

import time

from megatron_searchr1.cli import ArgumentParser, at_least, run_main

# Qwen3-4B (Qwen3-4B-Instruct-2507's config.json): tied embeddings, q/k norms
QWEN3_4B = dict(hidden=2560, layers=36, intermediate=9728, q_heads=32, kv_heads=8, head_dim=128, vocab=151936)


def projection_shapes(hidden: int, intermediate: int, q_heads: int, kv_heads: int, head_dim: int) -> dict:
    """HF projection -> (in, out) features of one decoder layer."""
    q, kv = q_heads * head_dim, kv_heads * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate), "down_proj": (intermediate, hidden)}


def count_params(hidden: int, layers: int, intermediate: int, q_heads: int, kv_heads: int, head_dim: int,
                 vocab: int, rank: int) -> tuple[int, int]:
    """(all parameters of a Qwen3 with tied embeddings, LoRA parameters at `rank` on every projection).

    >>> full, lora = count_params(**QWEN3_4B, rank=8); full, lora
    (4022468096, 16515072)
    """
    shapes = projection_shapes(hidden, intermediate, q_heads, kv_heads, head_dim)
    per_layer = sum(i * o for i, o in shapes.values()) + 2 * hidden + 2 * head_dim  # + 2 RMSNorms, q/k norms
    full = layers * per_layer + vocab * hidden + hidden  # + embedding (tied) and the final norm
    lora = layers * sum(rank * (i + o) for i, o in shapes.values())
    return full, lora


def formula_lines(rank: int) -> list[str]:
    full, lora = count_params(**QWEN3_4B, rank=rank)
    per = 16  # bf16 training: fp32 gradient (4) + fp32 master (4) + Adam exp_avg and exp_avg_sq (8)
    return [f"Qwen3-4B by formula (bf16, 16 B per trainable parameter: fp32 grad + fp32 master + 2 Adam moments):",
            f"  full: {full:,} trainable -> {full * per / 2**30:.1f} GiB gradients + optimizer",
            f"  lora r={rank}, all projections: {lora:,} trainable ({100 * lora / full:.2f}%) -> "
            f"{lora * per / 2**20:.0f} MiB; ratio {lora / full:.4f}; bf16 weights {full * 2 / 2**30:.1f} GiB "
            "either way"]


def measure(kind: str, args, batches) -> dict:
    """Build, (apply LoRA,) wrap, train `args.steps` steps; bytes and mean step time."""
    import torch
    from transformers import Qwen3Config

    from megatron_searchr1.megatron.batching import make_micro_batches
    from megatron_searchr1.megatron.optimizer import build_optimizer, wrap_ddp
    from megatron_searchr1.models.gpt import build_gpt_model
    from megatron_searchr1.models.lora import LoraSettings, apply_lora
    from megatron_searchr1.megatron import schedule
    from megatron_searchr1.trainer.losses import masked_nll_loss, sft_sequence

    torch.manual_seed(0)
    hf = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                     num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=args.hidden // 4, tie_word_embeddings=True, max_position_embeddings=4096)
    model = build_gpt_model(hf, use_te=False)
    if kind == "lora":
        apply_lora(model, LoraSettings(rank=args.rank, targets=("all",)))
    ddp = wrap_ddp(model)
    optimizer, _ = build_optimizer(ddp, lr=1e-4)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    times = []
    for ids in batches:
        mbs = make_micro_batches([sft_sequence(row, [1] * len(row)) for row in ids], args.seq_len * args.batch)
        t0 = time.perf_counter()
        schedule.train_step(ddp, optimizer, None, mbs, masked_nll_loss)
        times.append(time.perf_counter() - t0)
    grad = sum(b.grad_data.numel() * b.grad_data.element_size() for b in ddp.buffers + ddp.expert_parallel_buffers)
    inner = getattr(optimizer, "optimizer", optimizer)
    opt = sum(t.numel() * t.element_size() for s in inner.state.values() for t in s.values()
              if torch.is_tensor(t) and t.dim())
    masters = getattr(optimizer, "fp32_from_float16_groups", None) or []
    opt += sum(p.numel() * p.element_size() for g in masters for p in g)
    return {"trainable": trainable, "grad": grad, "opt": opt, "step_s": sum(times[1:]) / max(len(times) - 1, 1)}


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=at_least(8), default=128)
    p.add_argument("--layers", type=at_least(1), default=4)
    p.add_argument("--vocab", type=at_least(16), default=1000)
    p.add_argument("--rank", type=at_least(1), default=8)
    p.add_argument("--seq-len", type=at_least(8), default=64)
    p.add_argument("--batch", type=at_least(1), default=4)
    p.add_argument("--steps", type=at_least(2), default=4, help="training steps per run (the first is warm-up)")
    args = p.parse_args(argv)

    import torch

    from megatron_searchr1.megatron.initialize import destroy_megatron, initialize_megatron

    initialize_megatron(tp=1, pp=1)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=g).tolist()
               for _ in range(args.steps)]
    full, lora = measure("full", args, batches), measure("lora", args, batches)
    destroy_megatron()
    print(f"tiny Qwen3 (hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; fp32 on "
          f"{'GPU' if torch.cuda.is_available() else 'CPU'}), LoRA r={args.rank} on every projection, "
          f"{args.batch} x {args.seq_len} tokens a step")
    for name, m in (("full", full), ("lora", lora)):
        print(f"  {name}: trainable {m['trainable']:,}  gradients {m['grad']:,} B  optimizer {m['opt']:,} B  "
              f"step {m['step_s'] * 1e3:.1f} ms")
    mem = (lora["grad"] + lora["opt"]) / (full["grad"] + full["opt"])
    print(f"  ratio lora/full: gradients+optimizer bytes {mem:.4f}  "
          f"trainable {lora['trainable'] / full['trainable']:.4f}  step time {lora['step_s'] / full['step_s']:.2f}")
    print("\n".join(formula_lines(args.rank)))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
