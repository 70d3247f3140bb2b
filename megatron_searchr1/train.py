"""The RL trainer: PPO / GRPO with a search engine in the loop, Megatron actor (and critic, reference), vLLM rollouts.

    torchrun --nproc_per_node 2 -m megatron_searchr1.train examples/grpo_tiny_cpu.yaml parallel.tp=2
    python -m megatron_searchr1.train --help-config          # every field, its default and what it means

Every rank runs this same program (SPMD). One step (`Trainer.step`), as DESIGN.md lays it out:
  1. this DP rank's prompts, each repeated `rollout.n` times under its group id (`extra_info.uid`);
  2. weight sync actor -> rollout engine (weight_sync.py: TP gather, PP broadcast, HF names, buckets);
  3. rollout: the multi-turn search loop (rollout/loop.py); the ranks of one DP rank split its trajectories
     between their engines and exchange the results;
  4. the engine sleeps (frees its memory) while the trainer runs: generation and training never overlap;
  5. reward (EM on the response), old / reference log-probs and critic values (Megatron forward passes over
     token-budget micro-batches);
  6. advantages (GRPO, GAE, RLOO, REINFORCE++), critic update, actor update (PPO clip; KL as a loss or in the
     reward); retrieved tokens are masked everywhere (algo/);
  7. metrics to TensorBoard and the console, sampled trajectories to JSONL, checkpoints, validation.
"""
from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from megatron_searchr1.cli import ArgumentParser, UsageError, run_main
from megatron_searchr1.config import Config, ConfigError, describe, load_config


# ---------------------------------------------------------------------------------------------------------------
# The command line: everything here runs before torch/megatron/vllm are imported, so mistakes are reported fast.
# ---------------------------------------------------------------------------------------------------------------
def parse(argv: Optional[Sequence[str]], cls=Config, prog_doc: str = __doc__):
    p = ArgumentParser(description=prog_doc.split("\n\n")[0], epilog="Overrides: dotted KEY=VALUE, e.g. "
                       "rollout.max_turns=4 algo.adv_estimator=gae data.train_files=[a.parquet,b.parquet]")
    p.add_argument("config", nargs="?", help="experiment YAML (examples/*.yaml); KEY=VALUE overrides may follow")
    p.add_argument("overrides", nargs="*", help="dotted overrides applied after the YAML")
    p.add_argument("--help-config", action="store_true", help="list every config field with its default and exit")
    args = p.parse_args(argv)
    if args.help_config:
        print("\n".join(describe(cls)))
        raise SystemExit(0)
    overrides = list(args.overrides)
    if args.config and "=" in args.config:  # no YAML, only overrides
        overrides.insert(0, args.config)
        args.config = None
    try:
        cfg = load_config(args.config, overrides, cls=cls)
        cfg.validate(world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as e:
        raise UsageError(str(e)) from None
    return cfg


def check_retrieval(cfg: Config) -> None:
    """Fail fast (before any model is built) when the retrieval server does not answer."""
    if cfg.retrieval.launch:
        return
    import httpx

    base = cfg.retrieval.url.rstrip("/").removesuffix("/retrieve")
    try:
        httpx.post(f"{base}/retrieve", json={"queries": ["ping"], "topk": 1}, timeout=30).raise_for_status()
    except Exception as e:  # noqa: BLE001 - any failure means the same thing to the user
        raise UsageError(f"the retrieval server at {cfg.retrieval.url} does not answer ({type(e).__name__}: {e}): "
                         "start it (python -m megatron_searchr1.search.server --index-dir DIR --port 8000) or set "
                         "retrieval.launch=true retrieval.server_args=[--index-dir,DIR]") from None


# ---------------------------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, cfg: Config):
        from megatron_searchr1.config import save_config
        from megatron_searchr1.runtime import build_runtime

        self.cfg = cfg
        self.rt = build_runtime(cfg)
        self.step_no = 0
        self.synced = False  # the engine holds the actor's current weights
        if self.rt.rank == 0:
            save_config(cfg, os.path.join(cfg.trainer.output_dir, "config.yaml"))
        self.ckpt_root = os.path.join(cfg.trainer.output_dir, "checkpoints")
        self._resume()

    # -- the loop -----------------------------------------------------------------------------------------------
    def fit(self) -> dict:
        t, rt = self.cfg.trainer, self.rt
        if t.val_only:
            return self.validate()
        if t.val_before_train and self.step_no == 0 and rt.val_data:
            self.validate()
        bar = _progress(t.total_steps, self.step_no, enabled=rt.rank == 0 and self.cfg.logging.progress_bar)
        while self.step_no < t.total_steps:
            self.step_no += 1
            metrics = self.step()
            rt.logger.log(self.step_no, metrics)
            bar.update(1)
            bar.set_postfix(reward=f"{metrics.get('reward/mean', 0):.3f}",
                            searches=f"{metrics.get('rollout/searches_mean', 0):.2f}")
            rt.logger.console(self.step_no, t.total_steps, metrics, write=bar.write)
            if t.save_freq and self.step_no % t.save_freq == 0 and self.step_no < t.total_steps:
                self.save()
            if t.test_freq and self.step_no % t.test_freq == 0 and rt.val_data:
                self.validate()
        bar.close()
        self.save()
        final = self.validate() if rt.val_data and (not t.test_freq or self.step_no % t.test_freq) else {}
        if t.export_hf:
            self.export(os.path.join(t.output_dir, "hf"))
        return final

    def step(self) -> dict:
        """One RL step: DESIGN.md's seven steps."""
        from megatron.core import parallel_state as mpu

        from megatron_searchr1 import ppo
        from megatron_searchr1.metrics import mean_over_ranks, timer
        from megatron_searchr1.workers.actor import compute_log_probs
        from megatron_searchr1.workers.critic import compute_values

        cfg, rt = self.cfg, self.rt
        a, r, o = cfg.algo, cfg.rollout, cfg.optim
        budget = o.max_tokens_per_micro_batch
        with timer() as t_step:
            # 1. this DP rank's prompts, each repeated n times under its group id
            rows = [rt.train_data[i] for i in rt.sampler.next_batch()]
            trajs = self.make_trajectories(_dp_shard(rows, rt.dp_rank, rt.dp_size), r.n)
            # 2-4. weight sync, rollout on the engines, engine asleep while training
            with timer() as t_sync:
                sync_stats = self.sync_engine()
            with timer() as t_gen:
                trajs, roll_metrics = self.rollout(trajs, temperature=r.temperature, seed=self.step_seed())
            self.sleep_engine()
            # 5. reward on the response; old / reference log-probs and values on the trainer's models
            scores = ppo.score_trajectories(trajs, rt.tokenizer, a)
            seqs = ppo.to_sequences(trajs, r.drop_search_errors)
            with timer() as t_old:
                if not self.on_policy():  # else the update's own forward gives them (ppo.actor_loss_fn)
                    for s, lp in zip(seqs, compute_log_probs(rt.actor, seqs, max_tokens_per_micro_batch=budget,
                                                             temperature=r.temperature)):
                        s["old_log_probs"] = lp
                if rt.ref is not None:
                    for s, lp in zip(seqs, compute_log_probs(rt.ref, seqs, max_tokens_per_micro_batch=budget,
                                                             temperature=r.temperature)):
                        s["ref_log_probs"] = lp
                if rt.critic is not None:
                    for s, v in zip(seqs, compute_values(rt.critic, seqs, max_tokens_per_micro_batch=budget)):
                        s["values"] = v
            # 6. advantages, critic update, actor update
            # whitening and the advantage metrics over the whole batch (a sum over DP; every rank takes part,
            # also one whose trajectories were all dropped)
            adv_metrics = ppo.add_advantages(seqs, [x["score"] for x in scores], [tr.uid for tr in trajs], a,
                                             rt.kl_ctrl, reduce=ppo.dp_sum(mpu.get_data_parallel_group()))
            if a.use_kl_in_reward:  # one coefficient for all ranks: the KL is the whole batch's already
                rt.kl_ctrl.update(adv_metrics["actor/reward_kl_penalty"], n_steps=cfg.data.train_batch_size * r.n)
            lr_used = rt.actor_opt.param_groups[0]["lr"]  # before update() steps the schedule
            with timer() as t_train:
                update_metrics = self.update(seqs)
            self.synced = False
            # 7. metrics (the rest happens in fit: logging, checkpoints, validation)
            metrics = {**roll_metrics, **adv_metrics, **update_metrics, **self.reward_metrics(trajs, scores),
                       **{f"sync/{k}": v for k, v in sync_stats.items()}}
            if r.temperature == 1.0:  # engine log-probs are of the untempered model (vllm: raw_logprobs)
                metrics["train/logprob_gap_engine"] = (metrics.pop("actor/logprob_gap_engine", float("nan"))
                                                       if self.on_policy() else ppo.logprob_gap(seqs))
        gen_tokens = sum(len(tr.response_ids) for tr in trajs)
        metrics.update({"time/step": t_step.seconds, "time/sync": t_sync.seconds, "time/rollout": t_gen.seconds,
                        "time/old_log_probs": t_old.seconds, "time/update": t_train.seconds,
                        "perf/response_tokens_per_s": gen_tokens / max(t_gen.seconds, 1e-9),
                        "train/lr": lr_used})
        metrics = mean_over_ranks(metrics)
        self.write_samples(trajs, scores)
        return metrics

    def on_policy(self) -> bool:
        """Whether a step makes exactly one optimizer update from its rollouts (one epoch, one mini-batch) and
        nothing else reads the old log-probs: then they equal the update's own log-probs before its single
        step, and the actor loss takes those (detached) instead of a separate forward pass over every sequence
        (~18 % of a CPU demo step)."""
        a = self.cfg.algo
        return (a.ppo_epochs == 1 and a.ppo_mini_batch_size == self.cfg.data.train_batch_size
                and not a.use_kl_in_reward)

    def update(self, seqs: list) -> dict:
        """Critic, then actor: ppo_epochs passes over mini-batches of this rank's sequences."""
        from megatron_searchr1 import ppo
        from megatron_searchr1.megatron.batching import make_micro_batches, split_mini_batches
        from megatron_searchr1.workers.schedule import train_step

        cfg, rt = self.cfg, self.rt
        a, o = cfg.algo, cfg.optim
        n_mini = cfg.data.train_batch_size // a.ppo_mini_batch_size
        sums: dict[str, float] = {}

        def run(model, opt, loss_fn, prefix, **kw):
            for epoch in range(a.ppo_epochs):
                for mini in split_mini_batches(len(seqs), n_mini, seed=self.step_seed() + epoch):
                    mbs = make_micro_batches([seqs[i] for i in mini], o.max_tokens_per_micro_batch)
                    m = train_step(model, opt, None, mbs, loss_fn, **kw)
                    for k, v in m.items():
                        sums[f"{prefix}/{k}"] = sums.get(f"{prefix}/{k}", 0.0) + float(v)

        if rt.critic is not None:
            run(rt.critic, rt.critic_opt, ppo.critic_loss_fn(a), "critic")
            rt.critic_sched.step(1)
        if self.step_no >= o.critic_warmup:  # verl: the actor updates once critic_warmup <= step (steps from 1)
            run(rt.actor, rt.actor_opt, ppo.actor_loss_fn(a, engine_gap=cfg.rollout.temperature == 1.0), "actor",
                temperature=cfg.rollout.temperature, with_entropy=True, entropy_grad=a.entropy_coeff != 0)
            rt.actor_sched.step(1)
        n_updates = a.ppo_epochs * n_mini
        return {k: v / n_updates for k, v in sums.items()}

    # -- rollout --------------------------------------------------------------------------------------------------
    def make_trajectories(self, rows: list, n: int) -> list:
        from megatron_searchr1.rollout.loop import Trajectory

        return [Trajectory(prompt_ids=list(row.prompt_ids), uid=row.uid, sample=k,
                           meta={"data_source": row.data_source, "ground_truth": row.ground_truth,
                                 "question": row.question, "split": row.extra.get("split", "")})
                for row in rows for k in range(n)]

    def rollout(self, trajs: list, temperature: float, seed: int) -> tuple[list, dict]:
        """Run the search loop. The tp*pp ranks of a DP rank hold the same trajectories: each of their engines
        runs a share (rollout/engine_groups.py: the one rule for which ranks form an engine), and the finished
        shares are exchanged so every rank returns all of them, in order."""
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        from collections import Counter

        from megatron_searchr1.rollout.engine_groups import EngineLayout
        from megatron_searchr1.rollout.loop import LoopSettings, RolloutStats, run_rollout

        cfg, rt, r = self.cfg, self.rt, self.cfg.rollout
        layout = EngineLayout(rt.world, cfg.parallel.tp, cfg.parallel.pp, r.engine_tp)
        share, shares = layout.share(rt.rank)
        mine = trajs[share::shares]
        settings = LoopSettings(max_turns=r.max_turns, max_tokens_per_turn=r.max_tokens_per_turn,
                                max_response_length=r.max_response_length, max_obs_length=r.max_obs_length,
                                temperature=temperature, top_p=r.top_p if temperature > 0 else 1.0,
                                top_k=r.top_k if temperature > 0 else -1, stop_token_ids=rt.stop_token_ids,
                                # one seed per engine: DP ranks and shares draw different noise
                                seed=layout.sampling_seed(seed, rt.rank))
        self.wake_engine()
        stats = run_rollout(rt.engine, rt.tokenizer, rt.client.search, mine, settings)
        metrics = stats.as_metrics(mine)
        group = mpu.get_model_parallel_group()
        if dist.get_world_size(group) > 1:
            parts: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(parts, (share, mine), group=group)
            done = list(trajs)
            for k, part in dict(parts).items():
                done[k::shares] = part
            trajs = done
            # the counters in `stats` are this engine's share: finish reasons are recounted over all trajectories
            everything = RolloutStats(finish=Counter(tr.finish_reason for tr in trajs))
            metrics = {**everything.as_metrics(trajs), "time/generate": metrics["time/generate"],
                       "time/search": metrics["time/search"], "rollout/computed_tokens": metrics["rollout/computed_tokens"]}
        return trajs, metrics

    def sync_engine(self) -> dict:
        """Wake the engine with the actor's current weights (every rank takes part; with engine_tp = 1 every rank
        feeds its own engine), in verl's order (rollout/engine.py wake_and_sync): weights, sync, then KV cache.
        The opt-in offloads (model.*_offload, megatron/offload.py) free the trainer's memory around it."""
        from megatron_searchr1.rollout.engine import wake_and_sync
        from megatron_searchr1.rollout.weight_sync import sync_weights
        from megatron_searchr1.runtime import DTYPES

        rt, r = self.rt, self.cfg.rollout
        if self.synced and not getattr(self, "_asleep", False):
            return {}
        dtype = DTYPES[self.cfg.model.dtype if r.dtype == "auto" else r.dtype]

        def sync():
            return sync_weights(rt.actor, rt.engine, rt.mapping, bucket_bytes=r.sync_bucket_mb << 20, dtype=dtype)

        offload = self.offload()
        offload.before_wake()
        stats = wake_and_sync(rt.engine, None if self.synced else sync, after_sync=offload.after_sync)
        self.synced, self._asleep = True, False
        return stats.as_dict() if stats is not None else {}

    def wake_engine(self) -> None:
        self.sync_engine()

    def sleep_engine(self) -> None:
        """Engine asleep at rollout.sleep_level (level 2 drops its weights: the next wake-up syncs them), then the
        offloaded trainer memory back."""
        from megatron_searchr1.rollout.engine import sleep_engine

        r = self.cfg.rollout
        if r.sleep_between_steps and not getattr(self, "_asleep", False):
            if sleep_engine(self.rt.engine, r.sleep_level):
                self.synced = False
            self._asleep = True
        self.offload().reload()

    def offload(self):
        """The model.*_offload flags around generation (megatron/offload.py), built once."""
        from megatron_searchr1.megatron.offload import GenerationOffload

        if getattr(self, "_offload", None) is None:
            rt = self.rt
            self._offload = GenerationOffload(self.cfg.model, actor=rt.actor, actor_opt=rt.actor_opt,
                                              critic=rt.critic, critic_opt=rt.critic_opt, ref=rt.ref)
        return self._offload

    def step_seed(self) -> int:
        return self.cfg.trainer.seed * 1_000_003 + self.step_no * 7919

    # -- validation ---------------------------------------------------------------------------------------------
    def validate(self) -> dict:
        """Greedy rollouts on the validation rows (split over all ranks), EM / sub-EM / F1 per data_source."""
        import torch.distributed as dist

        from megatron_searchr1 import ppo
        from megatron_searchr1.rollout.engine_groups import EngineLayout
        from megatron_searchr1.rollout.loop import LoopSettings, run_rollout

        cfg, rt, r = self.cfg, self.rt, self.cfg.rollout
        self.sync_engine()
        self.wake_engine()
        # ranks of one vLLM TP group send the same prompts: split the rows over engine groups, not ranks
        layout = EngineLayout(rt.world, cfg.parallel.tp, cfg.parallel.pp, r.engine_tp)
        group, n_groups = layout.group_of(rt.rank), len(layout.groups)
        rows = rt.val_data[group::n_groups]
        settings = LoopSettings(max_turns=r.max_turns, max_tokens_per_turn=r.max_tokens_per_turn,
                                max_response_length=r.max_response_length, max_obs_length=r.max_obs_length,
                                temperature=r.val_temperature, stop_token_ids=rt.stop_token_ids,
                                seed=cfg.trainer.seed)
        from megatron_searchr1.infer import turn_segments

        records, samples = [], []
        bs = cfg.data.val_batch_size
        for start in range(0, len(rows), bs):
            trajs = self.make_trajectories(rows[start:start + bs], 1)
            run_rollout(rt.engine, rt.tokenizer, rt.client.search, trajs, settings)
            for tr, sc in zip(trajs, ppo.score_trajectories(trajs, rt.tokenizer, cfg.algo)):
                if len(samples) < cfg.logging.trajectories_per_step:
                    samples.append({"uid": tr.uid, "question": tr.meta["question"], "score": sc["score"],
                                    "target": list(tr.meta["ground_truth"].get("target", [])),
                                    "finish": tr.finish_reason, "turns": turn_segments(rt.tokenizer, tr)})
                records.append({"data_source": tr.meta["data_source"], "split": tr.meta.get("split", ""),
                                "uid": tr.uid, **sc,
                                "searches": tr.n_searches, "turns": tr.turns, "finish": tr.finish_reason,
                                "length": len(tr.response_ids)})
        self.sleep_engine()
        parts: list = [None] * rt.world
        dist.all_gather_object(parts, records if rt.rank == layout.groups[group][0] else [])
        records = [x for part in parts for x in part]
        report = summarize_eval(records)
        metrics = {f"val/{k}": v for k, v in report["metrics"].items()}
        rt.logger.log(self.step_no, metrics)
        rt.logger.trajectories(self.step_no, samples, name="val_trajectories.jsonl")
        if rt.rank == 0:
            print(format_eval_table(report, title=f"validation at step {self.step_no}"), flush=True)
            with open(os.path.join(cfg.trainer.output_dir, "val_report.jsonl"), "a") as f:
                import json

                f.write(json.dumps({"step": self.step_no, **report}) + "\n")
        return report

    # -- checkpoints and export --------------------------------------------------------------------------------
    def _models(self):
        rt = self.rt
        models, opts, scheds = {"actor": rt.actor}, {"actor": rt.actor_opt}, {"actor": rt.actor_sched}
        if rt.critic is not None:
            models["critic"], opts["critic"], scheds["critic"] = rt.critic, rt.critic_opt, rt.critic_sched
        return models, opts, scheds

    def save(self) -> None:
        from megatron_searchr1.checkpoint import save_checkpoint

        rt = self.rt
        models, opts, scheds = self._models()
        extra = {"step": self.step_no, "sampler": rt.sampler.state_dict() if rt.sampler else None,
                 "kl_ctrl": rt.kl_ctrl.state_dict(), "ref_source": rt.model_source if rt.ref is not None else None}
        save_checkpoint(self.ckpt_root, self.step_no, models, opts, scheds, extra,
                        hf_dirs={name: rt.hf_dir for name in models}, keep_last=self.cfg.trainer.keep_last)

    def _resume(self) -> None:
        from megatron_searchr1.checkpoint import agreed_resume_target, load_checkpoint
        from megatron_searchr1.runtime import load_reference

        t, rt = self.cfg.trainer, self.rt
        target = agreed_resume_target(t.resume, self.ckpt_root)  # rank 0 decides the step for every node
        if target is None:
            return
        root, step = target
        models, opts, scheds = self._models()
        extra = load_checkpoint(root, step, models, opts, scheds)
        self.step_no = int(extra["step"])
        if rt.sampler is not None and extra.get("sampler"):
            rt.sampler.load_state_dict(extra["sampler"])
        rt.kl_ctrl.load_state_dict(extra["kl_ctrl"])
        pinned = extra.get("ref_source")  # the reference this run started with, not today's latest of its root
        if rt.ref is not None and pinned and pinned != rt.model_source:
            load_reference(rt, pinned)
        if rt.rank == 0:
            ref = f", reference {rt.model_source}" if rt.ref is not None else ""
            print(f"resumed from {root} at step {self.step_no}{ref}", flush=True)

    def export(self, out_dir: str) -> None:
        from megatron_searchr1.export import export_hf
        from megatron_searchr1.runtime import DTYPES

        export_hf(self.rt.actor, self.rt.mapping, self.rt.hf_dir, out_dir, dtype=DTYPES[self.cfg.model.dtype])
        if self.rt.rank == 0:
            print(f"exported the actor as a Hugging Face model to {out_dir}", flush=True)

    def reward_metrics(self, trajs: list, scores: list) -> dict:
        """Reward and EM overall and per data source, over the whole batch: the DP ranks hold different data
        sources, so their records are gathered (the metrics then have the same keys and values on every rank)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        mine = [(tr.meta["data_source"], sc["score"], sc["em"]) for tr, sc in zip(trajs, scores)]
        parts: list = [None] * self.rt.dp_size
        dist.all_gather_object(parts, mine, group=mpu.get_data_parallel_group())
        return reward_table([x for part in parts for x in part])

    def write_samples(self, trajs: list, scores: list) -> None:
        from megatron_searchr1.rollout.loop import response_text

        k = self.cfg.logging.trajectories_per_step
        if not k or self.rt.rank != 0:
            return
        recs = [{"uid": tr.uid, "sample": tr.sample, "data_source": tr.meta["data_source"],
                 "question": tr.meta["question"], "target": list(tr.meta["ground_truth"].get("target", [])),
                 "response": response_text(self.rt.tokenizer, tr), "answer": tr.answer, "score": sc["score"],
                 "finish": tr.finish_reason, "searches": tr.n_searches} for tr, sc in zip(trajs[:k], scores[:k])]
        self.rt.logger.trajectories(self.step_no, recs)

    def close(self) -> None:
        self.rt.close()


def _dp_shard(rows: list, dp_rank: int, dp_size: int) -> list:
    from megatron_searchr1.data.rl_data import dp_shard

    return dp_shard(rows, dp_rank, dp_size)


def reward_table(records: list[tuple[str, float, float]]) -> dict:
    """(data_source, reward, em) per trajectory -> reward and EM overall and per data source.

    >>> reward_table([("nq", 1.0, 1.0), ("nq", 0.0, 0.0), ("hotpotqa", 0.5, 0.0)])["reward/nq/mean"]
    0.5
    """
    out: dict[str, float] = {}
    for name, recs in [("", records)] + sorted(
            (f"{src}/", [x for x in records if x[0] == src]) for src in {x[0] for x in records}):
        n = max(len(recs), 1)
        out[f"reward/{name}mean"] = sum(x[1] for x in recs) / n
        out[f"reward/{name}em"] = sum(x[2] for x in recs) / n
    return out


def summarize_eval(records: list[dict]) -> dict:
    """Per data_source and overall: n, EM, sub-EM, F1, mean searches / turns / length, finish-reason shares."""
    from collections import Counter, defaultdict

    groups: dict[str, list] = defaultdict(list)
    for rec in records:
        groups[rec["data_source"]].append(rec)
        if rec.get("split"):  # validation and test files of one source: also reported per split
            groups[f"split:{rec['split']}"].append(rec)
    groups["all"] = list(records)
    table, metrics = {}, {}
    for source, recs in sorted(groups.items()):
        n = max(len(recs), 1)
        row = {"n": len(recs)}
        for key in ("em", "subem", "f1", "searches", "turns", "length"):
            row[key] = sum(float(x[key]) for x in recs) / n
        finish = Counter(x["finish"] for x in recs)
        row["finish"] = {k: v / n for k, v in sorted(finish.items())}
        table[source] = row
        for key in ("em", "subem", "f1", "searches"):
            metrics[f"{source}/{key}"] = row[key]
    return {"table": table, "metrics": metrics}


def format_eval_table(report: dict, title: str = "evaluation") -> str:
    lines = [title, f"{'data_source':<22}{'n':>6}{'EM':>8}{'subEM':>8}{'F1':>8}{'search':>8}{'turns':>7}  finish"]
    for source, row in report["table"].items():
        finish = " ".join(f"{k}={v:.2f}" for k, v in row["finish"].items())
        lines.append(f"{source:<22}{row['n']:>6}{row['em']:>8.3f}{row['subem']:>8.3f}{row['f1']:>8.3f}"
                     f"{row['searches']:>8.2f}{row['turns']:>7.2f}  {finish}")
    return "\n".join(lines)


def _progress(total: int, start: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="RL steps", unit="step", disable=not enabled, dynamic_ncols=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    cfg = parse(argv)
    check_retrieval(cfg)
    trainer = Trainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return 0


def cli() -> int:
    """Console-script entry: user mistakes become one `error:` line and exit code 2."""
    return run_main(main)


if __name__ == "__main__":
    sys.exit(cli())
