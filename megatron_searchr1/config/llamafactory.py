"""LLaMA-Factory's flat SFT YAML, read as our SFT config: the study guide's `qwen3_lora_sft.yaml` runs as written.

    python -m megatron_searchr1.sft qwen3_lora_sft.yaml                        # llamafactory-cli train ... here
    torchrun --nproc_per_node 2 -m megatron_searchr1.sft qwen3_lora_sft.yaml parallel.tp=2

`translate(raw)` turns the top-level LLaMA-Factory keys of a YAML (after the command line's overrides, which may be
either kind) into our sections; a YAML of sections only (examples/sft_tiny_cpu.yaml) passes through unchanged.
A value our own dotted keys already set (`optim.lr=...` on the command line) wins over the LLaMA-Factory key.

What each key becomes (LLaMA-Factory's defaults when absent, so the same YAML trains the same recipe):

    model_name_or_path          model.path (a local HF directory here: there is no hub download)
    stage / do_train            must be sft / true (this is the SFT trainer)
    finetuning_type             lora: model.lora.rank = lora_rank (default 8), lora_alpha, lora_dropout,
                                lora_target -> model.lora.alpha / dropout / targets; full: model.lora.rank = 0;
                                freeze: model.freeze.trainable_layers = freeze_trainable_layers (default 2: the
                                last 2 layers; -N the first N), freeze_trainable_modules (default all; or self_attn,
                                mlp, input_layernorm, post_attention_layernorm), freeze_extra_modules (embed_tokens,
                                norm, lm_head) -> model.freeze.trainable_modules / extra_modules (models/freeze.py)
    dataset, dataset_dir        data.datasets (comma-separated), data.dataset_dir (default `data`, as there)
    template                    data.template (sharegpt tool records, `tools` + function_call / observation, are
                                tokenized with the tokenizer's own chat template, as the tool_calls rollout renders
                                them: data/sft_data.py layout 3)
    tool_format                 data.tool_parser of tool records: qwen -> hermes, llama3 -> llama3_json, mistral,
                                glm4_moe -> glm45 (LLaMA-Factory's other formats have no parser here)
    enable_thinking             data.chat_template_kwargs.enable_thinking of tool records (set it as the rollout's
                                rollout.chat_template_kwargs)
    cutoff_len                  data.max_length (default 2048); longer examples are DROPPED and counted, not cut
    max_samples                 data.max_samples
    train_on_prompt             data.train_on_prompt (default false: the loss on the assistant's tokens only)
    eval_dataset, eval_steps    data.val_datasets (comma-separated, in dataset_dir), trainer.val_freq: the held-out
                                loss and exact share every eval_steps steps and at the end (trainer/sft.py)
    per_device_train_batch_size x gradient_accumulation_steps x DP size = data.batch_size (examples per optimizer
                                step); the micro-batch token budget is per_device_train_batch_size * cutoff_len
    learning_rate               optim.lr (default 5e-5); weight_decay (0), adam_beta1/2, max_grad_norm (1.0)
    num_train_epochs / max_steps  trainer.num_epochs (default 3) / trainer.total_steps (max_steps > 0 wins)
    lr_scheduler_type           cosine | linear | constant | constant_with_warmup -> optim.lr_decay (constant
                                ignores warmup_ratio, as there); warmup_ratio -> optim.warmup_steps_ratio
    bf16 / fp16                 model.dtype bfloat16 / float16 (on a CPU the trainer says so and runs float32)
    output_dir, logging_steps, save_steps, save_total_limit, seed  trainer.output_dir / log_every / save_freq /
                                keep_last / seed
    plot_loss                   logging.plot (training_loss.png)
    report_to                   none | tensorboard -> logging.tensorboard
    overwrite_output_dir        true: start fresh (no resume from the checkpoints there); false: resume from them
    resume_from_checkpoint      a `<output_dir>/checkpoints/step_N` directory (or true: the latest)

Keys about the data loader, remote code or timeouts (IGNORED) are accepted and named in one printed line; any other
key is refused, naming it.
"""
from __future__ import annotations

import os
from typing import Any

from megatron_searchr1.config.loader import ConfigError

SECTIONS = ("data", "model", "parallel", "optim", "trainer", "logging")
KEYS = ("model_name_or_path", "stage", "do_train", "finetuning_type", "lora_rank", "lora_alpha", "lora_dropout",
        "lora_target", "freeze_trainable_layers", "freeze_trainable_modules", "freeze_extra_modules", "dataset",
        "dataset_dir", "template", "tool_format", "enable_thinking", "cutoff_len", "max_samples", "train_on_prompt",
        "eval_dataset", "eval_steps",
        "per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate", "weight_decay", "adam_beta1",
        "adam_beta2", "max_grad_norm", "num_train_epochs", "max_steps", "lr_scheduler_type", "warmup_ratio", "bf16",
        "fp16", "output_dir", "logging_steps", "save_steps", "save_total_limit", "seed", "plot_loss", "report_to",
        "overwrite_output_dir", "resume_from_checkpoint")
# accepted, no effect here: loader workers, remote code (we build the model ourselves), NCCL timeout (see
# parallel.timeout_minutes), what a checkpoint holds (ours always resume exactly), logging destinations
IGNORED = ("trust_remote_code", "preprocessing_num_workers", "dataloader_num_workers", "ddp_timeout", "save_only_model",
           "overwrite_cache", "logging_dir", "run_name", "flash_attn", "disable_tqdm", "use_fast_tokenizer",
           "dataloader_pin_memory", "gradient_checkpointing", "ddp_find_unused_parameters")
TOOL_FORMATS = {"qwen": "hermes", "llama3": "llama3_json", "mistral": "mistral", "glm4_moe": "glm45"}
"""LLaMA-Factory's tool_format -> our parser (rollout/protocols/parsers.py)."""
SCHEDULERS = {"cosine": ("cosine", True), "linear": ("linear", True), "constant": ("constant", False),
              "constant_with_warmup": ("constant", True)}


def is_llamafactory(raw: dict) -> bool:
    """A YAML with any top-level key that is not one of our sections is read as LLaMA-Factory's."""
    return any(k not in SECTIONS for k in raw)


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ConfigError(f"{key}: expected true or false, got {value!r}")


def _num(key: str, value: Any, kind=float):
    try:
        out = kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if kind is int and float(value) != out:
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    return out


def _names(value: Any) -> list[str]:
    if isinstance(value, (list, tuple)):
        return [str(v).strip() for v in value if str(v).strip()]
    return [t.strip() for t in str(value).split(",") if t.strip()]


def translate(raw: dict, world_size: int | None = None, say=print) -> dict:
    """Our nested config dict from a LLaMA-Factory YAML (a dict of sections passes through unchanged)."""
    if not is_llamafactory(raw):
        return raw
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items() if k in SECTIONS}
    lf = {k: v for k, v in raw.items() if k not in SECTIONS}
    unknown = [k for k in lf if k not in KEYS and k not in IGNORED]
    if unknown:
        raise ConfigError(f"unknown key {unknown[0]!r}: not a LLaMA-Factory SFT key this trainer reads (it reads "
                          f"{', '.join(KEYS)}; ignores {', '.join(IGNORED)}) nor one of the sections "
                          f"{', '.join(SECTIONS)}")
    ignored = [k for k in lf if k in IGNORED]
    if ignored and os.environ.get("RANK", "0") == "0":
        say(f"LLaMA-Factory keys with no effect here, ignored: {', '.join(ignored)}")

    def put(dotted: str, value: Any) -> None:  # our own dotted keys, when given, win
        section, *rest = dotted.split(".")
        node = out.setdefault(section, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{section} is a section: set its fields, e.g. {section}.FIELD=VALUE")
        for part in rest[:-1]:
            node = node.setdefault(part, {})
        node.setdefault(rest[-1], value)

    if str(lf.get("stage", "sft")) != "sft":
        raise ConfigError(f"stage: {lf['stage']!r}: this trainer does supervised fine-tuning only (stage: sft); RL is "
                          "python -m megatron_searchr1.train")
    if not _bool("do_train", lf.get("do_train", True)):
        raise ConfigError("do_train: false leaves nothing to do here (evaluation and prediction are not supported): "
                          "set do_train: true")
    if "model_name_or_path" in lf:
        path = str(lf["model_name_or_path"])
        if not os.path.isdir(path):
            raise ConfigError(f"model_name_or_path: {path!r} is not a local directory (nothing is downloaded here): "
                              f"download it first, e.g. `huggingface-cli download {path} --local-dir models/"
                              f"{os.path.basename(path)}`, and pass that directory")
        put("model.path", path)
    ft = str(lf.get("finetuning_type", "lora"))  # LLaMA-Factory's default
    if ft not in ("lora", "full", "freeze"):
        raise ConfigError(f"finetuning_type: {ft!r} is not supported here: choose lora, full or freeze")
    if ft == "lora":
        put("model.lora.rank", lf.get("lora_rank", 8))
        put("model.use_te", False)  # the adapters need Megatron's local layers (models/lora.py)
        for key, field in (("lora_alpha", "alpha"), ("lora_dropout", "dropout")):
            if key in lf:
                put(f"model.lora.{field}", lf[key])
        put("model.lora.targets", _names(lf.get("lora_target", "all")))
    else:
        put("model.lora.rank", 0)  # full / freeze: LLaMA-Factory ignores the lora_* keys too
    if ft == "freeze":  # LLaMA-Factory's defaults: the last 2 layers, all of each, nothing else
        put("model.freeze.trainable_layers", _num("freeze_trainable_layers", lf.get("freeze_trainable_layers", 2),
                                                  int))
        put("model.freeze.trainable_modules", _names(lf.get("freeze_trainable_modules", "all")))
        put("model.freeze.extra_modules", _names(lf.get("freeze_extra_modules") or []))

    if "dataset" in lf:
        put("data.datasets", _names(lf["dataset"]))
    put("data.dataset_dir", str(lf.get("dataset_dir", "data")))
    if "template" in lf:
        put("data.template", str(lf["template"]))
    if lf.get("tool_format") is not None:
        fmt = str(lf["tool_format"])
        if fmt not in TOOL_FORMATS:
            raise ConfigError(f"tool_format: {fmt!r} has no parser here: choose one of {', '.join(TOOL_FORMATS)}, or "
                              "set data.tool_parser to the rollout's rollout.tool_parser")
        put("data.tool_parser", TOOL_FORMATS[fmt])
    if lf.get("enable_thinking") is not None:
        put("data.chat_template_kwargs.enable_thinking", _bool("enable_thinking", lf["enable_thinking"]))
    cutoff = _num("cutoff_len", lf.get("cutoff_len", 2048), int)
    put("data.max_length", cutoff)
    if lf.get("max_samples") is not None:
        put("data.max_samples", lf["max_samples"])
    put("data.train_on_prompt", _bool("train_on_prompt", lf.get("train_on_prompt", False)))
    if lf.get("eval_dataset"):
        put("data.val_datasets", _names(lf["eval_dataset"]))
    if lf.get("eval_steps") is not None:
        put("trainer.val_freq", _num("eval_steps", lf["eval_steps"], int))
    per_device = _num("per_device_train_batch_size", lf.get("per_device_train_batch_size", 8), int)
    accum = _num("gradient_accumulation_steps", lf.get("gradient_accumulation_steps", 1), int)
    if per_device < 1 or accum < 1:
        raise ConfigError("per_device_train_batch_size and gradient_accumulation_steps must be >= 1")
    par = out.get("parallel", {}) if isinstance(out.get("parallel"), dict) else {}
    mp = int(par.get("tp", 1)) * int(par.get("pp", 1))
    world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    dp = max(world // mp, 1)
    put("data.batch_size", per_device * accum * dp)
    put("optim.max_tokens_per_micro_batch", max(per_device * cutoff, 64))

    put("optim.lr", lf.get("learning_rate", 5e-5))
    put("optim.weight_decay", lf.get("weight_decay", 0.0))
    put("optim.betas", [lf.get("adam_beta1", 0.9), lf.get("adam_beta2", 0.999)])
    put("optim.clip_grad", lf.get("max_grad_norm", 1.0))
    sched = str(lf.get("lr_scheduler_type", "linear"))
    if sched not in SCHEDULERS:
        raise ConfigError(f"lr_scheduler_type: {sched!r} is not supported here: choose one of {', '.join(SCHEDULERS)}")
    decay, warms = SCHEDULERS[sched]
    put("optim.lr_decay", decay)
    put("optim.warmup_steps_ratio", lf.get("warmup_ratio", 0.0) if warms else 0.0)
    max_steps = _num("max_steps", lf.get("max_steps", -1), int)
    if max_steps > 0:
        put("trainer.total_steps", max_steps)
    else:
        put("trainer.num_epochs", _num("num_train_epochs", lf.get("num_train_epochs", 3.0)))

    if _bool("bf16", lf.get("bf16", False)):
        put("model.dtype", "bfloat16")
    elif _bool("fp16", lf.get("fp16", False)):
        put("model.dtype", "float16")
    if "output_dir" in lf:
        put("trainer.output_dir", str(lf["output_dir"]))
    if "logging_steps" in lf:
        put("trainer.log_every", lf["logging_steps"])
    if "save_steps" in lf:
        put("trainer.save_freq", lf["save_steps"])
    if lf.get("save_total_limit") is not None:
        put("trainer.keep_last", lf["save_total_limit"])
    if "seed" in lf:
        put("trainer.seed", lf["seed"])
    put("logging.plot", _bool("plot_loss", lf.get("plot_loss", False)))
    report = _names(lf.get("report_to", "none") or "none")
    bad = [r for r in report if r not in ("none", "tensorboard")]
    if bad:
        raise ConfigError(f"report_to: {bad[0]!r} is not available here: use none or tensorboard")
    put("logging.tensorboard", "tensorboard" in report)
    resume = lf.get("resume_from_checkpoint")
    if resume is True or str(resume).lower() == "true":
        put("trainer.resume", "auto")
    elif resume not in (None, False) and str(resume).lower() not in ("null", "none", "false"):
        put("trainer.resume", str(resume))
    else:
        put("trainer.resume", "disable" if _bool("overwrite_output_dir", lf.get("overwrite_output_dir", False))
            else "auto")
    return out
