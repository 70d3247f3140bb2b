"""Everything an RL run builds from its config, in one place, so train.py can read as the algorithm.

    rt = build_runtime(cfg)     # every rank: Megatron groups, models + optimizers, engine, data, client, logger
    rt.actor, rt.actor_opt, rt.ref, rt.critic, rt.engine, rt.client, rt.train_data, rt.sampler, rt.logger ...
    rt.close()

Models: the actor starts from `model.megatron_ckpt` (e.g. the SFT stage's actor) when given, else from the HF
weights in `model.path`; the frozen reference is a copy of the actor's start (only when a KL term is used); the
critic (GAE only) starts its trunk from `model.critic_path` or the actor's start with a zero value head.
The engine is built on `model.path` (config + tokenizer; vLLM loads its weights, then the first weight sync
overwrites them with the actor's). With `rollout.engine_tp = 1` every rank runs its own engine.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from megatron_searchr1.config import Config
from megatron_searchr1.models.convert import DTYPES  # noqa: F401 (train.py and sft.py read it here)



@dataclass
class Runtime:
    cfg: Config
    tokenizer: Any
    hf_config: Any
    mapping: Any
    actor: Any
    actor_opt: Any
    actor_sched: Any
    ref: Optional[Any]
    critic: Optional[Any]
    critic_opt: Optional[Any]
    critic_sched: Optional[Any]
    engine: Any
    client: Any
    train_data: list
    val_data: list
    sampler: Optional[Any]
    logger: Any
    kl_ctrl: Any
    rank: int
    world: int
    dp_rank: int
    dp_size: int
    stop_token_ids: tuple[int, ...]
    server: Optional[Any] = None
    notes: dict = field(default_factory=dict)
    model_source: str = ""
    """The concrete weights the actor started from and the reference holds (pin_model_source)."""

    @property
    def hf_dir(self) -> str:
        """Config + tokenizer dir of the actor (checkpoints and the HF export copy it)."""
        return self.cfg.model.path

    def close(self) -> None:
        if self.logger is not None:
            self.logger.close()
        if hasattr(self.engine, "close"):
            self.engine.close()
        if self.client is not None:
            self.client.close()
        if self.server is not None:
            self.server.stop()


def _weights_loader(cfg: Config, hf_config, source: Optional[str]):
    """`load(bare_model)` from a converted Megatron checkpoint dir or an HF dir (critic value heads stay zero)."""
    from megatron_searchr1.models.convert import (
        SafetensorsReader, bind_mapping, load_hf_weights, load_megatron_checkpoint,
    )

    source = resolve_model_source(source or cfg.model.megatron_ckpt or cfg.model.path)
    if os.path.isfile(os.path.join(source, "metadata.json")):
        return lambda m: load_megatron_checkpoint(m, source)
    reader = SafetensorsReader(source)
    return lambda m: load_hf_weights(m, reader, bind_mapping(hf_config, m))


def resolve_model_source(path: str) -> str:
    """A training run's checkpoint root (it has `latest`) means its latest actor: `<root>/step_N/actor`; one step
    directory (`<root>/step_N`) means that step's actor."""
    from megatron_searchr1.checkpoint import latest_step, step_dir

    if os.path.isfile(os.path.join(path, "actor", "metadata.json")):
        return os.path.join(path, "actor")
    for root in (path, os.path.join(path, "checkpoints")):
        if os.path.isfile(os.path.join(root, "latest")):
            step = latest_step(root)
            if step is not None:
                return os.path.join(step_dir(root, step), "actor")
    return path


def pin_model_source(path: str) -> str:
    """`resolve_model_source` once, decided on rank 0 for every rank: a run root means its latest step, which moves
    while that run trains on (and two nodes could read different `latest` files). The actor's start and the frozen
    reference use this one step directory; the trainer records it in its checkpoints and, on resume, reloads the
    reference from the recorded one (`load_reference`), so the KL term keeps one anchor across restarts."""
    import torch.distributed as dist

    several = dist.is_initialized() and dist.get_world_size() > 1
    source = resolve_model_source(path) if not several or dist.get_rank() == 0 else None
    if source is not None and os.path.exists(source):
        source = os.path.abspath(source)
    box = [source]
    if several:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def load_reference(rt: "Runtime", source: str) -> None:
    """Load the reference model's weights from `source` (a step's actor directory or an HF directory)."""
    from megatron_searchr1.checkpoint import CheckpointError
    from megatron_searchr1.models.forward import unwrap

    if not os.path.exists(source):
        raise CheckpointError(f"the reference model this run was started with, {source}, is gone (pruned by that "
                              "run's trainer.keep_last?): restore it, or start a new run")
    _weights_loader(rt.cfg, rt.hf_config, source)(unwrap(rt.ref))
    rt.model_source = source


def _launch_server(cfg: Config):
    """One retrieval server per node (local rank 0 starts it); every rank gets its node's URL."""
    import torch.distributed as dist

    from megatron_searchr1.search.launch import ServerProcess

    server, url = None, None
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        server = ServerProcess(list(cfg.retrieval.server_args), start_timeout=cfg.retrieval.launch_timeout,
                               timeout_hint="raise retrieval.launch_timeout").start()
        url = server.url
    urls = [None] * dist.get_world_size()
    dist.all_gather_object(urls, (socket.gethostname(), url))
    mine = [u for host, u in urls if host == socket.gethostname() and u]
    return server, mine[0]


def build_runtime(cfg: Config) -> Runtime:
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from transformers import AutoTokenizer

    from megatron_searchr1.algo import AdaptiveKLController, FixedKLController
    from megatron_searchr1.checkpoint import CheckpointError, check_shared_dir
    from megatron_searchr1.cli import UsageError
    from megatron_searchr1.data.rl_data import PromptSampler, load_prompts
    from megatron_searchr1.megatron.initialize import initialize_megatron
    from megatron_searchr1.megatron.optimizer import build_optimizer
    from megatron_searchr1.metrics import RunLogger
    from megatron_searchr1.models.convert import bind_mapping, load_hf_config
    from megatron_searchr1.models.gpt import model_settings
    from megatron_searchr1.rollout.engines import make_engine
    from megatron_searchr1.search.client import RetrievalClient
    from megatron_searchr1.workers.actor import build_actor, build_reference
    from megatron_searchr1.workers.critic import build_critic

    p, o, a, r, t = cfg.parallel, cfg.optim, cfg.algo, cfg.rollout, cfg.trainer
    initialize_megatron(tp=p.tp, pp=p.pp, seed=t.seed, timeout_minutes=p.timeout_minutes,
                        sequence_parallel=p.sequence_parallel)
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_rank, dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    try:  # checkpoints need one directory for all nodes: refuse now, not at the first save or resume
        check_shared_dir(t.output_dir)
    except CheckpointError as e:
        raise UsageError(str(e)) from None

    hf_dir = cfg.model.path
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    hf_config = load_hf_config(hf_dir)
    dtype = DTYPES[cfg.model.dtype]

    # -- models ---------------------------------------------------------------------------------------------
    model_source = pin_model_source(cfg.model.megatron_ckpt or cfg.model.path)
    load_actor = _weights_loader(cfg, hf_config, model_source)
    settings = model_settings(hf_config, tp=p.tp, pp=p.pp, params_dtype=dtype, use_te=cfg.model.use_te,
                              sequence_parallel=p.sequence_parallel, recompute=cfg.model.recompute)
    actor = build_actor(hf_config, **settings, load_weights=load_actor,
                        use_distributed_optimizer=p.use_distributed_optimizer)
    warmup = int(o.warmup_steps_ratio * t.total_steps)
    decay = max(t.total_steps, warmup + 1)
    actor_opt, actor_sched = build_optimizer(actor, lr=o.lr, min_lr=o.lr * o.min_lr_ratio,
                                             weight_decay=o.weight_decay, adam_betas=tuple(o.betas),
                                             clip_grad=o.clip_grad, warmup_steps=warmup, decay_steps=decay,
                                             decay_style=o.lr_decay)
    if warmup:  # Megatron's warmup starts at LR 0: step once so RL step k trains at k/warmup * lr, not 0 at step 1
        actor_sched.step(1)
    ref = None
    if a.use_kl_loss or a.use_kl_in_reward:
        ref = build_reference(hf_config, **settings, load_weights=load_actor)
    critic = critic_opt = critic_sched = None
    if a.uses_critic:
        critic = build_critic(hf_config, **settings,
                              load_weights=_weights_loader(cfg, hf_config, cfg.model.critic_path),
                              use_distributed_optimizer=p.use_distributed_optimizer)
        critic_opt, critic_sched = build_optimizer(critic, lr=o.critic_lr, min_lr=o.critic_lr * o.min_lr_ratio,
                                                   weight_decay=o.weight_decay, adam_betas=tuple(o.betas),
                                                   clip_grad=o.clip_grad, warmup_steps=warmup, decay_steps=decay,
                                                   decay_style=o.lr_decay)
        if warmup:
            critic_sched.step(1)
    mapping = bind_mapping(hf_config, actor.module if hasattr(actor, "module") else actor)

    # -- data ------------------------------------------------------------------------------------------------
    d = cfg.data
    train_data, dropped = ([], 0)
    if d.train_files and not t.val_only:
        train_data, dropped = load_prompts(d.train_files, tokenizer, d.max_prompt_length, d.chat_template)
    val_data, val_dropped = ([], 0)
    if d.val_files:
        val_data, val_dropped = load_prompts(d.val_files, tokenizer, d.max_prompt_length, d.chat_template,
                                             limit=d.val_max_samples)
    sampler = PromptSampler(len(train_data), d.train_batch_size, t.seed, d.shuffle) if train_data else None

    # -- retrieval and engine ----------------------------------------------------------------------------------
    server, url = None, cfg.retrieval.url
    if cfg.retrieval.launch:
        server, url = _launch_server(cfg)
    client = RetrievalClient(url, topk=cfg.retrieval.topk, timeout=cfg.retrieval.timeout)
    engine_dtype = cfg.model.dtype if r.dtype == "auto" else r.dtype
    max_len = d.max_prompt_length + r.max_response_length
    engine_kw: dict = dict(dtype=engine_dtype)
    if r.engine == "vllm":
        # one seed per vLLM TP group: its ranks must sample alike (requests carry their own seeds anyway)
        engine_kw.update(tensor_parallel_size=r.engine_tp, max_model_len=max_len, seed=t.seed + rank // r.engine_tp,
                         gpu_memory_utilization=r.gpu_memory_utilization, enforce_eager=r.enforce_eager,
                         kv_sessions=None if r.kv_sessions else False)
        if not torch.cuda.is_available():
            engine_kw["kv_cache_gib"] = r.kv_cache_gib
    engine = make_engine(r.engine, hf_dir, **engine_kw)
    stop_ids = _stop_token_ids(tokenizer, hf_dir)

    kl_ctrl = (AdaptiveKLController(a.kl_coef, a.target_kl, a.kl_horizon) if a.kl_ctrl == "adaptive"
               else FixedKLController(a.kl_coef))
    logger = RunLogger(t.output_dir, enabled=rank == 0, tensorboard=cfg.logging.tensorboard)
    rt = Runtime(cfg=cfg, tokenizer=tokenizer, hf_config=hf_config, mapping=mapping, actor=actor,
                 actor_opt=actor_opt, actor_sched=actor_sched, ref=ref, critic=critic, critic_opt=critic_opt,
                 critic_sched=critic_sched, engine=engine, client=client, train_data=train_data,
                 val_data=val_data, sampler=sampler, logger=logger, kl_ctrl=kl_ctrl, rank=rank, world=world,
                 dp_rank=dp_rank, dp_size=dp_size, stop_token_ids=stop_ids, server=server,
                 notes={"dropped_long_prompts": dropped, "dropped_long_val_prompts": val_dropped},
                 model_source=model_source)
    return rt


def _stop_token_ids(tokenizer, hf_dir: str) -> tuple[int, ...]:
    """End-of-turn ids (eos of the tokenizer and the generation config): a turn that ends with one is invalid."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(hf_dir).eos_token_id
        ids.update([eos] if isinstance(eos, int) else list(eos or []))
    except Exception:  # noqa: BLE001 - no generation_config.json: the tokenizer's eos is enough
        pass
    return tuple(sorted(ids))
