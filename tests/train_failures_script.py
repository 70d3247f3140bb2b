"""Failure runs under torchrun (2 ranks) with a scripted `hf` engine, so every trajectory searches.

    torchrun --nproc_per_node 2 -m tests.train_failures_script ESTIMATOR MODEL_DIR TRAIN_PARQUET OUT_DIR
    torchrun --nproc_per_node 2 -m tests.train_failures_script retriever MODEL_DIR TRAIN_PARQUET OUT_DIR \
        URL SERVER_PID stop|kill AFTER_STEP [KEY=VALUE ...]

ESTIMATOR (grpo, gae): one RL step at DP=2 where every search of DP rank 1 fails (retrieval.max_error_rate=1: the
step completes); rank 0 prints the metrics. grpo only: then one step of DAPO's dynamic sampling (algo.filter_groups)
with every search answered, whose rewards are set so that DP rank 0's first group is informative and DP rank 1's
only the third (`dapo_scores`): each rank prints the groups of each of its generate calls and rank 0 the step's
metrics. Then a step at max_error_rate 0.2: both ranks raise RetrievalDown together and print it.

The engine is the `hf` one with its generate replaced by a script (search, then answer after the observation)
so every trajectory searches; the retrieval client is replaced by one that fails on DP rank 1 only. A rank that
skipped a collective would leave the other waiting: the process group's timeout is 2 minutes here. Each rank
also prints the sampling seeds its rollout used (they must differ between DP ranks).

retriever: the real entry point (megatron_searchr1.train through cli.run_main) at tp=2 with one engine over both
ranks (rollout.engine_tp=2), against a real retrieval server at URL; rank 1's client points at a closed port (a
searcher that fails on that rank only). After step AFTER_STEP rank 0 stops (SIGSTOP: hung) or kills (SIGKILL) the
server. Every rank prints its client's request count after each step (only the engine's first rank may ask the
server, so rank 1's steps still complete) and rank 0 the time of the signal.

    torchrun --nproc_per_node 2 -m tests.train_failures_script disk_full MODEL_DIR TRAIN_PARQUET OUT_DIR URL \
        FILL_AFTER TOTAL_STEPS

disk_full: the real entry point at DP=2 against the server at URL; after step FILL_AFTER rank 0 fills the
filesystem holding OUT_DIR, when no checkpoint is due (see `disk_full`).
"""
import json
import os
import signal
import sys
import time
from collections import Counter

from megatron_searchr1.config import load_config
from megatron_searchr1.megatron.initialize import initialize_megatron
from megatron_searchr1.rollout.engine import Generation
from megatron_searchr1.search.client import RetrievalClient, RetrievalDown, SearchFailure
from megatron_searchr1.trainer.rl import Trainer


def scripted_generate(tok, seeds=None):
    """The engine's generate: search once, answer after the observation."""
    def generate(prompts, params, **_):
        if seeds is not None:
            seeds.add(params.seed)
        outs = []
        for ids in prompts:
            observed = "</information>" in tok.decode(ids[-8:])  # the prompt itself names the tags too
            text = "<answer> x </answer>" if observed else "<search> q </search>"
            got = tok.encode(text, add_special_tokens=False)
            outs.append(Generation(token_ids=got, logprobs=[-1.0] * len(got), finish_reason="stop"))
        return outs
    return generate


DAPO_INFORMATIVE_FROM = (1, 3)
"""Per DP rank, the generate call (from 1) from which its groups score 1 on one sample, 0 on the rest (informative);
before it every sample scores 0 (the group is dropped)."""


def dapo_step(trainer) -> None:
    """One step with algo.filter_groups on (algo.max_gen_batches=4), rewards by DAPO_INFORMATIVE_FROM: DP rank 0
    is satisfied after its first generate call, DP rank 1 after its third, so both must make three (the ranks agree
    after every call whether one is still short). Prints `DAPO rank=R [[uid, samples], ...] per call` on every rank
    and `DAPO_METRICS {...}` on rank 0."""
    import megatron_searchr1.trainer.losses as losses

    cfg, rt, worker = trainer.cfg, trainer.roles, trainer.worker
    calls: list = []  # per generate call on this rank: [[uid, samples of it], ...]
    generate, score = worker.generate, losses.score_trajectories

    def counting_generate(trajs, seed):
        trajs, metrics = generate(trajs, seed)
        calls.append(sorted([uid, k] for uid, k in Counter(str(t.uid) for t in trajs).items()))
        return trajs, metrics

    def dapo_scores(trajs, tokenizer, a, **kw):
        scores = score(trajs, tokenizer, a, **kw)
        informative = len(calls) >= DAPO_INFORMATIVE_FROM[rt.dp_rank]
        for t, sc in zip(trajs, scores):
            sc["score"] = 1.0 if informative and t.sample == 0 else 0.0
        return scores

    # one prompt batch per round (the default oversamples 3x), so a call's groups are the rank's share of one batch
    cfg.algo.filter_groups, cfg.algo.max_gen_batches, cfg.algo.gen_batches_per_round = True, 4, 1
    worker.generate, losses.score_trajectories = counting_generate, dapo_scores
    try:
        trainer.step_no += 1
        metrics = trainer.step()
    finally:
        worker.generate, losses.score_trajectories = generate, score
        cfg.algo.filter_groups = False
    print(f"DAPO rank={rt.rank} dp_rank={rt.dp_rank} {json.dumps(calls)}", flush=True)
    if rt.rank == 0:
        print("DAPO_METRICS " + json.dumps(metrics), flush=True)


def retriever(model_dir: str, train_file: str, out: str, url: str, server_pid: str, action: str, after: str,
              *overrides: str) -> int:
    import megatron_searchr1.trainer.rl as rl
    from megatron_searchr1 import train
    from megatron_searchr1.cli import run_main

    build_roles = rl.build_roles

    def scripted_roles(cfg):
        roles = build_roles(cfg)
        roles.worker.engine.generate = scripted_generate(roles.tokenizer)
        if roles.rank == 1:  # the engine's second rank gets a client that could only fail: it must never be asked
            roles.worker.client.close()
            roles.worker.client = RetrievalClient("http://127.0.0.1:9", timeout=1, max_retries=0)
        return roles

    step = rl.Trainer.step

    def step_then_signal(self):
        metrics = step(self)
        stats = self.worker.client.stats
        print(f"CLIENT rank={self.rank} step={self.step_no} requests={stats.requests} queries={stats.queries}",
              flush=True)
        if self.step_no == int(after) and self.rank == 0:
            os.kill(int(server_pid), signal.SIGSTOP if action == "stop" else signal.SIGKILL)
            print(f"SIGNALLED {action} at {time.time():.3f}", flush=True)
        return metrics

    rl.build_roles, rl.Trainer.step = scripted_roles, step_then_signal
    return run_main(train.main, [
        f"model.path={model_dir}", f"data.train_files=[{train_file}]", f"data.val_files=[{train_file}]",
        f"trainer.output_dir={out}", "rollout.engine=hf", "parallel.tp=2", "rollout.engine_tp=2",
        "parallel.timeout_minutes=3", "data.train_batch_size=2", "algo.ppo_mini_batch_size=2", "rollout.n=2",
        "rollout.max_turns=1", "rollout.max_tokens_per_turn=16", "rollout.max_response_length=96",
        "rollout.max_obs_length=32", "trainer.total_steps=3", "trainer.val_before_train=false",
        "trainer.test_freq=0", "trainer.save_freq=1", "trainer.export_hf=false", "logging.tensorboard=false",
        "logging.progress_bar=false", "algo.use_kl_loss=false", f"retrieval.url={url}", "retrieval.timeout=1",
        *overrides,
    ])


def disk_full(model_dir: str, train_file: str, out: str, url: str, fill_after: str, total_steps: str) -> int:
    """The real entry point at DP=2; after step FILL_AFTER (0: never) rank 0 fills the filesystem holding OUT (the
    logs' filesystem: the test mounts the checkpoints on another one), so that step's logs fail when no checkpoint
    is due (trainer.save_freq=0)."""
    import megatron_searchr1.trainer.rl as rl
    from megatron_searchr1 import train
    from megatron_searchr1.cli import run_main

    build_roles = rl.build_roles

    def scripted_roles(cfg):
        roles = build_roles(cfg)
        roles.worker.engine.generate = scripted_generate(roles.tokenizer)
        return roles

    step = rl.Trainer.step

    def step_then_fill(self):
        metrics = step(self)
        if self.step_no == int(fill_after) and self.rank == 0:
            with open(os.path.join(out, "filler"), "ab", buffering=0) as f:
                for chunk in (1 << 16, 1):
                    try:
                        while True:
                            f.write(b"x" * chunk)
                    except OSError:
                        pass
            print(f"FILLED after step {self.step_no}", flush=True)
        return metrics

    rl.build_roles, rl.Trainer.step = scripted_roles, step_then_fill
    return run_main(train.main, [
        f"model.path={model_dir}", f"data.train_files=[{train_file}]", f"data.val_files=[{train_file}]",
        f"trainer.output_dir={out}", "rollout.engine=hf", "parallel.tp=1", "parallel.timeout_minutes=3",
        "data.train_batch_size=2", "algo.ppo_mini_batch_size=2", "rollout.n=2", "rollout.max_turns=1",
        "rollout.max_tokens_per_turn=16", "rollout.max_response_length=96", "rollout.max_obs_length=32",
        f"trainer.total_steps={total_steps}", "trainer.val_before_train=false", "trainer.test_freq=0",
        "trainer.save_freq=0", "trainer.export_hf=false", "logging.tensorboard=true", "logging.progress_bar=false",
        "logging.plot=false", "algo.use_kl_loss=false", f"retrieval.url={url}",
    ])


def main(estimator: str, model_dir: str, train_file: str, out: str) -> None:
    initialize_megatron(tp=1, pp=1, seed=1, timeout_minutes=2)
    cfg = load_config(None, [
        f"model.path={model_dir}", f"data.train_files=[{train_file}]", f"trainer.output_dir={out}",
        "rollout.engine=hf", "data.train_batch_size=2", "algo.ppo_mini_batch_size=2", "rollout.n=2",
        "rollout.max_turns=1", "rollout.max_tokens_per_turn=16", "rollout.max_response_length=96",
        "rollout.max_obs_length=32", "trainer.total_steps=1", "trainer.val_before_train=false", "trainer.test_freq=0",
        "trainer.save_freq=0", "trainer.export_hf=false", "logging.tensorboard=false", "logging.progress_bar=false",
        f"algo.adv_estimator={estimator}", "algo.use_kl_loss=false",
        "retrieval.max_error_rate=1.0",  # half the step's searches fail by design: the run must go on here
    ])
    cfg.validate(world_size=2)
    trainer = Trainer(cfg)
    rt, worker = trainer.roles, trainer.worker
    tok = rt.tokenizer

    seeds = set()
    worker.engine.generate = scripted_generate(tok, seeds)
    failing = {"now": rt.dp_rank == 1}  # the DAPO step lets rank 1's searches through
    worker.client.search = lambda queries: [SearchFailure("injected") if failing["now"] else 'Doc 1(Title: "X") x\n'
                                            for _ in queries]
    metrics = trainer.step()
    print(f"SEEDS dp_rank={rt.dp_rank} {sorted(seeds)}", flush=True)  # RolloutWorker.generate's sampling seeds per turn
    if rt.rank == 0:
        print("METRICS " + json.dumps(metrics), flush=True)
    if estimator == "grpo":
        failing["now"] = False
        dapo_step(trainer)
        failing["now"] = rt.dp_rank == 1
    # at the default retrieval.max_error_rate the same failures (half the step's searches) stop both ranks together
    worker.guard.max_error_rate = 0.2
    try:
        trainer.step()
    except RetrievalDown as e:
        print(f"STOPPED rank={rt.rank} {e}", flush=True)
    trainer.close()


if __name__ == "__main__":
    if sys.argv[1] == "retriever":
        sys.exit(retriever(*sys.argv[2:]))
    if sys.argv[1] == "disk_full":
        sys.exit(disk_full(*sys.argv[2:]))
    main(*sys.argv[1:5])
