"""Supervised warm-up on Megatron: full-parameter, LoRA or freeze SFT at any TP/PP, loss on the assistant's tokens only.

    metrics = train_sft(cfg)    # every rank; = SFTTrainer(cfg).fit(); the entry point is megatron_searchr1/sft.py

Data: a LLaMA-Factory-style `dataset_info.json` naming alpaca or sharegpt files (data/sft_data.py). Each example is
tokenized segment by segment exactly as the rollout produces it (prompt, assistant turns, observations inline), so
SFT trains on the token sequences RL later samples; the loss mask is 1 on assistant tokens only (the prompt and the
`<information>` blocks are masked, as Search-R1's SFT does).
Training: token-budget micro-batches through Megatron's pipeline schedule (megatron/schedule.py), token-mean NLL
over each global batch, Adam with warmup/decay (the RL trainer's setup, trainer/build.py), checkpoints like the RL
trainer's (its actor subdir is what `model.megatron_ckpt` of the RL config points at), TensorBoard, and an HF
export at the end.

Validation (`data.val_datasets`): every `trainer.val_freq` steps and at the end, the held-out examples' loss and
exact share (`validate`: the share greedy decoding would reproduce token for token, from one forward pass). With
`trainer.stop_at_val_exact` the run stops at the first validation that reaches it: a warm-up that must have learned
a skill before RL starts trains until it has, not for a step count guessed in advance. The stop is kept in the
checkpoint, so a resumed run that had stopped stays stopped.

LoRA (`model.lora.rank` > 0, LLaMA-Factory's `finetuning_type: lora`): adapters on the decoder's linears
(models/lora.py) are added to the bare model right after its base weights load and before DDP and the optimizer see
it, so only the adapters get gradient buffers and Adam state. Checkpoints hold only the adapters (with their Adam
state, the scheduler, RNG and data cursor: resume is exact; the base is reloaded from model.path, checkpoint.py);
the export is the merged model (`<output_dir>/hf`, what `llamafactory-cli export` writes and what the RL config's
model.path takes) and the PEFT adapter (`<output_dir>/hf_adapter`, for PeftModel.from_pretrained).

Freeze (`model.freeze.trainable_layers` set, LLaMA-Factory's `finetuning_type: freeze`): the same hook marks only
LLaMA-Factory's trainable set (models/freeze.py: the last / first N layers, some of their modules, extra modules)
as trainable; the real weights train, so checkpoints and the export hold the full model (the Adam state of the
trained layers only, keyed per layer: checkpoint/optimizer.py).
"""
from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from megatron_searchr1 import interrupt
from megatron_searchr1.checkpoint import CheckpointError, agreed_resume_target, load_roles, save_roles, step_dir
from megatron_searchr1.cli import UsageError
from megatron_searchr1.config import SFTConfig, save_config
from megatron_searchr1.console import progress
from megatron_searchr1.data.rl_data import PromptSampler, dp_shard
from megatron_searchr1.data.sft_data import load_sft_dataset
from megatron_searchr1.megatron.batching import make_micro_batches, padding_share
from megatron_searchr1.megatron.initialize import initialize_megatron
from megatron_searchr1.metrics import RunLogger, mean_over_ranks, timer
from megatron_searchr1.models.convert import DTYPES, bind_mapping, load_hf_config
from megatron_searchr1.models.forward import unwrap
from megatron_searchr1.models.freeze import apply_freeze
from megatron_searchr1.models.lora import apply_lora
from megatron_searchr1.trainer.build import (actor_settings, build_optimizer_from_config, expert_tp_for,
                                             load_tokenizer)
from megatron_searchr1.trainer.losses import masked_nll_loss, sft_sequence
from megatron_searchr1.trainer.roles import Policy, build_actor
from megatron_searchr1.trainer.sources import weights_loader


def train_sft(cfg: SFTConfig) -> dict:
    """Run SFT; returns the last step's metrics. Every rank calls it."""
    return SFTTrainer(cfg).fit()


class SFTTrainer:
    """The SFT loop in the RL `Trainer`'s shape (trainer/rl.py): build and resume in __init__, then `fit()` runs
    `step()`s with logging and periodic `save()`s, and ends with a checkpoint, the HF export and the plots."""

    def __init__(self, cfg: SFTConfig):
        self.cfg = cfg
        t, d = cfg.trainer, cfg.data
        hf_config = load_hf_config(cfg.model.path)
        initialize_megatron(tp=cfg.parallel.tp, pp=cfg.parallel.pp, seed=t.seed,
                            timeout_minutes=cfg.parallel.timeout_minutes,
                            sequence_parallel=cfg.parallel.sequence_parallel, ep=cfg.parallel.ep,
                            expert_tp=expert_tp_for(cfg, hf_config))
        self.rank = dist.get_rank()
        self.dp_rank, self.dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
        self.tokenizer = load_tokenizer(cfg.model.path, hf_config)
        dtype = DTYPES[cfg.model.dtype]
        if dtype != torch.float32 and not torch.cuda.is_available():
            self.say(f"model.dtype={cfg.model.dtype} (bf16/fp16) needs a GPU: this machine has none, training runs "
                     "in float32")
            dtype = torch.float32
        if self.rank == 0:
            save_config(cfg, os.path.join(t.output_dir, "config.yaml"))

        tool_kw = dict(tool_parser=d.tool_parser, stop_at_call_end=d.stop_at_call_end,  # tool records: the rollout's
                       chat_template_kwargs=dict(d.chat_template_kwargs))
        data = load_sft_dataset(d.dataset_dir, list(d.datasets), self.tokenizer, d.max_length, template=d.template,
                                max_samples=d.max_samples, **tool_kw)
        dropped = sum(data.dropped_too_long.values())
        self.say(f"SFT data: {len(data)} examples from {', '.join(d.datasets)}"
                 + (f" ({dropped} longer than data.max_length={d.max_length} dropped)" if dropped else ""))
        if len(data) < d.batch_size:
            raise UsageError(f"{len(data)} SFT examples cannot fill one batch of data.batch_size={d.batch_size} "
                             "(LLaMA-Factory: per_device_train_batch_size * gradient_accumulation_steps * DP size): "
                             "lower it")
        self.seqs = [sft_sequence(ex.input_ids, self._mask(ex)) for ex in data]
        self.val_seqs = []
        if d.val_datasets:
            val = load_sft_dataset(d.dataset_dir, list(d.val_datasets), self.tokenizer, d.max_length,
                                   template=d.template, max_samples=d.val_max_samples, **tool_kw)
            if not val:
                raise UsageError(f"data.val_datasets={list(d.val_datasets)} hold no example of at most "
                                 f"data.max_length={d.max_length} tokens")
            self.val_seqs = [sft_sequence(ex.input_ids, ex.loss_mask) for ex in val]
            self.say(f"SFT validation data: {len(val)} examples from {', '.join(d.val_datasets)}")
        self.sampler = PromptSampler(len(self.seqs), d.batch_size, t.seed, d.shuffle)
        # epochs: whole batches per pass (the sampler skips an epoch's tail that does not fill one, as drop_last does)
        self.total_steps = (t.total_steps if t.num_epochs is None
                            else max(1, math.ceil(t.num_epochs * (len(self.seqs) // d.batch_size))))
        self.policy = self._build_policy(hf_config, dtype)
        self.ckpt_root = os.path.join(t.output_dir, "checkpoints")
        self.step_no = 0
        self.stopped_early: dict | None = None  # the validation that stopped the run early (kept in checkpoints)
        self._resume()

    def _mask(self, ex) -> list:
        """The example's loss mask: the assistant's tokens, or every token with data.train_on_prompt."""
        return [1] * len(ex.input_ids) if self.cfg.data.train_on_prompt else ex.loss_mask

    def say(self, line: str) -> None:
        if self.rank == 0:
            print(line, flush=True)

    def _build_policy(self, hf_config, dtype) -> Policy:
        cfg = self.cfg
        lora, freeze = cfg.model.lora, cfg.model.freeze
        source = cfg.model.megatron_ckpt or cfg.model.path
        load_base = weights_loader(hf_config, source)

        def load_and_choose_trainable(bare):  # before DDP and the optimizer: they see only what trains
            load_base(bare)
            if lora.enabled:
                apply_lora(bare, lora.settings())
            elif freeze.enabled:
                try:
                    apply_freeze(bare, freeze.settings(), bind_mapping(hf_config, bare))
                except ValueError as e:  # lm_head of a tied model
                    raise UsageError(f"model.{e}") from None

        model = build_actor(hf_config, **actor_settings(cfg, hf_config, dtype), load_weights=load_and_choose_trainable,
                            use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
                            tokenizer_vocab_size=len(self.tokenizer))
        policy = Policy(model, *build_optimizer_from_config(model, cfg.optim, self.total_steps, cfg.optim.lr),
                        mapping=bind_mapping(hf_config, unwrap(model)), hf_config=hf_config, hf_dir=cfg.model.path,
                        dtype=dtype, source=source)
        n_train = sum(p.numel() for p in unwrap(model).parameters() if p.requires_grad)
        n_all = sum(p.numel() for p in unwrap(model).parameters())
        kind = (f"LoRA rank {lora.rank}" if lora.enabled else f"freeze ({freeze.settings()})" if freeze.enabled
                else "full fine-tuning")
        self.say(f"{kind}: {n_train:,} of {n_all:,} parameters of this rank's shard train "
                 f"({100 * n_train / n_all:.2f}%), {self.total_steps} steps")
        return policy

    # -- the loop -----------------------------------------------------------------------------------------------
    def fit(self) -> dict:
        cfg, t = self.cfg, self.cfg.trainer
        logger = RunLogger(t.output_dir, enabled=self.rank == 0, tensorboard=cfg.logging.tensorboard)
        if self.step_no:
            logger.resume_at(self.step_no)
        bar = progress(total=self.total_steps, initial=self.step_no, desc="SFT steps", unit="step",
                       disable=self.rank != 0 or not cfg.logging.progress_bar)
        metrics: dict = {}
        while self.step_no < self.total_steps and self.stopped_early is None:
            self.step_no += 1
            interrupt.note(f"in step {self.step_no} of {self.total_steps}")
            metrics = self.step()
            if self.val_seqs and t.val_freq and self.step_no % t.val_freq == 0 and self.step_no < self.total_steps:
                metrics.update(self.validate())
                if self.rank == 0:
                    bar.write(self._val_line(metrics))
                target = t.stop_at_val_exact
                if target is not None and metrics["val/exact"] >= target:
                    self.stopped_early = {"step": self.step_no, "val/exact": metrics["val/exact"], "target": target}
            logger.log(self.step_no, metrics)
            logger.raise_if_failed()  # a full disk under the logs: one line on every rank together (metrics.py)
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['sft/loss']:.4f}")
            if t.log_every and self.step_no % t.log_every == 0 and self.rank == 0:
                bar.write(f"step {self.step_no}/{self.total_steps} loss={metrics['sft/loss']:.4f} grad_norm="
                          f"{metrics['sft/grad_norm']:.3g} lr={metrics['sft/lr']:.3g}")
            if (t.save_freq and self.step_no % t.save_freq == 0 and self.step_no < self.total_steps
                    and self.stopped_early is None):
                self.save()
        bar.close()
        if self.stopped_early is not None:
            self.say(f"SFT stopped early at step {self.stopped_early['step']}: validation exact "
                     f"{self.stopped_early['val/exact']:.3f} >= trainer.stop_at_val_exact={self.stopped_early['target']}")
        elif self.val_seqs and metrics:  # the end of the run, unless it is a resumed, already finished one
            final = self.validate()
            metrics.update(final)
            logger.log(self.step_no, final)
            logger.raise_if_failed()
            self.say(self._val_line(final))
        self.save()
        if t.export_hf:
            self.export(os.path.join(t.output_dir, "hf"))
        logger.close()
        if self.rank == 0 and cfg.logging.plot:
            from megatron_searchr1.plots import plot_sft_loss

            plot_sft_loss(t.output_dir)
        self.say(f"SFT done: step {self.step_no}, loss {metrics.get('sft/loss', float('nan')):.4f}; checkpoint "
                 f"{os.path.join(self.ckpt_root, 'latest')}")
        return metrics

    def step(self) -> dict:
        """One optimizer step over this DP rank's share of the next batch: token-mean NLL on the loss-mask tokens."""
        with timer() as t_step:
            batch = dp_shard(self.sampler.next_batch(), self.dp_rank, self.dp_size)
            mbs = make_micro_batches([self.seqs[i] for i in batch], self.cfg.optim.max_tokens_per_micro_batch,
                                     pad_id=self.tokenizer.pad_token_id or 0)
            m = self.policy.update(mbs, masked_nll_loss, step_scheduler=True)
        tokens = sum(mb.num_real_tokens for mb in mbs)
        return mean_over_ranks({"sft/loss": m["loss"], "sft/grad_norm": m["grad_norm"], "sft/lr": m["lr"],
                                "sft/padding_share": padding_share(mbs), "time/step": t_step.seconds,
                                "perf/tokens_per_s": tokens / max(t_step.seconds, 1e-9)})

    def validate(self) -> dict:
        """Loss and exact share on data.val_datasets, over all DP ranks (each scores a strided share).

        `val/exact` is the share of examples whose every loss-mask token has probability > 1/2 given the gold
        prefix, so greedy decoding would write it token for token (a token above 1/2 is the argmax), as long as
        the observations are the gold ones: on search trajectories, the share the model would reproduce, query
        and answer read from the passages included. A cheap stand-in for greedy EM (one forward pass, no rollout).
        """
        mine = self.val_seqs[self.dp_rank::self.dp_size]
        totals = torch.zeros(4, dtype=torch.float64)  # nll sum, loss tokens, exact examples, examples
        if mine:
            log_probs = self.policy.log_probs(mine, self.cfg.optim.max_tokens_per_micro_batch,
                                              pad_id=self.tokenizer.pad_token_id or 0)
            for seq, lp in zip(mine, log_probs):
                on = seq.loss_mask > 0
                totals += torch.tensor([float(-lp[on].sum()), float(on.sum()),
                                        float(bool((lp[on] > math.log(0.5)).all())), 1.0], dtype=torch.float64)
        if self.dp_size > 1:
            from megatron_searchr1 import collectives

            totals = totals.to(collectives.collective_device())
            dist.all_reduce(totals, group=mpu.get_data_parallel_group())
            totals = totals.cpu()
        nll, tokens, exact, n = totals.tolist()
        return {"val/loss": nll / max(tokens, 1.0), "val/exact": exact / max(n, 1.0)}

    def _val_line(self, metrics: dict) -> str:
        return (f"validation at step {self.step_no}: loss {metrics['val/loss']:.4f}, exact {metrics['val/exact']:.3f} "
                f"of {len(self.val_seqs)} held-out examples")

    # -- checkpoints and export --------------------------------------------------------------------------------
    def save(self) -> None:
        save_roles(self.ckpt_root, self.step_no, {"actor": self.policy.state()},
                   {"step": self.step_no, "sampler": self.sampler.state_dict(), "stopped_early": self.stopped_early},
                   hf_dirs={"actor": self.cfg.model.path}, keep_last=self.cfg.trainer.keep_last)
        interrupt.note_checkpoint(step_dir(self.ckpt_root, self.step_no))

    def _resume(self) -> None:
        target = agreed_resume_target(self.cfg.trainer.resume, self.ckpt_root)  # rank 0 decides for every node
        if target is None:
            return
        try:
            extra = load_roles(*target, {"actor": self.policy.state()})
        except CheckpointError as e:
            raise UsageError(f"resuming from {target[0]} (step {target[1]}) failed: {e} (a checkpoint of another "
                             "model or model.lora setting? trainer.resume=disable, or overwrite_output_dir: true, "
                             "starts fresh)") from None
        self.step_no = int(extra["step"])
        interrupt.note_checkpoint(step_dir(*target))
        self.sampler.load_state_dict(extra["sampler"])
        # An early-stopped run stays stopped when resumed, unless trainer.stop_at_val_exact was raised past the
        # share it stopped at (or unset): then the user asked for more, and it trains on from there.
        stopped, target = extra.get("stopped_early"), self.cfg.trainer.stop_at_val_exact
        self.stopped_early = stopped if stopped and target is not None and stopped["val/exact"] >= target else None
        if stopped and self.stopped_early is None:
            self.say(f"resuming a run stopped early at step {stopped['step']} (validation exact "
                     f"{stopped['val/exact']:.3f}): trainer.stop_at_val_exact={target} asks for more")

    def export(self, out_dir: str) -> None:
        self.policy.export_hf(out_dir)  # LoRA: the merged model there, the PEFT adapter in <out>_adapter
        lora = self.cfg.model.lora.enabled
        self.say(f"exported the SFT model as a Hugging Face model to {out_dir}"
                 + (f" (LoRA merged) and its PEFT adapter to {out_dir}_adapter" if lora else ""))
