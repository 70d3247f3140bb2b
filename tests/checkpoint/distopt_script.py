"""Save and resume the distributed optimizer under torchrun (run by tests/checkpoint/test_distributed_optimizer.py).

    torchrun --standalone --nproc_per_node 2 tests/checkpoint/distopt_script.py MODE CKPT OUT [TP]

save: two Adam steps at DP=2 with use_distributed_optimizer, save after the first; record this rank's parameters,
      Adam state and fp32 main shards at the save (OUT/saved_rank{r}.pt) and its parameters after the second step
      (OUT/after_rank{r}.pt). load: a fresh model and optimizer (another init seed) load the checkpoint; what was
      restored is compared with the record (OUT/restored_rank{r}.json), then the second step is taken and the
      parameters compared with the save run's (OUT/next_step_rank{r}.json). load at TP=2: the checkpoint (saved at
      TP=1) must be refused with a CheckpointError (OUT/refused_rank{r}.txt).
"""
import json
import os
import sys

import torch
import torch.distributed as dist


def build(seed: int, tp: int):
    from megatron_searchr1.megatron.initialize import initialize_megatron
    from megatron_searchr1.megatron.optimizer import build_optimizer
    from megatron_searchr1.models.tiny import TinyModelConfig, build_hf_config
    from megatron_searchr1.trainer.roles import build_actor

    initialize_megatron(tp=tp, pp=1, seed=seed)
    cfg = build_hf_config(TinyModelConfig(output_dir="unused", hidden_size=64, intermediate_size=96, num_layers=2,
                                          num_heads=4, num_kv_heads=2), 256, 0, 1)
    actor = build_actor(cfg, use_distributed_optimizer=True)
    opt, sched = build_optimizer(actor, lr=1e-2, min_lr=1e-3, weight_decay=0.01, adam_betas=(0.9, 0.999),
                                 clip_grad=1.0, warmup_steps=1, decay_steps=10, decay_style="cosine")
    return actor, opt, sched


def step(actor, opt, sched, seed: int) -> None:
    g = torch.Generator().manual_seed(seed * 100 + dist.get_rank())  # each DP rank its own batch
    tokens = torch.randint(0, 256, (2, 12), generator=g)
    pos = torch.arange(12).unsqueeze(0).expand(2, 12)
    actor.zero_grad_buffer()
    opt.zero_grad()
    actor(tokens, pos, None, labels=tokens).float().mean().backward()
    actor.finish_grad_sync()
    ok, _, _ = opt.step()
    assert ok
    sched.step(1)


def record(actor, opt) -> dict:
    from megatron_searchr1.models.forward import unwrap

    inner = opt.optimizer  # the torch Adam over this rank's fp32 shards
    return {"params": {n: p.detach().clone() for n, p in unwrap(actor).named_parameters()},
            "adam": inner.state_dict()["state"],
            "main": [p.detach().clone() for g in inner.param_groups for p in g["params"]],
            "lr": [g["lr"] for g in opt.param_groups]}


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return torch.equal(torch.as_tensor(a), torch.as_tensor(b))


def main(mode: str, ckpt: str, out: str, tp: int = 1) -> None:
    from megatron_searchr1.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from megatron_searchr1.models.forward import unwrap

    rank = int(os.environ["RANK"])
    if mode == "save":
        actor, opt, sched = build(seed=1, tp=1)
        step(actor, opt, sched, seed=1)
        save_checkpoint(ckpt, 1, {"actor": actor}, {"actor": opt}, {"actor": sched}, {"note": "distopt"})
        torch.save(record(actor, opt), os.path.join(out, f"saved_rank{rank}.pt"))
        step(actor, opt, sched, seed=2)
        torch.save(record(actor, opt)["params"], os.path.join(out, f"after_rank{rank}.pt"))
    elif tp == 1:
        actor, opt, sched = build(seed=7, tp=1)
        load_checkpoint(ckpt, "latest", {"actor": actor}, {"actor": opt}, {"actor": sched})
        want, got = torch.load(os.path.join(out, f"saved_rank{rank}.pt"), weights_only=False), record(actor, opt)
        with open(os.path.join(out, f"restored_rank{rank}.json"), "w") as f:
            json.dump({k: same(want[k], got[k]) for k in want}, f)
        step(actor, opt, sched, seed=2)
        after = torch.load(os.path.join(out, f"after_rank{rank}.pt"))
        now = {n: p.detach() for n, p in unwrap(actor).named_parameters()}
        with open(os.path.join(out, f"next_step_rank{rank}.json"), "w") as f:
            json.dump({"equal": same(after, now),
                       "max_diff": max((after[n] - now[n]).abs().max().item() for n in after)}, f)
    else:
        actor, opt, sched = build(seed=7, tp=tp)
        try:
            load_checkpoint(ckpt, "latest", {"actor": actor}, {"actor": opt}, {"actor": sched})
        except CheckpointError as e:
            with open(os.path.join(out, f"refused_rank{rank}.txt"), "w") as f:
                f.write(str(e))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], *(int(x) for x in sys.argv[4:]))
