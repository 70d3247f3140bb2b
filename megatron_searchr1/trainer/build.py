"""Everything an RL run builds from its config, as role objects, so trainer/rl.py can read as the algorithm.

    roles = build_roles(cfg)    # every rank: Megatron groups, policy / reference / critic, rollout worker, data
    roles.policy, roles.reference, roles.critic, roles.worker, roles.data, roles.logger, roles.kl_ctrl
    roles.close()

Models: the actor starts from `model.megatron_ckpt` (e.g. the SFT stage's actor) when given, else from the HF
weights in `model.path`; the frozen reference is a copy of the actor's start (only when a KL term is used; with
`model.lora` the actor trains adapters only and the reference is the actor with them switched off); the
critic (GAE only) starts its trunk from `model.critic_path` or the actor's start with a zero value head.
The engine is built on `model.path` (config + tokenizer; vLLM loads its weights, then the first weight sync
overwrites them with the actor's). With `rollout.engine_tp = 1` every rank runs its own engine. Under
`parallel.rollout_placement=disaggregated` these are the trainer ranks' roles: no engine, no retrieval client
(`roles.worker` is None until trainer/async_rl.py sets a RemoteRollout); the rollout ranks build their engines
with `engine_kwargs`.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from transformers import AutoTokenizer

from megatron_searchr1.algo import AdaptiveKLController, FixedKLController
from megatron_searchr1.checkpoint import CheckpointError, check_shared_dir
from megatron_searchr1.cli import UsageError
from megatron_searchr1.config import Config
from megatron_searchr1.data.rl_data import PromptSampler, load_prompts
from megatron_searchr1.megatron.initialize import initialize_megatron
from megatron_searchr1.megatron.offload import GenerationOffload
from megatron_searchr1.megatron.optimizer import build_optimizer
from megatron_searchr1.metrics import RunLogger
from megatron_searchr1.models.convert import DTYPES, bind_mapping, load_hf_config
from megatron_searchr1.models.hf_files import TOKENIZER_FILES
from megatron_searchr1.models.forward import unwrap
from megatron_searchr1.models.families import read_dims
from megatron_searchr1.models.config import default_expert_tp
from megatron_searchr1.models.gpt import model_settings
from megatron_searchr1.models.lora import apply_lora
from megatron_searchr1.rollout.engines import make_engine
from megatron_searchr1.search.client import RetrievalClient
from megatron_searchr1.search.launch import ServerProcess
from megatron_searchr1.trainer.roles import (AdaptersOffReference, Critic, Policy, RolloutWorker, build_actor,
                                             build_critic, build_reference)
from megatron_searchr1.trainer.sources import pin_model_source, stop_token_ids, weights_loader


@dataclass
class Data:
    """The prompts of an RL run: training rows (with their sampler) and validation rows."""

    train: list
    val: list
    sampler: Optional[PromptSampler]


@dataclass
class Roles:
    """What `build_roles` returns: the roles, the data and the run's bookkeeping."""

    cfg: Config
    tokenizer: Any
    policy: Policy
    reference: Optional[Policy]
    """The frozen reference: a Policy, or under LoRA an AdaptersOffReference (the actor with adapters off)."""
    critic: Optional[Critic]
    worker: Optional[RolloutWorker]
    """This rank's engine driver; None on the trainer ranks of a disaggregated run until async_rl sets its own."""
    data: Data
    logger: RunLogger
    kl_ctrl: Any
    rank: int
    dp_rank: int
    dp_size: int

    def close(self) -> None:
        if self.logger is not None:
            self.logger.close()
        if self.worker is not None:
            self.worker.close()


def build_optimizer_from_config(model, optim, total_steps: int, lr: float):
    """(optimizer, scheduler) of a trainable model from config.optim: the one place the actor, the critic and the
    SFT model get theirs. Megatron's warmup starts at LR 0: the schedule is stepped once here, so step k of the
    run trains at k/warmup * lr, not at 0 in its first step."""
    warmup = int(optim.warmup_steps_ratio * total_steps)
    optimizer, scheduler = build_optimizer(model, lr=lr, min_lr=lr * optim.min_lr_ratio,
                                           weight_decay=optim.weight_decay, adam_betas=tuple(optim.betas),
                                           clip_grad=optim.clip_grad, warmup_steps=warmup,
                                           decay_steps=max(total_steps, warmup + 1), decay_style=optim.lr_decay)
    if warmup:
        scheduler.step(1)
    return optimizer, scheduler


def expert_tp_for(cfg, hf_config) -> Optional[int]:
    """The expert tensor-parallel size Megatron's groups are made with: parallel.expert_tp (null: 1) for an MoE model
    (models/config.default_expert_tp, the rule its layers are built by); None for a dense one (Megatron's default)."""
    dims = read_dims(hf_config)
    return default_expert_tp(dims, cfg.parallel.tp, cfg.parallel.expert_tp) if dims.moe is not None else None


def actor_settings(cfg, hf_config, dtype: torch.dtype) -> dict:
    """model_settings for the RL and SFT models from the run's config (model.use_te, model.recompute,
    parallel.*), with what this model cannot do under that config refused as a UsageError (one `error:` line on
    the command line): LoRA on a mixture-of-experts model (the experts' linears carry no adapters), an MoE model
    under TP without sequence parallelism. LoRA wraps the local spec only, so it turns Transformer Engine off."""
    lora = cfg.model.lora
    if lora.enabled and read_dims(hf_config).moe is not None:
        raise UsageError(f"model.lora: {cfg.model.path} is a mixture-of-experts model and LoRA adapts dense "
                         "decoder linears only: set model.lora.rank=0 (full fine-tuning)")
    p = cfg.parallel
    try:
        return model_settings(hf_config, tp=p.tp, pp=p.pp, params_dtype=dtype,
                              use_te=False if lora.enabled else cfg.model.use_te,
                              sequence_parallel=p.sequence_parallel, recompute=cfg.model.recompute, ep=p.ep,
                              expert_tp=p.expert_tp)
    except ValueError as e:
        raise UsageError(str(e)) from None


def launch_server(cfg: Config):
    """One retrieval server per node, started by the rank of the default world with the lowest local rank on that
    node (local rank 0 when every rank is a client; in the disaggregated placement the rollout ranks' world, whose
    lowest local rank on a node need not be 0); every rank gets its node's URL. Returns (the server this rank
    started or None, the URL)."""
    host, local_rank = socket.gethostname(), int(os.environ.get("LOCAL_RANK", "0"))
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, (host, local_rank))
    server, url = None, None
    if local_rank == min(lr for h, lr in ranks if h == host):
        server = ServerProcess(list(cfg.retrieval.server_args), start_timeout=cfg.retrieval.launch_timeout,
                               timeout_hint="raise retrieval.launch_timeout").start()
        url = server.url
    urls = [None] * dist.get_world_size()
    dist.all_gather_object(urls, (host, url))
    mine = [u for h, u in urls if h == host and u]
    return server, mine[0]


def load_tokenizer(path: str, hf_config, chat_template: str = "auto"):
    """The model directory's tokenizer, refused as a UsageError when it cannot drive the model: a directory without
    tokenizer files (transformers then builds a one-token tokenizer and every prompt encodes to nothing), one whose
    ids do not fit the model's vocabulary, or `data.chat_template=always` without a chat template."""
    if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise UsageError(f"model.path={path} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): copy the model's "
                         "tokenizer into it (tokenizer.save_pretrained(path))")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise UsageError(f"the tokenizer in model.path={path} does not load ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}): save the model's tokenizer there again") from None
    vocab = getattr(hf_config, "vocab_size", None)
    if len(tokenizer) < 2:
        raise UsageError(f"the tokenizer in model.path={path} has {len(tokenizer)} token(s): its files are broken or "
                         "incomplete; save the model's tokenizer there again")
    if vocab is not None and len(tokenizer) > vocab:
        raise UsageError(f"the tokenizer in model.path={path} has {len(tokenizer)} tokens but the model's "
                         f"vocab_size is {vocab}: token ids past {vocab - 1} have no embedding row; use the model's own "
                         "tokenizer")
    if chat_template == "always" and not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"data.chat_template=always but the tokenizer in model.path={path} has no chat template: "
                         "set data.chat_template=auto (or never)")
    return tokenizer


def prompt_renderer(cfg: Config, tokenizer):
    """rollout.protocol=tool_calls: the protocol's prompt rendering (the chat template with the tools' schemas); a
    tokenizer whose template cannot carry it is a UsageError. None (render_prompt) for search_r1."""
    if cfg.rollout.protocol != "tool_calls":
        return None
    from megatron_searchr1.rollout.loop import protocol_from_config
    from megatron_searchr1.rollout.protocols import build_protocol

    try:
        return build_protocol(protocol_from_config(cfg.rollout), tokenizer).render_prompt
    except ValueError as e:
        raise UsageError(f"model.path={cfg.model.path}: {e}") from None


def load_data(cfg: Config, tokenizer, log: bool = True) -> Data:
    """The run's prompts, tokenized, with one line per file (rows, dropped for length, used) when `log`; a run left
    with no usable training prompt, or too few for one batch, is a UsageError naming the field to change."""
    d, t = cfg.data, cfg.trainer
    train_data, val_data, reports = [], [], {"data.train_files": [], "data.val_files": []}
    render = prompt_renderer(cfg, tokenizer)
    if d.train_files and not t.val_only:
        train_data, _ = load_prompts(d.train_files, tokenizer, d.max_prompt_length, d.chat_template,
                                     reports=reports["data.train_files"], render=render)
    if d.val_files:
        val_data, _ = load_prompts(d.val_files, tokenizer, d.max_prompt_length, d.chat_template,
                                   limit=d.val_max_samples, reports=reports["data.val_files"], render=render)
    for (what, files), rows in zip(reports.items(), (train_data, val_data)):
        if log:
            for report in files:
                print(report.line(), flush=True)
        if files and not rows:
            longest = max(report.longest for report in files)
            raise UsageError(f"{what}: no usable prompt: all are longer than data.max_prompt_length="
                             f"{d.max_prompt_length} tokens (the longest has {longest}); raise data.max_prompt_length")
    sampler = None
    if train_data:
        try:
            sampler = PromptSampler(len(train_data), d.train_batch_size, t.seed, d.shuffle)
        except ValueError as e:
            raise UsageError(f"data.train_files: {e}") from None
    return Data(train_data, val_data, sampler)


def engine_kwargs(cfg: Config, rank: int) -> dict:
    """make_engine's keyword arguments for `rank`'s engine (rank: in the world the engines share)."""
    r, t = cfg.rollout, cfg.trainer
    kw: dict = dict(dtype=cfg.model.dtype if r.dtype == "auto" else r.dtype)
    if r.engine == "vllm":
        # one seed per vLLM TP group: its ranks must sample alike (generate() seeds one random stream per call from it)
        # load_format="dummy": random weights at start; the first weight sync (before any generate: RolloutWorker)
        # writes the actor's, so reading the checkpoint here would only cost start-up time and host memory
        kw.update(tensor_parallel_size=r.engine_tp, max_model_len=cfg.data.max_prompt_length + r.max_response_length,
                  seed=t.seed + rank // r.engine_tp, gpu_memory_utilization=r.gpu_memory_utilization,
                  enforce_eager=r.enforce_eager, kv_sessions=None if r.kv_sessions else False, load_format="dummy")
        if cfg.algo.routing_replay:  # record each token's experts for the trainer's replay (vllm_routing.py)
            kw["routing_capture"] = True
        if not torch.cuda.is_available():
            kw["kv_cache_gib"] = r.kv_cache_gib
    return kw


def start_rollout(offload: GenerationOffload, make_engine_fn, make_worker):
    """Build the engine and its RolloutWorker, in verl's order when the opt-in offloads are on: the trainer's
    offloadable state (model.*_offload) leaves the GPU first, because vLLM measures the free GPU memory while it
    builds the engine (and refuses to start when rollout.gpu_memory_utilization of it is not free); then the engine
    sleeps and the state comes back (the first step's sync wakes it), so a resume loads into the state as usual."""
    if offload.enabled:
        offload.before_wake()
        offload.after_sync()
    worker = make_worker(make_engine_fn())
    if offload.enabled:
        worker.sleep()
    return worker


def build_roles(cfg: Config) -> Roles:
    p, o, a, r, t = cfg.parallel, cfg.optim, cfg.algo, cfg.rollout, cfg.trainer
    # tokenizer and data first: a tokenizer-less model directory or prompts that all exceed the budget are one
    # `error:` line in seconds, not a crash after the process groups, the models and the engine are up
    hf_dir = cfg.model.path
    hf_config = load_hf_config(hf_dir)
    tokenizer = load_tokenizer(hf_dir, hf_config, cfg.data.chat_template)
    data = load_data(cfg, tokenizer, log=int(os.environ.get("RANK", "0")) == 0)
    initialize_megatron(tp=p.tp, pp=p.pp, seed=t.seed, timeout_minutes=p.timeout_minutes,
                        sequence_parallel=p.sequence_parallel, ep=p.ep, expert_tp=expert_tp_for(cfg, hf_config))
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_rank, dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    try:  # checkpoints need one directory for all nodes: refuse now, not at the first save or resume
        # with ckpt_root: a crashed save's leftovers go first, so their space is free for the check's marker
        check_shared_dir(t.output_dir, ckpt_root=os.path.join(t.output_dir, "checkpoints"))
    except CheckpointError as e:
        raise UsageError(str(e)) from None

    dtype = DTYPES[cfg.model.dtype]

    # -- models ---------------------------------------------------------------------------------------------
    model_source = pin_model_source(cfg.model.megatron_ckpt or cfg.model.path)
    load_actor = weights_loader(hf_config, model_source)
    lora = cfg.model.lora
    settings = actor_settings(cfg, hf_config, dtype)
    def load_actor_stage(model):  # the base weights, then the adapters (base frozen); DDP and the optimizer follow
        load_actor(model)
        if lora.enabled:
            apply_lora(model, lora.settings())

    actor = build_actor(hf_config, **settings, load_weights=load_actor_stage,
                        use_distributed_optimizer=p.use_distributed_optimizer, tokenizer_vocab_size=len(tokenizer))
    actor_opt, actor_sched = build_optimizer_from_config(actor, o, t.total_steps, o.lr)
    mapping = bind_mapping(hf_config, unwrap(actor))
    policy = Policy(actor, actor_opt, actor_sched, mapping=mapping, hf_config=hf_config, hf_dir=hf_dir, dtype=dtype,
                    source=model_source)
    reference = None
    if (a.use_kl_loss or a.use_kl_in_reward) and lora.enabled:
        reference = AdaptersOffReference(policy)  # verl's ref_in_actor: no second model in memory
    elif a.use_kl_loss or a.use_kl_in_reward:
        reference = Policy(build_reference(hf_config, **settings, load_weights=load_actor,
                                           tokenizer_vocab_size=len(tokenizer)), mapping=mapping,
                           hf_config=hf_config, hf_dir=hf_dir, dtype=dtype, source=model_source)
    if a.routing_replay:  # MoE: the old-log-prob, reference and update forwards replay the engine's experts
        from megatron_searchr1.megatron.routing_replay import enable_routing_replay

        for role in (policy, reference):
            if isinstance(role, Policy):
                enable_routing_replay(role.model)
    critic = None
    if a.uses_critic:
        critic_model = build_critic(hf_config, **settings,
                                    load_weights=weights_loader(hf_config, cfg.model.critic_path
                                                                or cfg.model.megatron_ckpt or cfg.model.path),
                                    use_distributed_optimizer=p.use_distributed_optimizer)
        critic = Critic(critic_model, *build_optimizer_from_config(critic_model, o, t.total_steps, o.critic_lr))

    # -- retrieval and engine ----------------------------------------------------------------------------------
    worker = None  # disaggregated: the trainer ranks hold no engine (trainer/async_rl.py gives them a RemoteRollout)
    if p.rollout_placement == "colocated":
        server, url = None, cfg.retrieval.url
        if cfg.retrieval.launch:
            server, url = launch_server(cfg)
        client = RetrievalClient(url, topk=cfg.retrieval.topk, timeout=cfg.retrieval.timeout,
                                 doc_ids=r.protocol == "tool_calls")  # the open tool takes the ids results carry
        offload = GenerationOffload(cfg.model, actor=actor, actor_opt=actor_opt,
                                    critic=critic.model if critic else None,
                                    critic_opt=critic.optimizer if critic else None,
                                    ref=reference.model if isinstance(reference, Policy) else None)  # LoRA: none
        worker = start_rollout(offload, lambda: make_engine(r.engine, hf_dir, **engine_kwargs(cfg, rank)),
                               lambda engine: RolloutWorker(cfg, engine, tokenizer, client,
                                                            stop_token_ids(tokenizer, hf_dir), rank=rank,
                                                            world=world, offload=offload, server=server))

    kl_ctrl = (AdaptiveKLController(a.kl_coef, a.target_kl, a.kl_horizon) if a.kl_ctrl == "adaptive"
               else FixedKLController(a.kl_coef))
    logger = RunLogger(t.output_dir, enabled=rank == 0, tensorboard=cfg.logging.tensorboard)
    return Roles(cfg=cfg, tokenizer=tokenizer, policy=policy, reference=reference, critic=critic, worker=worker,
                 data=data, logger=logger, kl_ctrl=kl_ctrl, rank=rank,
                 dp_rank=dp_rank, dp_size=dp_size)
