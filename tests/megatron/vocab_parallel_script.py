"""torchrun worker: vocab_parallel_log_probs over 2 gloo ranks (plain torch.distributed, no Megatron) equals the
single-process result on the real vocabulary, values and gradients, with padded columns holding huge logits.

    torchrun --standalone --nproc_per_node 2 tests/megatron/vocab_parallel_script.py
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_searchr1.megatron.vocab_parallel import vocab_parallel_log_probs

REAL, PADDED = 300, 512  # rank 1 holds columns 256..511: 44 real, 212 padding


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    full = torch.randn(3, 5, PADDED, generator=g, dtype=torch.float64)
    full[..., REAL:] = 50.0  # if a padded column entered the softmax, everything would change
    targets = torch.randint(0, REAL, (3, 5), generator=g)
    w_lp, w_ent = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)

    for T in (1.0, 0.6):
        ref = torch.log_softmax(full[..., :REAL] / T, dim=-1)
        ref_lp = ref.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        ref_ent = -(ref.exp() * ref).sum(-1)
        x = full.clone().requires_grad_(True)
        ref_loss = (w_lp * torch.log_softmax(x[..., :REAL] / T, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)).sum()
        lsm = torch.log_softmax(x[..., :REAL] / T, -1)
        ref_loss = ref_loss + (w_ent * -(lsm.exp() * lsm).sum(-1)).sum()
        (ref_grad,) = torch.autograd.grad(ref_loss, x)

        shard = full.chunk(world, dim=-1)[rank].clone().float().requires_grad_(True)
        lp, ent = vocab_parallel_log_probs(shard, targets, real_vocab_size=REAL, temperature=T, with_entropy=True,
                                           group=dist.group.WORLD)
        torch.testing.assert_close(lp.double(), ref_lp, atol=2e-5, rtol=0)
        torch.testing.assert_close(ent.double(), ref_ent, atol=2e-5, rtol=0)
        ((w_lp * lp).sum() + (w_ent * ent).sum()).backward()
        want = ref_grad.chunk(world, dim=-1)[rank]
        torch.testing.assert_close(shard.grad.double(), want, atol=2e-5, rtol=0)
        if rank == world - 1:
            assert float(shard.grad[..., REAL - rank * (PADDED // world):].abs().max()) == 0.0  # padded: no grad
    dist.barrier()
    if rank == 0:
        print("VOCAB_PARALLEL_OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
