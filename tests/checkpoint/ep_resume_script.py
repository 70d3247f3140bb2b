# torchrun --standalone --nproc_per_node 2 tests/checkpoint/ep_resume_script.py --hf-dir DIR --ep 2 --ckpt ROOT
"""torchrun worker for tests/checkpoint/test_ep_resume.py: an MoE actor trains three Adam steps on one fixed global
batch at `--ep`; with `--save` it checkpoints after step 1, with `--resume` it loads that step-1 checkpoint (saved
at another EP) and trains steps 2 and 3 only (`--fresh-optimizer`: without the saved Adam state). Each DP rank
takes its share of the same global batch (equal lengths, so the DP-averaged gradient is the global token mean at
any layout). Prints one `RESULT {json}` line from rank 0: the steps' global grad norms."""
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
    p.add_argument("--ckpt", required=True)
    p.add_argument("--save", action="store_true")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--fresh-optimizer", action="store_true", help="--resume loads the model and LR schedule only")
    a = p.parse_args()

    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megatron_searchr1.checkpoint import load_checkpoint, save_checkpoint
    from megatron_searchr1.megatron.batching import make_micro_batches
    from megatron_searchr1.megatron.initialize import initialize_megatron
    from megatron_searchr1.megatron.optimizer import build_optimizer
    from megatron_searchr1.models.convert import SafetensorsReader, bind_mapping, load_hf_config, load_hf_weights
    from megatron_searchr1.trainer.roles import build_actor
    from megatron_searchr1.megatron.schedule import train_step

    initialize_megatron(ep=a.ep, seed=11)
    hf_config = load_hf_config(a.hf_dir)
    reader = SafetensorsReader(a.hf_dir)
    g = torch.Generator().manual_seed(0)
    seqs = [{"prompt_ids": torch.randint(0, hf_config.vocab_size, (5,), generator=g).tolist(),
             "response_ids": torch.randint(0, hf_config.vocab_size, (6,), generator=g).tolist(),
             "loss_mask": torch.ones(6), "advantages": torch.randn(6, generator=g)} for _ in range(4)]
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    mine = seqs[dp_rank::dp]

    actor = build_actor(hf_config, load_weights=lambda m: load_hf_weights(m, reader, bind_mapping(hf_config, m)))
    # no load-balancing loss: Megatron computes it on each rank's own tokens, so it would differ between layouts
    actor.module.config.moe_aux_loss_coeff = 0.0
    optimizer, scheduler = build_optimizer(actor, lr=1e-3, clip_grad=0.0, warmup_steps=0, decay_steps=10,
                                           decay_style="linear")
    first = 1
    if a.resume:
        optimizers = {} if a.fresh_optimizer else {"actor": optimizer}
        first = load_checkpoint(a.ckpt, "latest", {"actor": actor}, optimizers, {"actor": scheduler})["step"] + 1
    norms = {}
    for step in range(first, 4):
        m = train_step(actor, optimizer, scheduler, make_micro_batches(mine, 64), ppo_like_loss, with_entropy=True)
        norms[step] = m["grad_norm"]
        if a.save and step == 1:
            save_checkpoint(a.ckpt, 1, {"actor": actor}, {"actor": optimizer}, {"actor": scheduler})
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"grad_norms": norms}), flush=True)


if __name__ == "__main__":
    main()
