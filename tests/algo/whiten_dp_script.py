"""Two gloo ranks whiten halves of one batch with trainer.losses.dp_sum; rank 0 checks against the whole batch.

    torchrun --nproc_per_node 2 tests/algo/whiten_dp_script.py
"""
import torch
import torch.distributed as dist

from megatron_searchr1 import algo
from megatron_searchr1.trainer import losses


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    rewards, values = torch.randn(6, 7), torch.randn(6, 7)
    mask = (torch.rand(6, 7) > 0.3).int()
    mask[5] = 0  # a row without tokens on rank 1
    whole, _ = algo.compute_gae_advantage_return(rewards, values, mask, 0.9, 0.8)
    rows = slice(0, 3) if rank == 0 else slice(3, 6)
    mine, _ = algo.compute_gae_advantage_return(rewards[rows], values[rows], mask[rows], 0.9, 0.8,
                                                reduce=losses.dp_sum())
    parts = [None, None]
    dist.all_gather_object(parts, mine)
    if rank == 0:
        torch.testing.assert_close(torch.cat(parts), whole, atol=1e-5, rtol=1e-5)
        print("WHITEN_DP_OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
