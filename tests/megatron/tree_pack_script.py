"""torchrun worker for tests/megatron/test_tree_packing_tp2.py: one PPO step of the real Trainer with tree rollouts,
at TP=2 (sequence parallel) once with each leaf its own sequence and once with rollout.tree.pack_forward=true, then
packed at PP=2, in one launch.

    torchrun --standalone --nproc_per_node 2 -m tests.megatron.tree_pack_script --out OUT CONFIG KEY=VALUE ...

Both runs start from the same weights and seeds and grow the same trees (the HF engine samples from per-call seeds),
with the old-log-prob, reference and critic forwards all taken (PPO with GAE, two mini-batches, KL loss). The score
is the share of even generated token ids (a random tiny model earns no EM). After the packed run's step, the packed
and per-leaf forwards of its own models are compared directly on the step's leaves. Rank 0 writes OUT/result.json.
"""
import argparse
import json
import os

import torch.distributed as dist

import megatron_searchr1.trainer.losses as losses
from megatron_searchr1.config import load_config
from megatron_searchr1.trainer.rl import Trainer
from tests.layout_sweep_script import even_token_share


def main() -> None:
    from megatron.core import parallel_state as mpu

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    losses.score_trajectories = even_token_share
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    result = {}
    runs = (("per_leaf", False, []), ("packed", True, []),
            ("packed_pp2", True, ["parallel.tp=1", "parallel.pp=2", "parallel.sequence_parallel=false"]))
    for name, pack, layout in runs:
        cfg = load_config(args.config, [*args.overrides, *layout, f"rollout.tree.pack_forward={str(pack).lower()}",
                                        f"trainer.output_dir={os.path.join(args.out, name)}"])
        cfg.validate(world_size=world)
        trainer = Trainer(cfg)
        seen = {}
        to_sequences = losses.to_sequences

        def keep(trajs, *a, **kw):  # the step's leaves, for the direct comparison below
            seen["trajs"], seen["seqs"] = trajs, to_sequences(trajs, *a, **kw)
            return seen["seqs"]

        losses.to_sequences = keep
        trainer.step_no = 1
        result[name] = {"metrics": trainer.step()}
        losses.to_sequences = to_sequences
        if pack:
            seqs, keys = seen["seqs"], [t.meta["tree"].tree for t in seen["trajs"]]
            budget = cfg.optim.max_tokens_per_micro_batch
            diffs = {}
            for role, call in (("actor", lambda **kw: trainer.policy.log_probs(seqs, budget, 1.0, **kw)),
                               ("reference", lambda **kw: trainer.reference.log_probs(seqs, budget, 1.0, **kw)),
                               ("critic", lambda **kw: trainer.critic.values(seqs, budget, **kw))):
                a, b = call(), call(pack_keys=keys)
                diffs[role] = max(float((x - y).abs().max()) for x, y in zip(a, b))
                diffs[role + "_scale"] = max(float(x.abs().max()) for x in a)
            result[name]["direct"] = diffs
            result["leaves"] = len(seqs)
            result["trees"] = len(set(keys))
        trainer.close()
        mpu.destroy_model_parallel()
        dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
