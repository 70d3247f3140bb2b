"""One RL step at DP=2 (torchrun, 2 ranks) where every search of DP rank 1 fails; rank 0 prints the metrics.

    torchrun --nproc_per_node 2 -m tests.train_failures_script ESTIMATOR MODEL_DIR TRAIN_PARQUET OUT_DIR

The engine is the `hf` one with its generate replaced by a script (search, then answer after the observation)
so every trajectory searches; the retrieval client is replaced by one that fails on DP rank 1 only. A rank that
skipped a collective would leave the other waiting: the process group's timeout is 2 minutes here. Each rank
also prints the sampling seeds its rollout used (they must differ between DP ranks).
"""
import json
import sys

from megatron_searchr1.config import load_config
from megatron_searchr1.megatron.initialize import initialize_megatron
from megatron_searchr1.rollout.engine import Generation
from megatron_searchr1.search.client import SearchFailure
from megatron_searchr1.trainer.rl import Trainer


def main(estimator: str, model_dir: str, train_file: str, out: str) -> None:
    initialize_megatron(tp=1, pp=1, seed=1, timeout_minutes=2)
    cfg = load_config(None, [
        f"model.path={model_dir}", f"data.train_files=[{train_file}]", f"trainer.output_dir={out}",
        "rollout.engine=hf", "data.train_batch_size=2", "algo.ppo_mini_batch_size=2", "rollout.n=2",
        "rollout.max_turns=1", "rollout.max_tokens_per_turn=16", "rollout.max_response_length=96",
        "rollout.max_obs_length=32", "trainer.total_steps=1", "trainer.val_before_train=false", "trainer.test_freq=0",
        "trainer.save_freq=0", "trainer.export_hf=false", "logging.tensorboard=false", "logging.progress_bar=false",
        f"algo.adv_estimator={estimator}", "algo.use_kl_loss=false",
    ])
    cfg.validate(world_size=2)
    trainer = Trainer(cfg)
    rt, worker = trainer.roles, trainer.worker
    tok = rt.tokenizer

    seeds = set()

    def scripted(prompts, params, **_):
        seeds.add(params.seed)
        outs = []
        for ids in prompts:
            observed = "</information>" in tok.decode(ids[-8:])  # the prompt itself names the tags too
            text = "<answer> x </answer>" if observed else "<search> q </search>"
            got = tok.encode(text, add_special_tokens=False)
            outs.append(Generation(token_ids=got, logprobs=[-1.0] * len(got), finish_reason="stop"))
        return outs

    worker.engine.generate = scripted
    failing = rt.dp_rank == 1
    worker.client.search = lambda queries: [(SearchFailure("injected") if failing else 'Doc 1(Title: "X") x\n')
                                             for _ in queries]
    metrics = trainer.step()
    print(f"SEEDS dp_rank={rt.dp_rank} {sorted(seeds)}", flush=True)  # RolloutWorker.generate's sampling seeds per turn
    if rt.rank == 0:
        print("METRICS " + json.dumps(metrics), flush=True)
    trainer.close()


if __name__ == "__main__":
    main(*sys.argv[1:5])
