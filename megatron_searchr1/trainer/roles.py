"""The roles of an RL step, each owning its model and the memory it holds: the policy (actor, frozen reference, SFT
model), the critic and the rollout worker, and the builders of their models. Every forward and update goes through
megatron/schedule.py, the one boundary with Megatron's pipeline schedule.

    actor = build_actor(hf_config, load_weights=lambda m: load_hf_weights(m, reader, bind_mapping(hf_config, m)),
                        **model_settings(hf_config, tp=1, pp=1, params_dtype=torch.float32))   # models/gpt.py
    policy = Policy(actor, *build_optimizer(actor, lr=1e-6, clip_grad=1.0), mapping=..., hf_config=hf_config)
    policy.log_probs(seqs, budget, temperature)      # the actor's, or a frozen reference's (build_reference)
    policy.update(micro_batches, loss_fn, ...)       # one optimizer step (loss callbacks: trainer/losses.py)
    policy.export_hf(out_dir)                        # the end of a run: a Hugging Face directory
    critic = Critic(build_critic(hf_config, load_weights=...), *build_optimizer(...))
    critic.values(seqs, budget); critic.update(...)
    policy.state(), critic.state()                   # what a checkpoint keeps (checkpoint.save_roles / load_roles)
    worker.sync(policy); worker.generate(trajs, seed); worker.sleep(); worker.validate(rows, batch_size, n_samples)

`Policy` is also the SFT model. Every rank holds every role (SPMD): the models are Megatron stages, the
`RolloutWorker` drives this rank's engine, which serves a share of its model replica's trajectories
(rollout/engine_groups.py is the rule for which ranks form an engine and which slice of a list each engine runs).
Log-probs are over the real vocabulary (megatron/vocab_parallel.py) and divided by `temperature` first, as the
rollout sampled: pass the rollout's temperature so old log-probs match the engine's.
"""
from __future__ import annotations

import dataclasses
import os
from collections import Counter
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.distributed import DistributedDataParallel

from megatron_searchr1.checkpoint import CheckpointError, RoleState
from megatron_searchr1.megatron import schedule, tree_packing
from megatron_searchr1.megatron.batching import make_micro_batches
from megatron_searchr1.megatron.optimizer import wrap_ddp
from megatron_searchr1.models.convert import DTYPES, write_hf_dir
from megatron_searchr1.models import lora, lora_export
from megatron_searchr1.models.critic import build_critic_model
from megatron_searchr1.models.forward import unwrap
from megatron_searchr1.models.gpt import build_gpt_model
from megatron_searchr1.rollout import loop, weight_sync
from megatron_searchr1.rollout.engine import sleep_engine, wake_and_sync
from megatron_searchr1.rollout.engine_groups import EngineLayout
from megatron_searchr1.rollout.engines import vllm_routing
from megatron_searchr1.rollout.loop import RolloutStats, Trajectory, settings_from_config
from megatron_searchr1.search.client import RetrievalDown, SearchGuard
from megatron_searchr1.trainer import losses, reports, sources

# Calls go through module attributes (schedule.train_step, weight_sync.sync_weights, loop.run_rollout,
# losses.score_trajectories, sources.weights_loader): the tests and the layout sweep replace those functions.

LoadWeights = Optional[Callable[[torch.nn.Module], None]]


def build_actor(hf_config, *, params_dtype: torch.dtype = torch.float32, load_weights: LoadWeights = None,
                use_distributed_optimizer: bool = False, config=None, use_te: Optional[bool] = None,
                tokenizer_vocab_size: Optional[int] = None) -> DistributedDataParallel:
    """This rank's actor stage, weights loaded by `load_weights(bare_model)` (before DDP and the optimizer copy
    them), wrapped in Megatron DDP. bf16 on GPU: params_dtype=torch.bfloat16 (the optimizer keeps fp32 masters).
    `config`, `use_te`: as models.gpt.model_settings makes them (None: build_gpt_model's defaults).
    `tokenizer_vocab_size` (len(tokenizer)): embedding rows past it (a checkpoint's padding) stay out of every
    log-prob's softmax."""
    model = build_gpt_model(hf_config, params_dtype=params_dtype, config=config, use_te=use_te,
                            tokenizer_vocab_size=tokenizer_vocab_size)
    if load_weights is not None:
        load_weights(model)
    return wrap_ddp(model, use_distributed_optimizer=use_distributed_optimizer)


def build_reference(hf_config, *, params_dtype: torch.dtype = torch.float32, load_weights: LoadWeights = None,
                    config=None, use_te: Optional[bool] = None,
                    tokenizer_vocab_size: Optional[int] = None) -> torch.nn.Module:
    """This rank's frozen reference stage: no DDP, no optimizer, no gradients, eval mode (`tokenizer_vocab_size`:
    as build_actor's)."""
    model = build_gpt_model(hf_config, params_dtype=params_dtype, config=config, use_te=use_te,
                            tokenizer_vocab_size=tokenizer_vocab_size)
    if load_weights is not None:
        load_weights(model)
    model.requires_grad_(False)
    return model.eval()


def build_critic(hf_config, *, params_dtype: torch.dtype = torch.float32, load_weights: LoadWeights = None,
                 use_distributed_optimizer: bool = False, config=None, use_te=None) -> DistributedDataParallel:
    """This rank's critic stage (models/critic.py: the actor's trunk, a zero value head), trunk weights loaded by
    `load_weights(bare_model)`, wrapped in Megatron DDP."""
    model = build_critic_model(hf_config, params_dtype=params_dtype, config=config, use_te=use_te)
    if load_weights is not None:
        load_weights(model)
    return wrap_ddp(model, use_distributed_optimizer=use_distributed_optimizer)


def _forward_batches(model, seqs: list, budget: int, pad_id: int, pack_keys: Optional[list]) -> list:
    """Micro-batches for a forward-only pass: one sequence per row, or with `pack_keys` (rollout.tree.pack_forward)
    the sequences of one key (a tree's leaves) packed into one row whose shared prefixes are computed once
    (megatron/tree_packing.py); the results read back per sequence either way."""
    if pack_keys is None:
        return make_micro_batches(seqs, budget, pad_id=pad_id)
    tree_packing.check_packable(model)
    return tree_packing.packed_micro_batches(seqs, pack_keys, budget, pad_id=pad_id)


@dataclasses.dataclass(eq=False)
class Policy:
    """A causal LM on Megatron: the actor (with optimizer and LR schedule), the frozen reference (`optimizer`
    None), or the SFT model. `source` is the directory its weights started from (sources.pin_model_source)."""

    model: Any
    optimizer: Any = None
    scheduler: Any = None
    mapping: Any = None
    hf_config: Any = None
    hf_dir: str = ""
    """Config + tokenizer dir (checkpoints and the HF export copy it)."""
    dtype: torch.dtype = torch.float32
    source: str = ""

    @property
    def frozen(self) -> bool:
        return self.optimizer is None

    def log_probs(self, seqs: list, max_tokens_per_micro_batch: int, temperature: float = 1.0, *,
                  with_entropy: bool = False, pad_id: int = 0, pack_keys: Optional[list] = None):
        """Log-probs of each sequence's response tokens: list[Tensor(len(response_ids))] fp32 on the CPU, in input
        order, the same on every rank of the model-parallel group; (log_probs, entropies) with `with_entropy`.
        `pack_keys` (one tree id per sequence): the leaves of each tree packed into one row (_forward_batches).

        Every rank of the model-parallel group must pass the same `seqs` (its DP rank's share)."""
        mbs = _forward_batches(self.model, seqs, max_tokens_per_micro_batch, pad_id, pack_keys)
        out = schedule.forward_per_sequence(self.model, mbs, temperature=temperature, with_entropy=with_entropy)
        return (out["log_probs"], out["entropy"]) if with_entropy else out["log_probs"]

    def update(self, micro_batches: list, loss_fn, *, step_scheduler: bool = False, **kw) -> dict:
        """One optimizer step over `micro_batches` (megatron/schedule.py). The RL trainer counts its LR schedule in
        RL steps (`step_schedule`); SFT steps it with every optimizer step (`step_scheduler=True`)."""
        return schedule.train_step(self.model, self.optimizer, self.scheduler if step_scheduler else None,
                                   micro_batches, loss_fn, **kw)

    def step_schedule(self) -> None:
        self.scheduler.step(1)

    def state(self) -> RoleState:
        """What a checkpoint keeps of this model (checkpoint.save_roles / load_roles; loading fills it in place)."""
        return RoleState(self.model, self.optimizer, self.scheduler)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def load_weights(self, source: str) -> None:
        """Replace the weights with those of `source` (a step's actor directory or an HF directory): a resumed
        run's reference goes back to the directory its checkpoints recorded."""
        if not os.path.exists(source):
            raise CheckpointError(f"the reference model this run was started with, {source}, is gone (pruned by "
                                  "that run's trainer.keep_last?): restore it, or start a new run")
        sources.weights_loader(self.hf_config, source)(unwrap(self.model))
        self.source = source

    def export_hf(self, out_dir: str) -> None:
        """Every rank calls it: the model as a Hugging Face directory that `transformers` and vLLM load. The gather
        path is the checkpoint converter's (models/convert.py `write_hf_dir`: TP shards all-gathered, names mapped
        by the family, padded vocabulary trimmed, one file per pipeline stage; the writing ranks fill `out_dir`),
        with the config and tokenizer files of `hf_dir`. A LoRA actor is written merged (W + scale * B A), its
        PEFT adapter alongside in `<out_dir>_adapter`."""
        if lora.has_lora(self.model):
            lora_export.export_merged_hf(self.model, self.hf_config, self.hf_dir, out_dir, dtype=self.dtype)
            lora_export.write_peft_adapter(self.model, out_dir.rstrip("/") + "_adapter",
                                           base_model_name_or_path=self.source)
            return
        write_hf_dir(unwrap(self.model), self.mapping, self.hf_dir, out_dir, self.dtype)


@dataclasses.dataclass(eq=False)
class AdaptersOffReference:
    """LoRA RL's reference policy: the actor's own model with its adapters switched off, i.e. the frozen base it
    started from (verl's `ref_in_actor`: no second model in memory, nothing to offload). Reads as a frozen Policy
    to the trainer: `log_probs`, `source`, `load_weights`."""

    policy: Policy

    @property
    def source(self) -> str:
        return self.policy.source

    def log_probs(self, seqs: list, max_tokens_per_micro_batch: int, temperature: float = 1.0, **kw):
        with lora.disable_adapters(self.policy.model):
            return self.policy.log_probs(seqs, max_tokens_per_micro_batch, temperature, **kw)

    def load_weights(self, source: str) -> None:
        """The base is the actor's start, read again from `model.megatron_ckpt` / `model.path` when a run resumes;
        refused when that now names other weights than the run started from (the KL term would change anchor)."""
        if source != self.source:
            raise CheckpointError(f"this LoRA run's base (and reference) was {source}, but the model source now "
                                  f"resolves to {self.source}: set model.megatron_ckpt={source} to resume it")


@dataclasses.dataclass(eq=False)
class Critic:
    """The value model (GAE): a causal-LM trunk with a scalar head (build_critic), its optimizer and LR schedule.

    The value of response token j is the critic's output at position prompt_len + j - 1, the state just before
    token j is generated (verl's values[:, prompt_len - 1 : -1], megatron/outputs.py); GAE then uses values[j + 1]
    as the next state's value."""

    model: Any
    optimizer: Any = None
    scheduler: Any = None

    def values(self, seqs: list, max_tokens_per_micro_batch: int, *, pad_id: int = 0,
               pack_keys: Optional[list] = None) -> list:
        """Values per response token: list[Tensor(len(response_ids))] fp32 on the CPU, in input order, the same on
        every rank of the model-parallel group (which must all pass the same `seqs`); `pack_keys` as log_probs'."""
        mbs = _forward_batches(self.model, seqs, max_tokens_per_micro_batch, pad_id, pack_keys)
        return schedule.forward_per_sequence(self.model, mbs)["values"]

    def update(self, micro_batches: list, loss_fn, **kw) -> dict:
        return schedule.train_step(self.model, self.optimizer, None, micro_batches, loss_fn, **kw)

    def step_schedule(self) -> None:
        self.scheduler.step(1)

    def state(self) -> RoleState:
        """What a checkpoint keeps of the critic (checkpoint.save_roles / load_roles; loading fills it in place)."""
        return RoleState(self.model, self.optimizer, self.scheduler)


class RolloutWorker:
    """This rank's engine, its retrieval client and the loop settings (built once from config.rollout), with the
    engine's wake / sync / sleep choreography and the sharding of trajectories over the engines.

    Searches: the ranks of one vLLM engine (rollout.engine_tp > 1) must feed it identical prompts, so only the
    engine's first rank asks the server and broadcasts the observations over a gloo group of the engine's ranks
    (`search`): one request per search, one outcome per engine. A `SearchGuard` counts the failures; at the end of
    every step and validation all ranks compare the counts (`_check_retrieval`) and raise RetrievalDown together
    when the run must stop, so no rank is left waiting in a collective."""

    def __init__(self, cfg, engine, tokenizer, client, stop_token_ids: tuple[int, ...], *, rank: int, world: int,
                 offload=None, server=None):
        r = cfg.rollout
        self.cfg, self.engine, self.tokenizer, self.client, self.server = cfg, engine, tokenizer, client, server
        self.rank, self.world, self.offload = rank, world, offload
        self.layout = EngineLayout(world, cfg.parallel.tp, cfg.parallel.pp, r.engine_tp)
        q = cfg.retrieval
        url = getattr(client, "base_url", q.url)  # a launched server's URL on every rank
        self.train_settings, self.val_settings = settings_from_config(r, stop_token_ids, cfg.trainer.seed,
                                                                      tools_url=url)
        self.sync_dtype = DTYPES[cfg.model.dtype if r.dtype == "auto" else r.dtype]
        # through `self.client` at call time: tests replace the client or its search after construction
        self.guard = SearchGuard(lambda queries: self.client.search(queries), url, q.max_error_rate,
                                 q.max_failed_rounds)
        self.search_leader = self.layout.groups[self.layout.group_of(rank)][0]
        self.search_group = None
        if r.engine_tp > 1 and dist.is_initialized():
            # new_group is collective over the world: every rank creates every engine's group, in the same order.
            # gloo: observations are host strings, whatever backend the trainer's groups use.
            for ranks in self.layout.groups:
                pg = dist.new_group(ranks, backend="gloo")
                if rank in ranks:
                    self.search_group = pg
        self.searcher = EngineSearcher(self)  # what the loop searches and calls tools through
        self.synced = False  # the engine holds the actor's current weights
        self.asleep = False

    # -- wake / sync / sleep ----------------------------------------------------------------------------------
    def sync(self, policy: Policy) -> dict:
        """Wake the engine with the policy's current weights (every rank takes part; with engine_tp = 1 every rank
        feeds its own engine), in verl's order (rollout/engine.py wake_and_sync): weights, sync, then KV cache.
        The opt-in offloads (model.*_offload, megatron/offload.py) free the trainer's memory around it."""
        r = self.cfg.rollout
        if self.synced and not self.asleep:
            return {}

        def sync():
            return weight_sync.sync_weights(policy.model, self.engine, policy.mapping,
                                            bucket_bytes=r.sync_bucket_mb << 20, dtype=self.sync_dtype)

        if self.offload is not None:
            self.offload.before_wake()
        stats = wake_and_sync(self.engine, None if self.synced else sync,
                              after_sync=self.offload.after_sync if self.offload is not None else None)
        self.synced, self.asleep = True, False
        return stats.as_dict() if stats is not None else {}

    def mark_stale(self) -> None:
        """The policy was updated: the next `sync` sends its weights."""
        self.synced = False

    def sleep(self) -> None:
        """Engine asleep at rollout.sleep_level (level 2 drops its weights: the next wake-up syncs them), then the
        offloaded trainer memory back."""
        r = self.cfg.rollout
        if r.sleep_between_steps and not self.asleep:
            if sleep_engine(self.engine, r.sleep_level):
                self.synced = False
            self.asleep = True
        if self.offload is not None:
            self.offload.reload()

    # -- rollouts -----------------------------------------------------------------------------------------------
    @staticmethod
    def make_trajectories(rows: list, n: int) -> list[Trajectory]:
        """Each prompt row repeated `n` times under its group id (`uid`)."""
        return [Trajectory(prompt_ids=list(row.prompt_ids), uid=row.uid, sample=k,
                           meta={"data_source": row.data_source, "ground_truth": row.ground_truth,
                                 "question": row.question, "split": row.extra.get("split", "")})
                for row in rows for k in range(n)]

    def generate(self, trajs: list, seed: int) -> tuple[list, dict]:
        """Run the search loop. The tp*pp ranks of a DP rank hold the same trajectories: each of their engines
        runs its shard (rollout/engine_groups.py, scope "replica"), and the finished shards are exchanged so every
        rank returns all of them, in order. The engine must be awake (`sync`)."""
        if self.cfg.rollout.tree.enabled:
            return self._generate_trees(trajs, seed)
        shard = self.layout.shard(self.rank, "replica")
        mine = shard.take(trajs)
        # one seed per engine: DP ranks and shards draw different noise
        settings = dataclasses.replace(self.train_settings, seed=self.layout.sampling_seed(seed, self.rank))
        stats = loop.run_rollout(self.engine, self.tokenizer, self.searcher, mine, settings)
        unrecorded = vllm_routing.attach(self.engine, mine) if self.cfg.algo.routing_replay else None
        metrics = stats.as_metrics(mine)
        group = mpu.get_model_parallel_group()
        if dist.get_world_size(group) > 1:
            trajs = self._exchange(shard, mine, group)
            # the counters in `stats` are this engine's shard: finish reasons are recounted over all trajectories
            everything = RolloutStats(finish=Counter(tr.finish_reason for tr in trajs))
            metrics = {**everything.as_metrics(trajs), "time/generate": metrics["time/generate"],
                       "time/search": metrics["time/search"],
                       "rollout/computed_tokens": metrics["rollout/computed_tokens"]}
        failed, searched = self._check_retrieval("a training step")
        metrics["rollout/search_error_rate"] = failed / max(searched, 1)  # the whole step's, the same on every rank
        if unrecorded is not None:  # routing replay: tokens before a sampled one that have no engine experts (0 = all)
            metrics["rollout/routing_unrecorded"] = unrecorded[0] / max(unrecorded[1], 1)
        return trajs, metrics

    def _generate_trees(self, trajs: list, seed: int) -> tuple[list, dict]:
        """rollout.tree: the first rollout.tree.trees samples of each prompt are roots (`trajs` holds rollout.n per
        prompt); each engine grows the trees of its share of the roots (rollout/tree.py) and the trees are exchanged
        whole, so every rank returns each prompt's rollout.n leaves, tree by tree."""
        from megatron_searchr1.rollout import tree as tree_rollout

        c = self.cfg.rollout.tree
        roots = [t for t in trajs if t.sample < c.trees]
        shard = self.layout.shard(self.rank, "replica")
        settings = dataclasses.replace(self.train_settings, seed=self.layout.sampling_seed(seed, self.rank))
        trees, stats = tree_rollout.grow_trees(
            self.engine, self.tokenizer, self.searcher, shard.take(roots), settings,
            tree_rollout.TreeSettings(c.rounds, c.samples, c.select, c.max_leaves))
        mine = [t for tr in trees for t in tr]
        metrics = {**stats.as_metrics(mine), **tree_rollout.tree_metrics(trees)}
        group = mpu.get_model_parallel_group()
        if dist.get_world_size(group) > 1:
            trees = self._exchange(shard, trees, group)
            everything = [t for tr in trees for t in tr]
            metrics.update({k: v for k, v in RolloutStats(finish=Counter(t.finish_reason for t in everything))
                            .as_metrics(everything).items() if k not in ("time/generate", "time/search",
                                                                          "rollout/computed_tokens")})
            metrics.update(tree_rollout.tree_metrics(trees))
        failed, searched = self._check_retrieval("a training step")
        metrics["rollout/search_error_rate"] = failed / max(searched, 1)
        return [t for tr in trees for t in tr], metrics

    def validate(self, rows: list, batch_size: int, n_samples: int) -> tuple[list[dict], list[dict]]:
        """Greedy rollouts of the validation rows -> (every engine's records, in row order; this rank's first
        samples). Every rank holds all rows: they are split over all engines (scope "world"), the same rule as
        training's."""
        shard = self.layout.shard(self.rank, "world")
        records, samples = [], []
        mine = shard.take(rows)
        judge_down = None  # reward=judge: a judge failure on any rank stops every rank, after the loop (the shards
        for start in range(0, len(mine), batch_size):  # may differ in batches, so no collective inside it)
            trajs = self.make_trajectories(mine[start:start + batch_size], 1)
            loop.run_rollout(self.engine, self.tokenizer, self.searcher, trajs, self.val_settings)
            try:
                scores = losses.score_trajectories(trajs, self.tokenizer, self.cfg.algo)
            except RetrievalDown as e:  # JudgeDown
                judge_down = e
                break
            for tr, sc in zip(trajs, scores):
                if len(samples) < n_samples:
                    samples.append(reports.eval_sample(self.tokenizer, tr, sc))
                records.append(reports.eval_record(tr, sc))
        if self.cfg.algo.reward == "judge" and losses.any_rank(judge_down is not None):
            from megatron_searchr1.reward.judge import JudgeDown

            raise judge_down or JudgeDown(self.cfg.algo.judge_url, 0, 0, "the judge failed on another rank")
        records = self._exchange(shard, records, group=None)
        try:
            self._check_retrieval("validation")
        except RetrievalDown as e:
            if self.rank == 0:  # what was measured, marked invalid: never an EM table over failed searches
                report = reports.summarize_eval(records, max_error_rate=self.guard.max_error_rate)
                if not report.get("invalid"):  # the circuit breaker stopped it below the rate
                    report.update(metrics={}, invalid=f"{e.failed} of {e.searched} searches failed, "
                                                      f"{self.guard.verdict(0, 0, True)}")
                print(reports.format_eval_table(report, title="validation"), flush=True)
            raise
        return records, samples

    # -- searches -----------------------------------------------------------------------------------------------
    def search(self, queries: list[str]) -> list[str]:
        """The loop's searcher: observations for `queries`, the same on every rank of this engine. The engine's
        first rank asks the server (through the guard); the others receive its results."""
        if self.search_group is None:
            return self.guard(queries)
        box = [self.guard(queries) if self.rank == self.search_leader else None]
        dist.broadcast_object_list(box, src=self.search_leader, group=self.search_group)
        if len(box[0]) != len(queries):
            raise RuntimeError(f"rank {self.rank} asked {len(queries)} queries but its engine's first rank "
                               f"{self.search_leader} searched {len(box[0])}: the engine's ranks diverged")
        return box[0]

    def run_once(self, fn):
        """fn() on this engine's first rank, its result on every rank of the engine (the loop's non-search tools:
        each rank of an engine runs the same trajectories, and a tool with side effects or a cost must be called once
        per engine, as a search is)."""
        if self.search_group is None:
            return fn()
        box = [fn() if self.rank == self.search_leader else None]
        dist.broadcast_object_list(box, src=self.search_leader, group=self.search_group)
        return box[0]

    def _check_retrieval(self, where: str) -> tuple[int, int]:
        """Every rank's failure counts since the last check, summed (each search counted once: only engines'
        first ranks search); raises RetrievalDown on every rank together when the run must stop."""
        mine = self.guard.take()
        counts = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            counts = [None] * dist.get_world_size()
            dist.all_gather_object(counts, mine)
        failed, searched = sum(c[0] for c in counts), sum(c[1] for c in counts)
        opened = any(c[2] for c in counts)
        last = next((c[3] for c in counts if c[3]), "")
        self.guard.down(failed, searched, opened, last, where)
        return failed, searched

    def _exchange(self, shard, results: list, group) -> list:
        """Every engine's results in list order: each engine's first rank hands in (shard index, its results), the
        ranks of `group` (those that split the list; None: all ranks) gather them."""
        parts: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, (shard.index, results) if shard.contributes else None, group=group)
        return shard.merge(dict(part for part in parts if part is not None))

    def close(self) -> None:
        if hasattr(self.engine, "close"):
            self.engine.close()
        if self.client is not None:
            self.client.close()
        if self.server is not None:
            self.server.stop()


class EngineSearcher:
    """The loop's searcher for one rank of an engine: `searcher(queries)` is RolloutWorker.search and
    `searcher.once(fn)` RolloutWorker.run_once (rollout/protocols/tools.py ToolBox.run calls the other tools in
    it)."""

    def __init__(self, worker):
        self.worker = worker

    def __call__(self, queries: list[str]) -> list[str]:
        return self.worker.search(queries)

    def once(self, fn):
        return self.worker.run_once(fn)
