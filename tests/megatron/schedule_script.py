"""torchrun worker for tests/megatron/test_schedule.py: log-probs, entropy, values, gradients and a few steps.

    torchrun --standalone --nproc_per_node 2 tests/megatron/schedule_script.py --hf-dir DIR --tp 2 --out OUT.pt

Every layout (TP, PP, DP from the world size) computes, on the same fixed sequences:
  * log-probs + entropy (temperature 0.7) per response token and critic values (value head set to fixed numbers);
  * the gradient of a PPO-like token-mean loss from one micro-batch and from the same data in three micro-batches
    (DP > 1: each DP rank takes every DP-th sequence, so the union is the DP=1 batch);
  * with --train: five SFT steps (loss values).
Rank 0 saves everything, gradients gathered over TP to their TP=1 shapes.
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

VOCAB = 300  # padded to 384 at TP=1 and 512 at TP=2: TP=2's second rank holds 44 real columns and 212 padded


def make_sequences(n=7, seed=0):
    from megatron_searchr1.megatron.batching import TrainSequence

    g = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(n):
        p = int(torch.randint(2, 11, (1,), generator=g))
        r = int(torch.randint(1, 13, (1,), generator=g))
        mask = (torch.rand(r, generator=g) > 0.3).float()
        mask[0] = 1.0
        seqs.append(TrainSequence(prompt_ids=torch.randint(0, VOCAB, (p,), generator=g).tolist(),
                                  response_ids=torch.randint(0, VOCAB, (r,), generator=g).tolist(),
                                  loss_mask=mask, advantages=torch.randn(r, generator=g)))
    return seqs


def ppo_like_loss(outputs, mb):
    """-(A * logp) - 0.1 * entropy, token-mean over the mini-batch (this micro-batch's share)."""
    mask = mb["loss_mask"]
    per_token = -(mb["advantages"] * outputs["log_probs"]) - 0.1 * outputs["entropy"]
    loss = (per_token * mask).sum() / mb.global_num_loss_tokens
    return loss, {"entropy": (outputs["entropy"] * mask).sum() / mask.sum()}


def gather_grads(module, tp):
    """main_grad of every parameter at its TP=1 shape (vocab rows trimmed to VOCAB)."""
    from megatron.core import parallel_state as mpu

    out = {}
    for name, param in module.named_parameters():
        t = param.main_grad.detach().float()
        if getattr(param, "tensor_model_parallel", False) and tp > 1:
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=mpu.get_tensor_model_parallel_group())
            if name.endswith("mlp.linear_fc1.weight"):  # each rank holds [gate_r; up_r]
                halves = [part.chunk(2, dim=0) for part in parts]
                parts = [h[0] for h in halves] + [h[1] for h in halves]
            t = torch.cat(parts, dim=param.partition_dim)
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            t = t[:VOCAB]
        out[name] = t.clone()
    return out


def three_micro_batch_budget(seqs):
    from megatron_searchr1.megatron.batching import plan_micro_batches, sequence_lengths

    lengths = sequence_lengths(seqs)
    for budget in range(max(lengths), sum(lengths) * max(lengths) + 1):
        if len(plan_micro_batches(lengths, budget)) == 3:
            return budget
    raise AssertionError("no budget gives 3 micro-batches")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--train", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from megatron_searchr1.megatron.initialize import destroy_megatron, initialize_megatron

    initialize_megatron(tp=args.tp, pp=args.pp, seed=11)
    from megatron.core import parallel_state as mpu

    from megatron_searchr1.megatron.batching import make_micro_batches
    from megatron_searchr1.megatron.optimizer import build_optimizer
    from megatron_searchr1.models.convert import SafetensorsReader, bind_mapping, load_hf_config, load_hf_weights
    from megatron_searchr1.trainer.losses import masked_nll_loss, sft_sequence
    from megatron_searchr1.trainer.roles import Critic, Policy, build_actor, build_critic, build_reference
    from megatron_searchr1.megatron.schedule import forward_backward, train_step

    hf_config = load_hf_config(args.hf_dir)
    reader = SafetensorsReader(args.hf_dir)

    def load(m):
        load_hf_weights(m, reader, bind_mapping(hf_config, m))

    seqs = make_sequences()
    result = {}

    # Forward-only: the frozen reference path (no DDP) and the critic.
    ref = build_reference(hf_config, load_weights=load)
    lp, ent = Policy(ref).log_probs(seqs, max_tokens_per_micro_batch=40, temperature=0.7, with_entropy=True)
    result["log_probs"], result["entropy"] = lp, ent
    critic = build_critic(hf_config, load_weights=load)
    head = getattr(critic.module, "value_head", None)
    if head is not None:  # last stage: fixed numbers, the same at every layout (the head is replicated)
        with torch.no_grad():
            g = torch.Generator().manual_seed(3)
            head.weight.copy_(torch.randn(head.weight.shape, generator=g))
            head.bias.fill_(0.5)
    result["values"] = Critic(critic).values(seqs, max_tokens_per_micro_batch=40)
    del critic, ref

    # Gradients: one micro-batch vs three, on this DP rank's share.
    actor = build_actor(hf_config, load_weights=load)
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    share = seqs[dp_rank::dp]
    grads, metrics = {}, {}
    for label, budget in (("one", 10_000), ("three", three_micro_batch_budget(share))):
        mbs = make_micro_batches(share, budget)
        assert len(mbs) == (1 if label == "one" else 3), len(mbs)
        actor.zero_grad_buffer()
        metrics[label] = forward_backward(actor, mbs, ppo_like_loss, with_entropy=True)
        grads[label] = gather_grads(actor.module, args.tp)
    result["grads"], result["metrics"] = grads, metrics
    result["pp_rank_params"] = sorted(grads["one"])

    if args.train:
        optimizer, scheduler = build_optimizer(actor, lr=3e-3, clip_grad=1.0, warmup_steps=1, decay_steps=10,
                                               decay_style="linear")
        sft = [sft_sequence(s.prompt_ids + s.response_ids, [1] * (len(s.prompt_ids) + len(s.response_ids)))
               for s in seqs]
        result["train"] = [train_step(actor, optimizer, scheduler, make_micro_batches(sft, 40), masked_nll_loss)
                           for _ in range(6)]

    if dist.get_rank() == 0:
        torch.save(result, args.out)
    destroy_megatron()


if __name__ == "__main__":
    main()
