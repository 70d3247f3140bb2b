# torchrun --nproc_per_node 2 tests/models/sequence_parallel_script.py --out RESULT.pt
"""Sequence parallelism on the local spec at TP=2 over gloo: the same weights built with SP off and on give the same
logits (forward_logits pads the sequence to a multiple of TP under SP) and, through the trainer's schedule
(train_step with the PPO-style loss, Megatron DDP, finalize_model_grads summing the norms' partial gradients over
TP), the same loss and the same updated weights. Rank 0 saves what it saw to --out."""
import argparse

import torch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()

    import torch.distributed as dist

    from megatron_searchr1.megatron.initialize import initialize_megatron
    from tests.models.test_gpt import tiny_config

    initialize_megatron(tp=2, pp=1, seed=5, device="cpu", sequence_parallel=True)
    result = {}
    for kind in ("qwen2", "qwen3"):  # qwen2: RoPE inside SDPAttention, qkv bias; qwen3: Megatron's path, q/k norms
        run(tiny_config(kind), kind, result)
    if dist.get_rank() == 0:
        torch.save(result, a.out)
    dist.barrier()
    dist.destroy_process_group()


def run(cfg, kind: str, result: dict) -> None:
    from megatron_searchr1.megatron.batching import make_micro_batches
    from megatron_searchr1.megatron.optimizer import build_optimizer
    from megatron_searchr1.models.forward import forward_logits
    from megatron_searchr1.models.gpt import model_settings
    from megatron_searchr1.trainer.roles import build_actor
    from megatron_searchr1.megatron.schedule import train_step

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (2, 13), generator=gen)  # 13: odd, so SP must pad
    seqs = [{"prompt_ids": ids[i, :4].tolist(), "response_ids": ids[i, 4: 13 - 2 * i].tolist(),
             "advantages": torch.randn(9 - 2 * i, generator=gen), "loss_mask": torch.ones(9 - 2 * i)}
            for i in range(2)]

    def loss_fn(outputs, mb):
        mask = mb["loss_mask"]
        per_token = -(mb["advantages"] * outputs["log_probs"])
        return (per_token * mask).sum() / max(mb.global_num_loss_tokens, 1.0), {}

    state = None
    for sp in (False, True):
        torch.manual_seed(0)
        settings = model_settings(cfg, tp=2, pp=1, params_dtype=torch.float32, sequence_parallel=sp)
        actor = build_actor(cfg, **settings)
        if state is None:
            state = {k: v.clone() for k, v in actor.module.state_dict().items() if not k.endswith("_extra_state")}
        else:
            missing, unexpected = actor.module.load_state_dict(state, strict=False)
            assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
        opt, _ = build_optimizer(actor, lr=1e-2, clip_grad=0.0)
        actor.eval()
        with torch.no_grad():
            result[f"{kind}/logits_sp{int(sp)}"] = forward_logits(actor.module, ids)
        m = train_step(actor, opt, None, make_micro_batches(seqs, 64), loss_fn)
        result[f"{kind}/loss_sp{int(sp)}"] = m["loss"]
        result[f"{kind}/grad_norm_sp{int(sp)}"] = m["grad_norm"]
        result[f"{kind}/params_sp{int(sp)}"] = {k: v.detach().clone() for k, v in actor.module.named_parameters()}
        result[f"{kind}/sp_marked_sp{int(sp)}"] = sorted(k for k, v in actor.module.named_parameters()
                                                         if getattr(v, "sequence_parallel", False))


if __name__ == "__main__":
    main()
