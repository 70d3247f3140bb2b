# torchrun --standalone --nproc_per_node 2 tests/megatron/moe_train_script.py --hf-dir DIR --ep 2
"""torchrun worker for tests/megatron/test_moe_training.py: an MoE actor's training step at EP (gloo).

* the router aux loss is in the actor's gradient: with a loss that ignores the outputs (0 * log-probs) the routers
  still get a gradient, and doubling moe_aux_loss_coeff doubles it;
* train_step returns the load-balancing metrics (megatron/moe_metrics.py) and the reference (frozen, eval) and the
  critic forward an MoE trunk;
* DP ranks that pack different numbers of micro-batches (3 and 1) still run the same number of expert all-to-alls
  (schedule.equal_micro_batch_count), and the padding changes nothing: gradients and log-probs equal those of one
  micro-batch per rank, and the routers route only the real micro-batches' tokens in training mode.
Every rank prints one `RESULT {json}` line.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.megatron.schedule_script import ppo_like_loss  # noqa: E402


def uneven_counts(actor, optimizer, hf_config) -> dict:
    """Rank 0 packs 3 micro-batches, rank 1 one (13-token sequences, 13-token budget); the same sequences in one
    micro-batch per rank are the reference. The aux loss is off for that gradient comparison (it is computed per
    micro-batch, so it depends on the packing) and checked alone against rank 1's micro-batch repeated 3 times."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megatron_searchr1.megatron.batching import make_micro_batches
    from megatron_searchr1.megatron.schedule import forward_backward, forward_per_sequence

    rank = mpu.get_data_parallel_rank()
    g = torch.Generator().manual_seed(100 + rank)
    seqs = [{"prompt_ids": torch.randint(0, hf_config.vocab_size, (5,), generator=g).tolist(),
             "response_ids": torch.randint(0, hf_config.vocab_size, (8,), generator=g).tolist(),
             "loss_mask": torch.ones(8), "advantages": torch.randn(8, generator=g)}
            for _ in range(3 if rank == 0 else 1)]
    bare = actor.module
    calls = {"all_to_all": 0, "routed_in_training": 0}
    real_a2a = dist.all_to_all_single

    def counting_a2a(*args, **kwargs):
        calls["all_to_all"] += 1
        return real_a2a(*args, **kwargs)

    first_router = next(m for n, m in bare.named_modules() if n.endswith("mlp.router"))

    def count_routed(router, inputs, _output):
        if router.training:
            calls["routed_in_training"] += inputs[0].numel() // inputs[0].shape[-1]

    hook = first_router.register_forward_hook(count_routed)
    coeff, bare.config.moe_aux_loss_coeff = bare.config.moe_aux_loss_coeff, 0.0
    dist.all_to_all_single = counting_a2a
    out = {}
    try:
        grads, log_probs = [], []
        for budget in (13, 64):
            mbs = make_micro_batches(seqs, budget)
            if budget == 13:
                out["micro_batches"] = len(mbs)
                out["real_tokens"] = sum(mb.num_padded_tokens for mb in mbs)
            actor.zero_grad_buffer()
            optimizer.zero_grad()  # after a step the fp32 optimizer's param.grad aliases main_grad
            forward_backward(actor, mbs, ppo_like_loss, with_entropy=True)
            grads.append({n: p.main_grad.detach().clone() for n, p in bare.named_parameters()})
            if budget == 13:
                out["train_all_to_all"], out["train_routed"] = calls["all_to_all"], calls["routed_in_training"]
                calls["all_to_all"] = 0
            log_probs.append(forward_per_sequence(actor, make_micro_batches(seqs, budget))["log_probs"])
            if budget == 13:
                out["forward_all_to_all"] = calls["all_to_all"]
    finally:
        dist.all_to_all_single = real_a2a
        bare.config.moe_aux_loss_coeff = coeff
        hook.remove()
    # The aux loss alone (a loss that ignores the outputs): rank 1's one micro-batch padded to 3 must weigh as
    # much as the same micro-batch 3 times (no padding), i.e. 1/M_d of the real count, and the padding adds none.
    aux_grads = []
    for copies in (1, 3):
        actor.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(actor, make_micro_batches(seqs if rank == 0 else seqs * copies, 13),
                         lambda outputs, mb: (0.0 * outputs["log_probs"].sum(), {}))
        aux_grads.append({n: p.main_grad.detach().clone() for n, p in bare.named_parameters()})
    out["aux_grad_max_diff"] = max(float((aux_grads[0][n] - aux_grads[1][n]).abs().max()) for n in aux_grads[0])
    out["aux_grad_max"] = max(float(t.abs().max()) for t in aux_grads[1].values())
    out["grad_max_diff"] = max(float((grads[0][n] - grads[1][n]).abs().max()) for n in grads[0])
    out["grad_max"] = max(float(t.abs().max()) for t in grads[1].values())
    out["log_prob_max_diff"] = max(float((a - b).abs().max()) for a, b in zip(*log_probs))
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--ep", type=int, default=1)
    a = p.parse_args()

    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megatron_searchr1.megatron.batching import make_micro_batches
    from megatron_searchr1.megatron.initialize import destroy_megatron, initialize_megatron
    from megatron_searchr1.megatron.optimizer import build_optimizer
    from megatron_searchr1.models.convert import SafetensorsReader, bind_mapping, load_hf_config, load_hf_weights
    from megatron_searchr1.trainer.roles import Critic, Policy, build_actor, build_critic, build_reference
    from megatron_searchr1.megatron.schedule import forward_backward, train_step

    initialize_megatron(ep=a.ep, seed=11, timeout_minutes=2)  # a collective that finds no partner fails in 2 min
    hf_config = load_hf_config(a.hf_dir)
    reader = SafetensorsReader(a.hf_dir)

    def load(m):
        load_hf_weights(m, reader, bind_mapping(hf_config, m))

    g = torch.Generator().manual_seed(mpu.get_data_parallel_rank())
    seqs = []
    for _ in range(4):
        r = int(torch.randint(3, 9, (1,), generator=g))
        seqs.append({"prompt_ids": torch.randint(0, hf_config.vocab_size, (5,), generator=g).tolist(),
                     "response_ids": torch.randint(0, hf_config.vocab_size, (r,), generator=g).tolist(),
                     "loss_mask": torch.ones(r), "advantages": torch.randn(r, generator=g)})
    result = {}
    actor = build_actor(hf_config, load_weights=load)
    bare = actor.module
    routers = [(n, p) for n, p in bare.named_parameters() if n.endswith("mlp.router.weight")]

    def ignores_outputs(outputs, mb):
        return 0.0 * outputs["log_probs"].sum(), {}

    norms = []
    for scale in (1.0, 2.0):
        bare.config.moe_aux_loss_coeff = scale * 0.01
        actor.zero_grad_buffer()
        forward_backward(actor, make_micro_batches(seqs, 24), ignores_outputs)
        norms.append([float(p.main_grad.norm()) for _, p in routers])
    result["router_grad_norms"] = norms

    optimizer, scheduler = build_optimizer(actor, lr=1e-3, clip_grad=1.0, warmup_steps=1, decay_steps=10,
                                           decay_style="linear")
    metrics = train_step(actor, optimizer, scheduler, make_micro_batches(seqs, 24), ppo_like_loss, with_entropy=True)
    result["metrics"] = {k: v for k, v in metrics.items() if k.startswith("moe/")}
    result["uneven"] = uneven_counts(actor, optimizer, hf_config)
    ref = build_reference(hf_config, load_weights=load)
    result["ref_log_probs_finite"] = all(bool(torch.isfinite(t).all()) for t in
                                         Policy(ref).log_probs(seqs, max_tokens_per_micro_batch=24))
    critic = build_critic(hf_config, load_weights=load)
    result["critic_values"] = len(Critic(critic).values(seqs, max_tokens_per_micro_batch=24))
    print("RESULT " + json.dumps({"rank": dist.get_rank(), **result}), flush=True)
    destroy_megatron()


if __name__ == "__main__":
    main()
