"""One optimizer step with Megatron DDP + get_megatron_optimizer; writes the TP-gathered parameters afterwards.

    torchrun --standalone --nproc_per_node 2 tests/megatron/ddp_step_script.py --tp 2 --out /tmp/after.pt

Run by tests/megatron/test_initialize.py at TP=1 (reference) and TP=2 (plain and distributed optimizer).
"""
import argparse

import torch
import torch.distributed as dist


def gather_full_params(module, tp):
    """Every parameter at its full (TP=1) shape, for comparison across layouts."""
    from megatron.core import parallel_state as mpu

    full = {}
    for name, param in module.named_parameters():
        t = param.detach()
        if getattr(param, "tensor_model_parallel", False) and tp > 1:
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=mpu.get_tensor_model_parallel_group())
            if name.endswith("mlp.linear_fc1.weight"):  # each rank holds [gate_r; up_r]: regroup as [gate; up]
                halves = [part.chunk(2, dim=0) for part in parts]
                parts = [h[0] for h in halves] + [h[1] for h in halves]
            t = torch.cat(parts, dim=param.partition_dim)
        full[name] = t.clone()
    return full


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--distributed-optimizer", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from megatron_searchr1.megatron.initialize import destroy_megatron, initialize_megatron

    initialize_megatron(tp=args.tp, pp=args.pp, seed=7)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from transformers import Qwen2Config

    from megatron_searchr1.models.gpt import build_gpt_model

    # The model we train (SDPA attention, fused RoPE, SwiGLU MLP, fast linears), not a stock GPTModel.
    # vocab 256 pads to 256 at TP=1 and TP=2, so both layouts initialise the same master weights.
    hf_config = Qwen2Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            tie_word_embeddings=False, attention_dropout=0.0)
    model = build_gpt_model(hf_config)
    cfg = model.config
    ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=args.distributed_optimizer,
                                            grad_reduce_in_fp32=True)
    model = DistributedDataParallel(cfg, ddp_cfg, model)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, clip_grad=1.0, bf16=False, fp16=False,
                        use_distributed_optimizer=args.distributed_optimizer),
        [model],
    )

    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (2, 16), generator=gen) for _ in range(2)]  # two micro-batches
    it = iter(batches)

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        pos = torch.arange(16).unsqueeze(0).expand_as(tokens)
        out = model(tokens[:, :-1], pos[:, :-1], None, labels=tokens[:, 1:])

        def loss_func(per_token):
            loss = per_token.float().mean()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    before = gather_full_params(model.module, args.tp)
    model.zero_grad_buffer()
    opt.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=it, model=[model], num_microbatches=2,
        seq_length=15, micro_batch_size=2, forward_only=False,
    )
    ok, grad_norm, _ = opt.step()
    assert ok, "optimizer step was skipped"

    full = gather_full_params(model.module, args.tp)
    if dist.get_rank() == 0:
        torch.save({"params": full, "before": before, "grad_norm": float(grad_norm),
                    "loss": [float(l["loss"]) for l in losses]}, args.out)
    destroy_megatron()


if __name__ == "__main__":
    main()
