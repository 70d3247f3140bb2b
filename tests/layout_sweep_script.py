"""Two GRPO steps of the tiny recipe at each of several (tp, pp, engine_tp) layouts, in one torchrun launch (run
by tests/test_layout_sweep.py): Megatron's parallel state is torn down and rebuilt between layouts, so the
processes start once.

    torchrun --standalone --nproc_per_node 4 -m tests.layout_sweep_script --out OUT --layout 2,1,1 \
        --layout 2,1,2,vllm examples/grpo_tiny_cpu.yaml KEY=VALUE ...

Every rank runs the real Trainer (trainer/rl.py: Trainer.step) with the layout's engine (`rollout.engine`: the
fourth field, `hf` when left out). So that every layout trains on the same data, each trajectory is sampled on its
own with a seed of (step, uid, sample) instead of the engine's per-batch seeds, which depend on how the layout
splits the trajectories between engines; with fp32 weights synced exactly, the samples are then the same at every
layout of one engine kind. A random tiny model earns no EM reward (all advantages
would be 0 and the policy loss trivially equal), so the score is replaced by one that differs between samples: the
share of generated tokens with an even id. Rank 0 writes OUT/tp<tp>_pp<pp>_dp<dp>_etp<engine_tp>_<engine>.json: the
two steps' metrics and the seconds the layout took.
"""
import argparse
import dataclasses
import json
import os
import time
import zlib

import torch.distributed as dist

import megatron_searchr1.rollout.loop as loop
import megatron_searchr1.trainer.losses as losses
from megatron_searchr1.config import load_config
from megatron_searchr1.rollout.loop import RolloutStats
from megatron_searchr1.trainer.rl import Trainer

_run_rollout = loop.run_rollout
STEP = [0]


def one_by_one(engine, tokenizer, search, trajs, settings, progress=None) -> RolloutStats:
    """run_rollout, one trajectory at a time with its own seed (layout-independent samples)."""
    total = RolloutStats()
    for tr in trajs:
        seed = zlib.crc32(f"{STEP[0]}/{tr.uid}/{tr.sample}".encode()) & 0x3FFFFFFF
        st = _run_rollout(engine, tokenizer, search, [tr], dataclasses.replace(settings, seed=seed))
        total.finish.update(st.finish)
        for f in dataclasses.fields(RolloutStats):
            if f.name != "finish":
                setattr(total, f.name, getattr(total, f.name) + getattr(st, f.name))
    return total


_score_trajectories = losses.score_trajectories


def even_token_share(trajs, tokenizer, algo, **kw) -> list[dict]:
    """The trainer's score records, with score = share of even token ids among the generated (mask 1) tokens."""
    scores = _score_trajectories(trajs, tokenizer, algo, **kw)
    for tr, sc in zip(trajs, scores):
        gen = [t for t, m in zip(tr.response_ids, tr.loss_mask) if m]
        sc["score"] = sum(t % 2 == 0 for t in gen) / max(len(gen), 1)
    return scores


def main() -> None:
    from megatron.core import parallel_state as mpu

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--layout", action="append", required=True,
                   help="tp,pp,engine_tp[,engine] (repeat for more; engine hf or vllm, default hf)")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    loop.run_rollout = one_by_one
    losses.score_trajectories = even_token_share
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    for layout in args.layout:
        fields = layout.split(",")
        tp, pp, etp = map(int, fields[:3])
        engine = fields[3] if len(fields) > 3 else "hf"
        name = f"tp{tp}_pp{pp}_dp{world // (tp * pp)}_etp{etp}_{engine}"
        cfg = load_config(args.config, [*args.overrides, f"parallel.tp={tp}", f"parallel.pp={pp}",
                                        f"rollout.engine_tp={etp}", f"rollout.engine={engine}",
                                        f"trainer.output_dir={os.path.join(args.out, name)}"])
        cfg.validate(world_size=world)
        start = time.time()
        trainer = Trainer(cfg)
        steps = []
        for _ in range(2):
            trainer.step_no += 1
            STEP[0] = trainer.step_no
            steps.append(trainer.step())
        trainer.close()
        mpu.destroy_model_parallel()
        if dist.get_rank() == 0:
            with open(os.path.join(args.out, f"{name}.json"), "w") as f:
                json.dump({"tp": tp, "pp": pp, "dp": world // (tp * pp), "engine_tp": etp, "engine": engine,
                           "steps": steps, "seconds": time.time() - start}, f)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
