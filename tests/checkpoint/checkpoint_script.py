"""Save / crash / load a training checkpoint under torchrun (run by tests/checkpoint/test_checkpoint.py).

    torchrun --standalone --nproc_per_node 2 tests/checkpoint/checkpoint_script.py --mode save --hf-dir HF --root CKPT --out OUT

save:  one training step, save step 5 (actor + optimizer + scheduler, critic without optimizer), then record what
       must come back: this rank's parameters, optimizer state, scheduler state, the next random draws and the
       parameters after one more step (OUT/save_rank{r}.pt); rank 0 also writes the actor's HF-named weights
       (OUT/actor_hf.pt).
crash: load step 5, then start saving step 6 and SIGKILL rank 1 right after its model shards are written.
load:  fresh models (another init seed) + fresh optimizer, load "latest" through the roles (Policy / Critic .state(),
       checkpoint.load_roles: the trainers' path reads what the dict API wrote), compare everything with the save
       run's record (OUT/load_rank{r}.ok on success), then save step 7 with keep_last=1 through the roles;
       with --full-root (a directory too small for a checkpoint), the shared-directory check and then a save of
       step 8 there must fail on every rank with one storage line each (OUT/full_rank{r}.txt: the two messages);
       --inject-enospc instead makes rank 1's RNG file write fail with ENOSPC (where no small tmpfs can be mounted).
"""
import argparse
import os
import random
import signal

import numpy as np
import torch
import torch.distributed as dist

STEP_SAVED = 5
EXTRA = {"data_cursor": 96, "kl_ctl": {"value": 0.00123}, "note": "hello"}


def build(hf_dir, seed):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_searchr1.megatron.initialize import initialize_megatron
    from megatron_searchr1.models.convert import load_hf_config
    from megatron_searchr1.models.critic import build_critic_model
    from megatron_searchr1.models.gpt import build_gpt_model

    initialize_megatron(tp=2, pp=1, seed=seed)
    hf_config = load_hf_config(hf_dir)
    actor = build_gpt_model(hf_config)
    critic = build_critic_model(hf_config)
    ddp = DistributedDataParallel(actor.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), actor)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, clip_grad=1.0,
                                                 bf16=False, fp16=False), [ddp])
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=2, lr_decay_steps=10,
                                    lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=1,
                                    wd_incr_style="constant")
    return hf_config, ddp, critic, opt, sched


def train_step(ddp, opt, sched, vocab, seed):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (2, 12), generator=gen)

    def forward_step(data_iterator, model):
        t = next(data_iterator)
        pos = torch.arange(t.shape[1]).unsqueeze(0).expand_as(t)
        out = model(t[:, :-1], pos[:, :-1], None, labels=t[:, 1:])
        return out, lambda per_token: (per_token.float().mean(), {})

    ddp.zero_grad_buffer()
    opt.zero_grad()
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([tokens]), model=[ddp],
                                num_microbatches=1, seq_length=11, micro_batch_size=2, forward_only=False)
    ok, _, _ = opt.step()
    assert ok
    sched.step(1)


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def opt_state(opt):
    sd = opt.state_dict()
    return {f"{i}.{k}": (v.clone() if torch.is_tensor(v) else v) for i, s in sd["state"].items() for k, v in s.items()}


def draws():
    from megatron.core import tensor_parallel

    with tensor_parallel.get_cuda_rng_tracker().fork():
        tracked = torch.rand(4)
    return {"python": random.random(), "numpy": float(np.random.rand()), "torch": torch.rand(4), "tracker": tracked}


def assert_equal(a, b, what):
    if isinstance(a, dict):
        assert set(a) == set(b), f"{what}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_equal(a[k], b[k], f"{what}.{k}")
    elif torch.is_tensor(a):
        assert torch.equal(a, b), f"{what} differs"
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


def save_into_full_disk(args, rank, states):
    """The shared-directory check and a save where the disk is full (or rank 1's write is made to fail): every rank
    must raise CheckpointStorageError (none may hang in a collective); each rank's messages go to OUT."""
    import errno

    from megatron_searchr1 import checkpoint as ckpt

    messages = []
    if args.inject_enospc:
        real_save = torch.save

        def failing_save(obj, path, *a, **kw):
            if rank == 1 and "rng" in str(path):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            return real_save(obj, path, *a, **kw)

        torch.save = failing_save
    try:
        ckpt.save_roles(args.full_root, STEP_SAVED + 3, states, EXTRA)
        raise AssertionError("the save into a full disk succeeded")
    except ckpt.CheckpointStorageError as e:
        messages.append(str(e))
    if not args.inject_enospc:  # the failed save freed its space: fill the disk up, then check the directory
        filler = os.path.join(args.full_root, "filler")
        if rank == 0:
            with open(filler, "wb", buffering=0) as f:
                try:
                    while True:
                        f.write(b"x" * 4096)
                except OSError:
                    pass
        dist.barrier()
        try:
            ckpt.check_shared_dir(args.full_root, wait_s=2)
            raise AssertionError("the shared-directory check passed on a full disk")
        except ckpt.CheckpointStorageError as e:
            messages.append(str(e))
        dist.barrier()
        if rank == 0:
            os.remove(filler)
    with open(os.path.join(args.out, f"full_rank{rank}.txt"), "w") as f:
        f.write("\n".join(messages))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["save", "crash", "load"], required=True)
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--full-root")
    p.add_argument("--inject-enospc", action="store_true")
    args = p.parse_args()

    from megatron_searchr1 import checkpoint as ckpt
    from megatron_searchr1.megatron.initialize import destroy_megatron

    hf_config, ddp, critic, opt, sched = build(args.hf_dir, seed=1 if args.mode == "save" else 2)
    rank = dist.get_rank()
    models, opts, scheds = {"actor": ddp, "critic": critic}, {"actor": opt}, {"actor": sched}
    if args.mode == "save":
        with torch.no_grad():  # a critic that is not all zeros in its head
            for prm in critic.parameters():
                prm.add_(0.01)
        train_step(ddp, opt, sched, hf_config.vocab_size, seed=0)
        ckpt.save_checkpoint(args.root, STEP_SAVED, models, opts, scheds, EXTRA, hf_dirs={"actor": args.hf_dir})
        from megatron_searchr1.models.convert import bind_mapping, gather_hf_weights

        # the actor's full weights under HF names (what megatron_to_hf must export), gathered over TP
        hf = {n: t.clone() for n, t in gather_hf_weights(ddp.module, bind_mapping(hf_config, ddp.module))}
        record = {"actor": params(ddp.module), "critic": params(critic), "opt": opt_state(opt),
                  "sched": sched.state_dict(), "draws": draws()}
        if rank == 0:
            torch.save(hf, os.path.join(args.out, "actor_hf.pt"))
        train_step(ddp, opt, sched, hf_config.vocab_size, seed=1)
        record["after"] = params(ddp.module)
        torch.save(record, os.path.join(args.out, f"save_rank{rank}.pt"))
    elif args.mode == "crash":
        from megatron.core import dist_checkpointing

        ckpt.load_checkpoint(args.root, "latest", models, opts, scheds)
        real_save, calls = dist_checkpointing.save, []

        def save_then_die(*a, **kw):
            calls.append(1)
            if rank == 1 and len(calls) == 2:  # rank 1 wrote the actor's shards; die before the optimizer's
                # Megatron's writer keeps a multiprocessing Manager (results queue) alive: kill it too, as a node
                # failure would, or the orphan keeps the test's output pipe open and the test waits for it.
                import psutil

                for child in psutil.Process().children(recursive=True):
                    child.kill()
                os.kill(os.getpid(), signal.SIGKILL)
            return real_save(*a, **kw)

        dist_checkpointing.save = save_then_die
        ckpt.save_checkpoint(args.root, STEP_SAVED + 1, models, opts, scheds, EXTRA)
        raise AssertionError("the save should not have finished")
    else:
        record = torch.load(os.path.join(args.out, f"save_rank{rank}.pt"), weights_only=False)
        fresh = params(ddp.module)
        assert any(not torch.equal(fresh[n], record["actor"][n]) for n in fresh), "fresh model equals the saved one"
        from megatron_searchr1.trainer.roles import Critic, Policy

        states = {"actor": Policy(ddp, opt, sched).state(), "critic": Critic(critic).state()}
        extra = ckpt.load_roles(args.root, "latest", states)
        assert_equal(extra, {**EXTRA, "step": STEP_SAVED}, "extra")
        assert_equal(params(ddp.module), record["actor"], "actor")
        assert_equal(params(critic), record["critic"], "critic")
        assert_equal(opt_state(opt), record["opt"], "optimizer")
        assert len(record["opt"]) > 0
        assert_equal(sched.state_dict(), record["sched"], "scheduler")
        assert_equal(draws(), record["draws"], "random draws")
        train_step(ddp, opt, sched, hf_config.vocab_size, seed=1)
        assert_equal(params(ddp.module), record["after"], "parameters after the next step")
        ckpt.save_roles(args.root, STEP_SAVED + 2, states, EXTRA, keep_last=1)
        open(os.path.join(args.out, f"load_rank{rank}.ok"), "w").close()
        if args.full_root:
            save_into_full_disk(args, rank, states)
    destroy_megatron()


if __name__ == "__main__":
    main()
