"""The RL trainer: PPO / GRPO with a search engine in the loop, on the roles of trainer/build.py.

    trainer = Trainer(cfg)      # every rank (SPMD): builds the roles, resumes from the latest checkpoint
    trainer.fit()               # steps, checkpoints, validation, HF export; trainer.close()

Every rank runs this same program (SPMD) and holds every role (trainer/roles.py, built by trainer/build.py): the
Policy (the actor, and the frozen reference when a KL term is used), the Critic (GAE only) and the RolloutWorker
(this rank's engine and retrieval client). Every forward and update goes through megatron/schedule.py (Megatron's
pipeline schedule, any TP/PP/DP); rewards, advantages and the loss callbacks are trainer/losses.py over algo/'s
pure tensor functions.

One step (`Trainer.step`):
  1. weight sync policy -> rollout engine (rollout/weight_sync.py: TP gather, PP broadcast, HF names, buckets);
  2. this DP rank's prompts, each repeated `rollout.n` times under its group id;
  3. rollout: the multi-turn search loop (rollout/loop.py), a share of the replica's trajectories per engine;
     with algo.filter_groups, again on new prompts until the batch holds enough informative groups (DAPO);
  4. the engine sleeps (frees its memory) while the trainer runs: generation and training never overlap;
  5. reward (EM on the response, DAPO's overlong shaping), old / reference log-probs and critic values (Megatron
     forward passes);
  6. advantages (GRPO, GAE, RLOO, REINFORCE++), critic update, actor update (algo.policy_loss: PPO / GSPO / CISPO,
     with the rollout correction's weights and LLDS; KL as a loss or in the reward); retrieved tokens are masked
     everywhere (algo/);
  7. metrics to TensorBoard and the console, sampled trajectories to JSONL, checkpoints, validation; with
     trainer.stop_on_collapse, a checkpoint and a stop when the positive-advantage likelihood collapses.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from megatron_searchr1 import algo, interrupt
from megatron_searchr1.checkpoint import (
    RoleState, agreed_resume_target, latest_step, load_roles, save_roles, step_dir,
)
from megatron_searchr1.config import Config, save_config
from megatron_searchr1.console import progress
from megatron_searchr1.data.rl_data import dp_shard
from megatron_searchr1.megatron import tree_packing
from megatron_searchr1.megatron.batching import TrainSequence, make_micro_batches, split_mini_batches
from megatron_searchr1.metrics import LogStorageError, mean_over_ranks, timer
from megatron_searchr1.search.client import RetrievalDown
from megatron_searchr1.trainer import losses
from megatron_searchr1.trainer.build import Roles, build_roles
from megatron_searchr1.trainer.reports import format_eval_table, reward_table, sample_records, summarize_eval


def step_seed(seed: int, step: int) -> int:
    """The base sampling / shuffling seed of RL step `step` (1-based) of a run seeded `seed`: one definition for the
    colocated trainer and the disaggregated rollout ranks, so both placements derive a step's seeds the same way."""
    return seed * 1_000_003 + step * 7919


class Trainer:
    def __init__(self, cfg: Config, roles: Roles | None = None):
        self.cfg = cfg
        self.roles = roles if roles is not None else build_roles(cfg)
        interrupt.reassert()  # Ctrl-C: our one-line exit, whatever the engines built above installed
        self.policy, self.reference, self.critic = self.roles.policy, self.roles.reference, self.roles.critic
        self.worker, self.data = self.roles.worker, self.roles.data
        self.rank = self.roles.rank
        self.step_no = 0
        self.logp_pos_history: list = []  # actor/logp_pos_mean per step, for trainer.stop_on_collapse
        if self.rank == 0:
            save_config(cfg, os.path.join(cfg.trainer.output_dir, "config.yaml"))
        self.ckpt_root = os.path.join(cfg.trainer.output_dir, "checkpoints")
        self._resume()

    # -- the loop -----------------------------------------------------------------------------------------------
    def fit(self) -> dict:
        t, logger = self.cfg.trainer, self.roles.logger
        if t.val_only:
            return self.validate()
        if t.val_before_train and self.step_no == 0 and self.data.val:
            self.validate()
        bar = progress(total=t.total_steps, initial=self.step_no, desc="RL steps", unit="step",
                   disable=not (self.rank == 0 and self.cfg.logging.progress_bar))
        try:
            while self.step_no < t.total_steps:
                sampler_state = self.data.sampler.state_dict() if self.data.sampler is not None else None
                self.step_no += 1
                interrupt.note(f"in step {self.step_no} of {t.total_steps}")
                try:
                    metrics = self.step()
                except RetrievalDown:  # raised by the rollout, before any update: this step did not happen
                    self.step_no -= 1
                    if sampler_state is not None:
                        self.data.sampler.load_state_dict(sampler_state)  # its prompts are drawn again on resume
                    raise
                logger.log(self.step_no, metrics)
                bar.update(1)
                bar.set_postfix(reward=f"{metrics.get('reward/mean', 0):.3f}",
                                searches=f"{metrics.get('rollout/searches_mean', 0):.2f}")
                logger.console(self.step_no, t.total_steps, metrics, write=bar.write)
                logger.raise_if_failed()  # a full disk under the logs (this step's or the last validation's): all ranks
                if self.collapsed(metrics):
                    break
                if t.save_freq and self.step_no % t.save_freq == 0 and self.step_no < t.total_steps:
                    self.save()
                if t.test_freq and self.step_no % t.test_freq == 0 and self.data.val:
                    self.validate()
        except (RetrievalDown, LogStorageError):
            # every rank raises it together (RolloutWorker checks collectively), so the save's collectives match;
            # the engine goes to sleep first, which also brings offloaded trainer memory back
            bar.close()
            self.worker.sleep()
            if self.step_no and latest_step(self.ckpt_root) != self.step_no:
                self.save()
            raise
        bar.close()
        interrupt.note(f"after step {self.step_no} of {t.total_steps} (final save, validation, export)")
        self.save()
        final = self.validate() if self.data.val and (not t.test_freq or self.step_no % t.test_freq) else {}
        if t.export_hf:
            self.export(os.path.join(t.output_dir, "hf"))
        if self.cfg.logging.plot and self.rank == 0:
            from megatron_searchr1.plots import plot_rl_curves
            logger.guarded(t.output_dir, plot_rl_curves, t.output_dir)
        logger.raise_if_failed()  # the final validation's logs
        return final

    def collapsed(self, metrics: dict) -> bool:
        """trainer.stop_on_collapse: True (after a checkpoint is saved) when the mean old log-prob of positive-
        advantage tokens fell by more than trainer.collapse_nats over trainer.collapse_window steps
        (algo/collapse.py). The metrics are the same on every rank (mean_over_ranks), so all ranks stop together.
        The history starts anew on resume."""
        t = self.cfg.trainer
        self.logp_pos_history.append(metrics.get("actor/logp_pos_mean"))
        if not t.stop_on_collapse or not algo.has_collapsed(self.logp_pos_history, t.collapse_window,
                                                            t.collapse_nats):
            return False
        drop = algo.likelihood_drop(self.logp_pos_history, t.collapse_window)
        if self.rank == 0:
            print(f"stopping at step {self.step_no}: actor/logp_pos_mean (mean log-likelihood of positive-advantage "
                  f"tokens) fell {drop:.3f} nats over {t.collapse_window} steps (> trainer.collapse_nats="
                  f"{t.collapse_nats}); saving a checkpoint and stopping (algo/collapse.py)", flush=True)
        return True

    def step(self) -> dict:
        """One RL step: the seven steps of the module docstring."""
        cfg, roles, worker = self.cfg, self.roles, self.worker
        a, r, budget = cfg.algo, cfg.rollout, cfg.optim.max_tokens_per_micro_batch
        with timer() as t_step:
            with timer() as t_sync:
                sync_stats = worker.sync(self.policy)                                                 # 2. sync
            with timer() as t_gen:                                                            # 1, 3. prompts, generate
                trajs, scores, group_ids, roll_metrics = self.generate_batch()
            worker.sleep()                                                                            # 4.
            seqs = losses.to_sequences(trajs, r.drop_search_errors)
            roll_metrics.update(losses.shape_overlong(trajs, scores, seqs, a, r.max_response_length))  # 5. DAPO
            # rollout.tree.pack_forward: a tree's leaves as one packed row in these forwards (tree_packing.py)
            forwards = not self.on_policy() or self.reference is not None or self.critic is not None
            pack = {"pack_keys": [tr.meta["tree"].tree for tr in trajs]} if r.tree.pack_forward and forwards else {}
            with timer() as t_old:                                                                    # forwards
                if not self.on_policy():  # else the update's own forward gives them (losses.actor_loss_fn)
                    for s, lp in zip(seqs, self.policy.log_probs(seqs, budget, r.temperature, **pack)):
                        s.old_log_probs = lp
                if self.reference is not None:
                    for s, lp in zip(seqs, self.reference.log_probs(seqs, budget, r.temperature, **pack)):
                        s.ref_log_probs = lp
                if self.critic is not None:
                    for s, v in zip(seqs, self.critic.values(seqs, budget, **pack)):
                        s.values = v
            if pack:
                packed, per_leaf = tree_packing.forward_token_counts(seqs, pack["pack_keys"], budget)
                roll_metrics["tree/packed_forward_token_ratio"] = packed / max(per_leaf, 1)
            # 6. advantages: whitening and the advantage metrics over the whole batch (a sum over DP; every rank
            # takes part, also one whose trajectories were all dropped)
            adv_metrics = losses.add_advantages(seqs, [x["score"] for x in scores], group_ids, a,
                                                roles.kl_ctrl, reduce=losses.dp_sum(mpu.get_data_parallel_group()),
                                                turns=losses.turn_inputs(trajs, roles.tokenizer, a,
                                                                         self.gold_answers(trajs)),
                                                trees=[tr.meta.get("tree") for tr in trajs])
            losses.apply_overlong_filter(trajs, seqs, a)  # after the advantages: the reward stayed in its group
            if a.use_kl_in_reward:  # one coefficient for all ranks: the KL is the whole batch's already
                roles.kl_ctrl.update(adv_metrics["actor/reward_kl_penalty"], n_steps=cfg.data.train_batch_size * r.n)
            lr_used = self.policy.lr  # before update() steps the schedule
            with timer() as t_train:
                update_metrics = self.update(seqs, mean_searches=self.mean_searches(trajs))          # critic, actor
            worker.mark_stale()
            # 7. metrics (the rest happens in fit: logging, checkpoints, validation)
            metrics = {**roll_metrics, **adv_metrics, **update_metrics, **self.reward_metrics(trajs, scores),
                       **{f"sync/{k}": v for k, v in sync_stats.items()}}
            if self.engine_comparable():
                metrics["train/logprob_gap_engine"] = (metrics.pop("actor/logprob_gap_engine", float("nan"))
                                                       if self.on_policy() else losses.logprob_gap(seqs))
        gen_tokens = sum(len(tr.response_ids) for tr in trajs)
        metrics.update({"time/step": t_step.seconds, "time/sync": t_sync.seconds, "time/rollout": t_gen.seconds,
                        "time/old_log_probs": t_old.seconds, "time/update": t_train.seconds,
                        "perf/response_tokens_per_s": gen_tokens / max(t_gen.seconds, 1e-9),
                        "train/lr": lr_used})
        metrics = mean_over_ranks(metrics)
        self.write_samples(trajs, scores)
        return metrics

    def generate_batch(self) -> tuple[list, list[dict], list[str], dict]:
        """This rank's trajectories of one step, their scores, group ids and the rollout metrics.

        Without algo.filter_groups: one generate call on the next batch of prompts. With it (DAPO's dynamic
        sampling, as verl-recipe's DAPO trainer does it): each round draws algo.gen_batches_per_round batches of
        prompts (oversampling), keeps the informative groups (algo.filter_groups: judged on the training score with
        overlong shaping, over the rows that stay in the group, and only if a row that trains moves) and rounds go
        on until this rank holds its share of data.train_batch_size groups or algo.max_gen_batches rounds have run.
        Extra informative groups are left unused (verl cuts the batch to its size too). A group lives on one rank
        (its n samples are made there), and the ranks agree after every round, with one all_reduce over the DP
        group, whether any of them is still short, so every rank makes the same number of generate calls (each one
        holds collectives).

        A rank still short at the end trains on the informative groups it has (no uninformative filler: with a KL
        loss, an entropy bonus or overlong shaping a group of equal rewards still moves the policy), and the
        losses average over the tokens that are there (the schedule's counts are the mini-batch's). A rank with too
        few sequences to give each of its mini-batches one: every rank raises together (one line that says what to
        change), as verl-recipe's trainer raises when its rounds run out."""
        cfg, roles, worker = self.cfg, self.roles, self.worker
        a, r = cfg.algo, cfg.rollout
        want = cfg.data.train_batch_size // roles.dp_size  # groups this rank must hold
        kept: list[tuple] = []  # (trajs, scores, group id) per group
        roll_metrics: dict = {}
        calls = generated = 0
        per_round = a.gen_batches_per_round if a.filter_groups else 1
        while True:
            rows = [self.data.train[i] for _ in range(per_round) for i in self.data.sampler.next_batch()]
            trajs = worker.make_trajectories(dp_shard(rows, roles.dp_rank, roles.dp_size), r.n)
            trajs, m = worker.generate(trajs, seed=self.step_seed() + calls)
            roll_metrics = roll_metrics or m  # the first call's rollout metrics (the one without filtering)
            scores = losses.score_trajectories(trajs, roles.tokenizer, a, agree=losses.any_rank)
            groups: dict[str, list[int]] = {}
            for i, tr in enumerate(trajs):
                groups.setdefault(tr.uid, []).append(i)
            if a.filter_groups:
                keep, _ = algo.filter_groups(
                    losses.overlong_scores(trajs, scores, a, r.max_response_length), index=[t.uid for t in trajs],
                    trainable=[not cut for cut in losses.overlong_truncated(trajs, a)],
                    counted=[not (r.drop_search_errors and t.finish_reason == "search_error") for t in trajs])
            for uid, idx in groups.items():
                if not a.filter_groups or bool(keep[idx[0]]):
                    kept.append(([trajs[i] for i in idx], [scores[i] for i in idx], f"{calls}:{uid}"))
            calls += 1
            generated += len(groups)
            if not a.filter_groups:
                break
            short = torch.tensor([float(len(kept) < want)], dtype=torch.float64)
            short = losses.dp_sum(mpu.get_data_parallel_group())(short)
            if float(short) == 0 or calls >= a.max_gen_batches:
                break
        chosen = kept[:want]
        if a.filter_groups:
            n_mini = cfg.data.train_batch_size // a.ppo_mini_batch_size
            too_few = torch.tensor([float(len(chosen) * r.n < n_mini), float(len(chosen))], dtype=torch.float64)
            too_few = losses.dp_sum(mpu.get_data_parallel_group())(too_few)
            if float(too_few[0]) > 0:  # every rank sees the same sum, so all raise together
                from megatron_searchr1.cli import UsageError
                raise UsageError(
                    f"step {self.step_no}: algo.filter_groups found {int(too_few[1])} of "
                    f"{cfg.data.train_batch_size} informative groups in {calls} rounds of "
                    f"{per_round} x data.train_batch_size prompts, too few for {n_mini} mini-batches on every DP "
                    "rank: raise algo.max_gen_batches or algo.gen_batches_per_round, use data the policy gets "
                    "partly right, or set algo.filter_groups=false")
            roll_metrics = {**roll_metrics, "dapo/groups_generated": float(generated),
                            "dapo/groups_kept": float(len(chosen)), "dapo/generate_calls": float(calls)}
            if len(chosen) < want and roles.dp_rank == 0 and self.rank == 0:
                print(f"step {self.step_no}: algo.filter_groups found {len(chosen)} of {want} informative groups on "
                      f"rank 0 in {calls} rounds (algo.max_gen_batches); training on those (token-mean over "
                      "their tokens), no uninformative filler", flush=True)
        out_trajs = [t for g in chosen for t in g[0]]
        out_scores = [sc for g in chosen for sc in g[1]]
        gids = [g[2] for g in chosen for _ in g[0]]
        return out_trajs, out_scores, gids, roll_metrics

    def engine_comparable(self) -> bool:
        """Whether the engine's log-probs (of the sampling distribution: temperature, then top-k / top-p) are the
        trainer's (at the temperature, untruncated): with top-k and top-p off, at any temperature."""
        r = self.cfg.rollout
        return r.top_p == 1.0 and r.top_k in (-1, 0)

    def on_policy(self) -> bool:
        """Whether a step makes exactly one optimizer update from its rollouts (one epoch, one mini-batch) and
        nothing else reads the old log-probs: then they equal the update's own log-probs before its single
        step, and the actor loss takes those (detached) instead of a separate forward pass over every
        sequence."""
        a = self.cfg.algo
        return (a.ppo_epochs == 1 and a.ppo_mini_batch_size == self.cfg.data.train_batch_size
                and not a.use_kl_in_reward)

    def gold_answers(self, trajs: list) -> list[list[str]] | None:
        """Per trajectory, the answers of its question's gold chain when the data carries one (the synthetic world's
        `extra_info.chain`): algo.turn_credit's retrieved_answer reward counts a hop found as progress. None when
        turn-level rewards are off."""
        tc = self.cfg.algo.turn_credit
        if not tc.enabled or tc.turn_reward == "none":
            return None
        if getattr(self, "_chains", None) is None:
            self._chains = {row.uid: [str(h.get("answer", "")) for h in (row.extra.get("chain") or [])]
                            for row in self.data.train}
        return [self._chains.get(t.uid, []) for t in trajs]

    def mean_searches(self, trajs: list) -> float:
        """Searches per trajectory over the whole batch (all DP ranks): LLDS's adaptive answer weight reads it."""
        if not self.cfg.algo.llds.answer_adaptive:
            return 0.0
        t = torch.tensor([float(sum(tr.n_searches for tr in trajs)), float(len(trajs))], dtype=torch.float64)
        t = losses.dp_sum(mpu.get_data_parallel_group())(t)
        return float(t[0]) / max(float(t[1]), 1.0)

    def update(self, seqs: list[TrainSequence], mean_searches: float = 0.0) -> dict:
        """Critic, then actor: ppo_epochs passes over mini-batches of this rank's sequences. `mean_searches`: the
        batch's searches per trajectory, for algo.llds.answer_adaptive."""
        a, o = self.cfg.algo, self.cfg.optim
        n_mini = self.cfg.data.train_batch_size // a.ppo_mini_batch_size
        sums: dict[str, float] = {}

        def run(role, loss_fn, prefix, **kw):
            for epoch in range(a.ppo_epochs):
                for mini in split_mini_batches(len(seqs), n_mini, seed=self.step_seed() + epoch):
                    m = role.update(make_micro_batches([seqs[i] for i in mini], o.max_tokens_per_micro_batch),
                                    loss_fn, **kw)
                    for k, v in m.items():
                        sums[f"{prefix}/{k}"] = sums.get(f"{prefix}/{k}", 0.0) + float(v)

        if self.critic is not None:
            run(self.critic, losses.critic_loss_fn(a), "critic")
            self.critic.step_schedule()
        if self.step_no >= o.critic_warmup:  # verl: the actor updates once critic_warmup <= step (steps from 1)
            t = self.cfg.rollout.temperature
            answer = (algo.llds_answer_weight(a.llds.answer_coef, mean_searches) if a.llds.answer_adaptive
                      else None)
            run(self.policy, losses.actor_loss_fn(a, engine_gap=self.engine_comparable(),
                                                  max_response_length=self.cfg.rollout.max_response_length,
                                                  llds_answer_coef=answer),
                "actor", temperature=t,
                with_entropy=True, entropy_grad=a.entropy_coeff != 0)
            self.policy.step_schedule()
        n_updates = a.ppo_epochs * n_mini
        ratios = losses.ratio_metrics(sums)  # exact totals over every update (removed from sums)
        if a.llds.answer_adaptive and self.step_no >= o.critic_warmup:
            ratios["actor/llds_answer_coef"] = min(answer, a.llds.coef)
        return {**{k: v / n_updates for k, v in sums.items()}, **ratios}

    def step_seed(self) -> int:
        return step_seed(self.cfg.trainer.seed, self.step_no)

    # -- validation ---------------------------------------------------------------------------------------------
    def validate(self) -> dict:
        """Greedy rollouts on the validation rows (split over all engines), EM / sub-EM / F1 per data_source."""
        cfg = self.cfg
        interrupt.note(f"in validation at step {self.step_no}")
        self.worker.sync(self.policy)
        records, samples = self.worker.validate(self.data.val, cfg.data.val_batch_size,
                                                cfg.logging.trajectories_per_step)
        self.worker.sleep()
        return self.record_validation(self.step_no, records, samples)

    def record_validation(self, step: int, records: list, samples: list, where: str = "") -> dict:
        """Summarise validation `records` of `step` and write what a validation leaves: val/* metrics, sampled
        trajectories (val_trajectories.jsonl), and on rank 0 the table (its title ending in `where`) and a line of
        val_report.jsonl. Returns the report."""
        cfg, logger = self.cfg, self.roles.logger
        report = summarize_eval(records, max_error_rate=cfg.retrieval.max_error_rate)
        logger.log(step, {f"val/{k}": v for k, v in report["metrics"].items()})
        logger.trajectories(step, samples, name="val_trajectories.jsonl")
        if self.rank == 0:
            print(format_eval_table(report, title=f"validation at step {step}{where}"), flush=True)
            logger.append("val_report.jsonl", [{"step": step, **report}])
        return report

    # -- checkpoints and export --------------------------------------------------------------------------------
    def _states(self) -> dict[str, RoleState]:
        """The roles a checkpoint holds, under their subdirectory names (the frozen reference is not saved: its
        source directory is, in `extra`)."""
        states = {"actor": self.policy.state()}
        if self.critic is not None:
            states["critic"] = self.critic.state()
        return states

    def save(self) -> None:
        interrupt.note(f"saving the checkpoint of step {self.step_no}")
        states = self._states()
        sampler = self.data.sampler
        extra = {"step": self.step_no, "sampler": sampler.state_dict() if sampler else None,
                 "kl_ctrl": self.roles.kl_ctrl.state_dict(),
                 "ref_source": self.reference.source if self.reference is not None else None}
        save_roles(self.ckpt_root, self.step_no, states, extra, hf_dirs={name: self.policy.hf_dir for name in states},
                   keep_last=self.cfg.trainer.keep_last)
        interrupt.note_checkpoint(step_dir(self.ckpt_root, self.step_no))

    def _resume(self) -> None:
        target = agreed_resume_target(self.cfg.trainer.resume, self.ckpt_root,  # rank 0 decides for every node
                                      keep_last=self.cfg.trainer.keep_last, check_room=not self.cfg.trainer.val_only)
        if target is None:
            return
        root, step = target
        self.load(root, step)
        self.roles.logger.resume_at(self.step_no)  # rows a killed run logged after this checkpoint go
        if self.rank == 0:
            ref = self.reference
            note = f", reference {ref.source}" if ref is not None else ""
            print(f"resumed from {root} at step {self.step_no}{note}", flush=True)

    def load(self, root: str, step: int) -> None:
        """Put the trainer in the state its checkpoint `step` under `root` holds (weights, optimizer, LR schedule,
        RNG, step number, data order, KL coefficient, the pinned reference). The logs are left alone (`_resume`
        trims them) and so is the rollout engine: a running trainer that goes back to an earlier step this way
        calls `worker.mark_stale()` after it, so that the next sync sends the loaded weights."""
        extra = load_roles(root, step, self._states())
        self.step_no = int(extra["step"])
        interrupt.note_checkpoint(step_dir(root, step))
        if self.data.sampler is not None and extra.get("sampler"):
            self.data.sampler.load_state_dict(extra["sampler"])
        self.roles.kl_ctrl.load_state_dict(extra["kl_ctrl"])
        ref = self.reference
        pinned = extra.get("ref_source")  # the reference this run started with, not today's latest of its root
        if ref is not None and pinned and pinned != ref.source:
            ref.load_weights(pinned)

    def export(self, out_dir: str) -> None:
        self.policy.export_hf(out_dir)
        if self.rank == 0:
            print(f"exported the actor as a Hugging Face model to {out_dir}", flush=True)

    def reward_metrics(self, trajs: list, scores: list) -> dict:
        """Reward and EM overall and per data source, over the whole batch: the DP ranks hold different data
        sources, so their records are gathered (the metrics then have the same keys and values on every rank)."""
        mine = [(tr.meta["data_source"], sc["score"], sc["em"]) for tr, sc in zip(trajs, scores)]
        parts: list = [None] * self.roles.dp_size
        dist.all_gather_object(parts, mine, group=mpu.get_data_parallel_group())
        return reward_table([x for part in parts for x in part])

    def write_samples(self, trajs: list, scores: list) -> None:
        k = self.cfg.logging.trajectories_per_step
        if k and self.rank == 0:
            self.roles.logger.trajectories(self.step_no, sample_records(self.roles.tokenizer, trajs, scores, k))

    def close(self) -> None:
        self.roles.close()
