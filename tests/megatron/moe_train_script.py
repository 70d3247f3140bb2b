# torchrun --standalone --nproc_per_node 2 tests/megatron/moe_train_script.py --hf-dir DIR --ep 2
"""torchrun worker for tests/megatron/test_moe_training.py: an MoE actor's training step at EP (gloo).

* the router aux loss is in the actor's gradient: with a loss that ignores the outputs (0 * log-probs) the routers
  still get a gradient, and doubling moe_aux_loss_coeff doubles it;
* train_step returns the load-balancing metrics (megatron/moe_metrics.py) and the reference (frozen, eval) and the
  critic forward an MoE trunk.
Prints one `RESULT {json}` line from rank 0.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.megatron.schedule_script import ppo_like_loss  # noqa: E402


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

    initialize_megatron(ep=a.ep, seed=11)
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
    ref = build_reference(hf_config, load_weights=load)
    result["ref_log_probs_finite"] = all(bool(torch.isfinite(t).all()) for t in
                                         Policy(ref).log_probs(seqs, max_tokens_per_micro_batch=24))
    critic = build_critic(hf_config, load_weights=load)
    result["critic_values"] = len(Critic(critic).values(seqs, max_tokens_per_micro_batch=24))
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    destroy_megatron()


if __name__ == "__main__":
    main()
