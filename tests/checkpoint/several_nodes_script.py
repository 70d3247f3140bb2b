"""What checkpoint.py does for runs over several nodes, under torchrun with gloo (run by
tests/checkpoint/test_several_nodes.py; no models, seconds).

    torchrun --standalone --nproc_per_node 2 tests/checkpoint/several_nodes_script.py --mode shared --base DIR --out OUT

shared:   check_shared_dir(DIR) on every rank: passes, and leaves no marker behind.
split:    each rank checks its own DIR/rank<r> (what two nodes with a node-local output_dir see): every rank must
          raise; it writes the message to OUT/rank<r>.err and exits 0 (no hang: the test's timeout would say so).
resume:   each rank's checkpoint root DIR/rank<r> holds a different latest step (rank 0: 2, rank 1: 1, as two nodes
          with stale or different `latest` files); agreed_resume_target("auto", ...) must give rank 0's decision
          on every rank; a bad trainer.resume raises on every rank. OUT/rank<r>.json: what each rank got.
"""
import argparse
import json
import os

import torch.distributed as dist

from megatron_searchr1.checkpoint import (
    LATEST_FILE, MARKER_FILE, CheckpointError, agreed_resume_target, check_shared_dir, step_dir,
)


def fake_checkpoint(root: str, step: int) -> None:
    """The files latest_step looks at: a step directory with its marker, and `latest`."""
    os.makedirs(step_dir(root, step), exist_ok=True)
    with open(os.path.join(step_dir(root, step), MARKER_FILE), "w") as f:
        json.dump({"step": step}, f)
    with open(os.path.join(root, LATEST_FILE), "w") as f:
        f.write(f"{step}\n")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["shared", "split", "resume"], required=True)
    p.add_argument("--base", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.mode == "shared":
        check_shared_dir(args.base, wait_s=5)
        dist.barrier()
        assert not any(n.startswith(".shared_dir_check") for n in os.listdir(args.base)), os.listdir(args.base)
        open(os.path.join(args.out, f"rank{rank}.ok"), "w").close()
    elif args.mode == "split":
        try:
            check_shared_dir(os.path.join(args.base, f"rank{rank}"), wait_s=1)
        except CheckpointError as e:
            with open(os.path.join(args.out, f"rank{rank}.err"), "w") as f:
                f.write(str(e))
    else:
        root = os.path.join(args.base, f"rank{rank}", "checkpoints")
        for step in range(1, 3 - rank):
            fake_checkpoint(root, step)
        got = agreed_resume_target("auto", root)
        try:
            agreed_resume_target(os.path.join(args.base, "no_such_run"), root)
            bad = None
        except CheckpointError as e:
            bad = str(e)
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump({"target": got, "bad": bad}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
