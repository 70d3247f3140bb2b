"""Checkpoint conversion: Hugging Face safetensors dir <-> Megatron `dist_checkpointing` checkpoint.

    # HF -> Megatron (one process is enough: the checkpoint loads at any TP/PP); the CLIs: models/convert_cli.py
    python checkpoints_convert/hf_to_megatron.py --hf-dir HF --out-dir CKPT
    torchrun --nproc_per_node 4 checkpoints_convert/hf_to_megatron.py --hf-dir HF --out-dir CKPT --tp 2 --pp 2
    # Megatron (saved at any TP/PP) -> HF
    python checkpoints_convert/megatron_to_hf.py --ckpt-dir CKPT --out-dir HF2

A converted checkpoint directory holds Megatron's files (metadata.json, common.pt, *.distcp: the model's
`sharded_state_dict`, so Megatron reshards it on load), `searchr1_checkpoint.json` (what it is: architecture,
the TP/PP and padded vocab it was saved with) and `hf/` (config.json, generation_config.json, tokenizer files), so
megatron_to_hf can rebuild a complete HF directory.

Each rank maps only its own shard, one tensor at a time, reading HF tensors lazily from safetensors (no full model
in memory beyond this rank's Megatron stage). Weight mapping: `megatron_searchr1.models.families`.

This module is the library: the loaders, the gather to HF names and the HF writer, run inside a Megatron world the
caller started (trainers, the weight sync, the checkpoint code). The two conversions as programs, which start that
world themselves (`hf_to_megatron`, `megatron_to_hf`), are models/convert_megatron.py, which imports this module and
never the other way round; scripts import them from `megatron_searchr1.models` (the public names, README).
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Iterable, Optional

import torch

from megatron_searchr1.models.config import padded_vocab_size
from megatron_searchr1.models.families import (
    ModelFamily, expert_index, get_family, grouped_to_sequential_name, is_expert_param, rename_expert, rename_layer,
    split_layer_name, tp_merge, tp_split,
)

META_FILE = "searchr1_checkpoint.json"
HF_SUBDIR = "hf"
META_FORMAT = "megatron_searchr1.model_checkpoint"
# Everything of an HF dir except weights: configs, tokenizer, chat template.
HF_AUX_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt",
                "tokenizer.model", "added_tokens.json")
# Buffers some HF checkpoints carry that are not weights.
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# A critic's value head (models/critic.py) exists in no HF causal-LM checkpoint nor in a converted actor checkpoint:
# the loaders leave it as built (zero), so PPO can start its critic from the actor's weights.
FRESH_PREFIXES = ("value_head.",)


def _is_fresh(name: str) -> bool:
    return name.startswith(FRESH_PREFIXES)


class ConversionError(Exception):
    """A user-facing problem with the inputs (the CLIs, models/convert_cli.py, print it as one `error:` line)."""


# ----------------------------------------------------------------------------------------------------------------
# Reading an HF directory lazily
# ----------------------------------------------------------------------------------------------------------------
class SafetensorsReader:
    """name -> tensor from an HF dir's `model.safetensors` or sharded `model.safetensors.index.json`, lazily."""

    def __init__(self, hf_dir: str):
        from safetensors import safe_open

        index = os.path.join(hf_dir, "model.safetensors.index.json")
        single = os.path.join(hf_dir, "model.safetensors")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.isfile(single):
            weight_map = None
        else:
            raise ConversionError(f"{hf_dir} has no model.safetensors or model.safetensors.index.json: only "
                                  "safetensors checkpoints are supported (re-save with save_pretrained)")
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        missing = [f for f in files if not os.path.isfile(os.path.join(hf_dir, f))]
        if missing:
            raise ConversionError(f"{hf_dir} is incomplete: shard file(s) {missing} listed in the index are missing")
        self._handles = {f: safe_open(os.path.join(hf_dir, f), framework="pt") for f in files}
        if weight_map is None:
            weight_map = {k: "model.safetensors" for k in self._handles["model.safetensors"].keys()}
        self.weight_map = {k: v for k, v in weight_map.items() if not k.endswith(_IGNORED_HF_SUFFIXES)}

    def names(self) -> set[str]:
        return set(self.weight_map)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise ConversionError(f"HF checkpoint has no tensor {name!r}")
        return self._handles[self.weight_map[name]].get_tensor(name)

    def get_many(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        return {n: self.get(n) for n in names}


def load_hf_config(hf_dir: str):
    """The `transformers` config of an HF dir, with clear errors for a missing dir or config."""
    from transformers import AutoConfig

    if not os.path.isdir(hf_dir):
        raise ConversionError(f"HF model directory {hf_dir!r} does not exist")
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise ConversionError(f"{hf_dir!r} has no config.json: not a Hugging Face model directory")
    with open(os.path.join(hf_dir, "config.json")) as f:
        raw = json.load(f)
    try:
        get_family(raw)  # our error (names the supported architectures) before transformers' own
    except ValueError as e:
        raise ConversionError(str(e)) from None
    try:
        return AutoConfig.from_pretrained(hf_dir)
    except Exception as e:  # transformers validates configs strictly (e.g. layer_types vs num_hidden_layers)
        raise ConversionError(f"{hf_dir}/config.json is invalid: {type(e).__name__}: {e}") from None


def check_hf_tensor_names(mapping: ModelFamily, reader: SafetensorsReader) -> None:
    """The checkpoint holds exactly the tensors its config implies (a tied model may still carry an lm_head)."""
    expected, have = set(mapping.hf_names()), reader.names()
    missing = sorted(expected - have)
    extra = sorted(have - expected - ({"lm_head.weight"} if mapping.dims.tie_embeddings else set()))
    if missing or extra:
        raise ConversionError(f"config.json and the weights disagree: missing tensors {missing[:8]}"
                              f"{' ...' if len(missing) > 8 else ''}, unexpected tensors {extra[:8]}"
                              f"{' ...' if len(extra) > 8 else ''}")


# ----------------------------------------------------------------------------------------------------------------
# Megatron model <-> HF tensors (one rank's shard)
# ----------------------------------------------------------------------------------------------------------------
def _parallel_info() -> tuple[int, int, int, int]:
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
            ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank())


def bind_mapping(hf_config: Any, model: torch.nn.Module, mapping_cls: type[ModelFamily] | None = None) -> ModelFamily:
    """The family mapping for `model` (its padded vocab read off the embedding / output layer)."""
    tp = _parallel_info()[0]
    padded = None
    for name, p in model.named_parameters():
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            padded = p.shape[0] * tp
    if padded is None:  # a middle pipeline stage has no vocab tensors; use Megatron's rule
        padded = padded_vocab_size(hf_config.vocab_size, tp)
    return (mapping_cls or get_family(hf_config)).from_hf_config(hf_config, padded_vocab_size=padded)


def global_names(model: torch.nn.Module) -> list[tuple[str, str, torch.nn.Parameter]]:
    """(stage-local name, global Megatron name, parameter) for every parameter of this pipeline stage.

    Each layer's global index is read off the layer (`layer_number - 1`, Megatron's offset for this stage), so
    uneven splits (num_layers_in_first/last_pipeline_stage) name their layers right.
    An MoE layer's routed experts are numbered globally too: this rank's `local_experts.{j}` is expert
    `local_expert_indices[0] + j` (Megatron's EP offset, ep_rank * E/ep). Grouped-GEMM experts (TEGroupedMLP's
    `experts.linear_fc1.weight{j}`) get SequentialMLP's global name: the same tensor under the one naming the
    family mappings read.
    """
    decoder = getattr(model, "decoder", None)
    layers = list(getattr(decoder, "layers", ()))
    index = [int(layer.layer_number) - 1 for layer in layers]
    expert_offset = [(getattr(layer.mlp, "local_expert_indices", None) or [0])[0] for layer in layers]
    out = []
    for n, p in model.named_parameters():
        parsed = split_layer_name(n)
        if parsed is not None and parsed[0] >= len(index):
            raise ValueError(f"parameter {n!r} names layer {parsed[0]} but decoder.layers has {len(index)}")
        g = rename_layer(grouped_to_sequential_name(n), index)
        if parsed is not None and expert_index(n) is not None:
            g = rename_expert(g, expert_offset[parsed[0]])
        out.append((n, g, p))
    return out


def tp_of(name: str) -> tuple[int, int, Any]:
    """(size, rank, group) of the tensor-parallel group that splits parameter `name`: the expert-tensor-parallel
    group for routed experts, the TP group for everything else."""
    from megatron.core import parallel_state as ps

    if is_expert_param(name):
        return (ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank(),
                ps.get_expert_tensor_parallel_group())
    return (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_group())


def load_hf_weights(model: torch.nn.Module, reader: SafetensorsReader, mapping: ModelFamily,
                    progress: bool = False) -> None:
    """Fill this rank's Megatron stage/shard from HF tensors, one parameter at a time.

    A critic's `value_head.*` has no HF counterpart and keeps its initial (zero) value.
    """
    from tqdm import tqdm

    params = [(n, g, p) for n, g, p in global_names(model) if not _is_fresh(n)]
    for _, name, param in tqdm(params, desc="HF -> Megatron", disable=not progress, unit="tensor"):
        full = mapping.hf_to_megatron(name, reader.get_many(mapping.hf_sources(name)))
        tp, tp_rank, _ = tp_of(name)
        shard = tp_split(name, full, tp)[tp_rank]
        if tuple(shard.shape) != tuple(param.shape):
            raise ConversionError(f"{name}: mapped shard has shape {tuple(shard.shape)} but the Megatron model "
                                  f"expects {tuple(param.shape)} (config.json disagrees with the tensors)")
        with torch.no_grad():
            param.copy_(shard.to(param.dtype))


def gather_hf_weights(model: torch.nn.Module, mapping: ModelFamily, progress: bool = False,
                      weights: Optional[Iterable[tuple[str, torch.Tensor]]] = None):
    """Yield (hf_name, tensor) for this pipeline stage: TP shards all-gathered, mapped to HF, vocab trimmed.
    `weights`: (global Megatron name, this rank's shard) pairs to map instead of the model's parameters (the LoRA
    export passes base + B·A).

    Every TP rank of the stage must iterate (the all-gathers are collective); all of them get the tensors.
    Routed experts are all-gathered over the expert-TP group, then over the expert-parallel group, so every rank
    yields every expert (EP ranks that skip the dense tensors iterate `expert_weights(model)`).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from tqdm import tqdm

    if weights is None:
        weights = [(name, param.detach()) for _, name, param in global_names(model)]
    ep, ep_group = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_group()
    for name, t in tqdm(weights, desc="Megatron -> HF", disable=not progress, unit="tensor"):
        tp, _, group = tp_of(name)
        if tp > 1:
            shards = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(shards, t.contiguous(), group=group)
            t = tp_merge(name, shards)
        if ep > 1 and is_expert_param(name):
            yield from _gather_experts(mapping, name, t, ep, ep_group)
        else:
            yield from mapping.megatron_to_hf(name, t)


def _gather_experts(mapping: ModelFamily, name: str, t: torch.Tensor, ep: int, group) -> Iterable:
    """One routed expert's full tensor on every EP rank -> the HF pairs of all `ep` of them (EP rank r holds
    global expert r * E/ep + j where this rank holds j; `name` carries this rank's global index)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    per_rank = mapping.dims.moe.num_experts // ep
    local = expert_index(name) - ps.get_expert_model_parallel_rank() * per_rank
    parts = [torch.empty_like(t) for _ in range(ep)]
    dist.all_gather(parts, t.contiguous(), group=group)
    for r, part in enumerate(parts):
        yield from mapping.megatron_to_hf(rename_expert(name, r * per_rank + local - expert_index(name)), part)


def expert_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(global Megatron name, shard) of this stage's routed experts only: what a rank whose dense tensors another
    DP replica exports still gathers (gather_hf_weights(..., weights=expert_weights(model)))."""
    return [(name, param.detach()) for _, name, param in global_names(model) if is_expert_param(name)]


def export_role(tp_rank: int, dp_rank: int) -> str:
    """What a rank does in megatron_to_hf: 'write' (TP rank 0 of DP replica 0: keeps its stage's tensors and
    writes them), 'gather' (the other TP ranks of replica 0: take part in the all-gathers, keep nothing) or 'skip'
    (every other DP replica: the same weights again, so no gather at all)."""
    if dp_rank != 0:
        return "skip"
    return "write" if tp_rank == 0 else "gather"


def host_tensors(pairs: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                 keep: bool = True) -> dict[str, torch.Tensor]:
    """(hf_name, tensor) pairs -> {hf_name: contiguous CPU tensor in `dtype`}, moved one at a time, so a GPU holds at
    most one exported tensor (not a whole stage's) besides the model while a stage is collected for writing.
    `keep=False` runs through the pairs (their collectives) and keeps nothing: ranks that do not write."""
    if not keep:
        for _ in pairs:
            pass
        return {}
    return {n: t.to(dtype).cpu().contiguous() for n, t in pairs}


# ----------------------------------------------------------------------------------------------------------------
# Checkpoint metadata
# ----------------------------------------------------------------------------------------------------------------
def write_checkpoint_metadata(ckpt_dir: str, hf_dir: str, *, tp: int, pp: int, padded_vocab_size: int,
                              dtype: torch.dtype) -> None:
    """Rank 0: `searchr1_checkpoint.json` and the HF config/tokenizer files under `hf/` (for megatron_to_hf)."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf_config = json.load(f)
    aux = os.path.join(ckpt_dir, HF_SUBDIR)
    os.makedirs(aux, exist_ok=True)
    for name in HF_AUX_FILES:
        if os.path.isfile(os.path.join(hf_dir, name)):
            shutil.copy2(os.path.join(hf_dir, name), os.path.join(aux, name))
    meta = dict(format=META_FORMAT, version=1, architecture=get_family(hf_config).architectures[0],
                saved_tp=tp, saved_pp=pp, padded_vocab_size=padded_vocab_size,
                dtype=str(dtype).replace("torch.", ""), hf_config=hf_config, source=os.path.abspath(hf_dir))
    tmp = os.path.join(ckpt_dir, META_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=2)
    os.replace(tmp, os.path.join(ckpt_dir, META_FILE))  # written last and atomically: its presence = complete


def read_checkpoint_metadata(ckpt_dir: str) -> dict:
    """Validate a converted checkpoint directory and return its metadata."""
    if not os.path.isdir(ckpt_dir):
        raise ConversionError(f"Megatron checkpoint directory {ckpt_dir!r} does not exist")
    meta_path = os.path.join(ckpt_dir, META_FILE)
    if not os.path.isfile(meta_path):
        raise ConversionError(f"{ckpt_dir!r} has no {META_FILE}: not a checkpoint written by hf_to_megatron (or "
                              "the conversion did not finish)")
    if not os.path.isfile(os.path.join(ckpt_dir, "metadata.json")):
        raise ConversionError(f"{ckpt_dir!r} has no metadata.json: the Megatron dist checkpoint is incomplete")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("format") != META_FORMAT:
        raise ConversionError(f"{meta_path} has format {meta.get('format')!r}, expected {META_FORMAT!r}")
    try:
        get_family(meta["hf_config"])
    except ValueError as e:
        raise ConversionError(str(e)) from None
    missing = sorted(f for f in _dist_checkpoint_files(ckpt_dir) if not os.path.isfile(os.path.join(ckpt_dir, f)))
    if missing:
        raise ConversionError(f"{ckpt_dir!r} is incomplete: shard file(s) {missing} listed in its .metadata are "
                              "missing")
    if not os.path.isfile(os.path.join(ckpt_dir, HF_SUBDIR, "config.json")):
        raise ConversionError(f"{ckpt_dir!r} has no {HF_SUBDIR}/config.json (the HF config copied at conversion)")
    return meta


def _dist_checkpoint_files(ckpt_dir: str) -> set[str]:
    """The data files a torch-DCP-backed dist checkpoint's `.metadata` refers to."""
    import torch.distributed.checkpoint as dcp

    if not os.path.isfile(os.path.join(ckpt_dir, ".metadata")):
        raise ConversionError(f"{ckpt_dir!r} has no .metadata: the Megatron dist checkpoint is incomplete")
    try:
        md = dcp.FileSystemReader(ckpt_dir).read_metadata()
    except Exception as e:
        raise ConversionError(f"{ckpt_dir}/.metadata is unreadable: {e}") from None
    return {v.relative_path for v in md.storage_data.values()}


def load_megatron_checkpoint(model: torch.nn.Module, ckpt_dir: str) -> None:
    """Load a dist checkpoint (saved at any TP/PP) into this rank's model; refuses partial checkpoints.

    A critic's `value_head.*` may be absent (an actor checkpoint): it then keeps its initial (zero) value. Every
    other tensor the model has must be in the checkpoint.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from torch.distributed.checkpoint.api import CheckpointException

    sharded = model.sharded_state_dict()
    try:
        # Megatron's "unexpected" = asked for by the model but absent from the checkpoint (a partial or foreign
        # checkpoint); keys only the checkpoint has (e.g. optimizer state) are fine.
        state, _, unexpected = dist_checkpointing.load(sharded, ckpt_dir, strict=StrictHandling.RETURN_UNEXPECTED)
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        raise ConversionError(f"loading {ckpt_dir!r} failed (incomplete checkpoint, or a different model?): "
                              f"{type(e).__name__}: {str(e)[-2000:]}") from None
    lacking = sorted(k for k in unexpected if not _is_fresh(k))
    if lacking:
        raise ConversionError(f"{ckpt_dir!r} lacks tensors this model needs: {lacking[:8]} (a different "
                              "model, or a partial checkpoint)")
    # `state` has every key of the model's state dict (`_extra_state` entries included) except a value head the
    # checkpoint lacks, so only those may be missing.
    result = model.load_state_dict(state, strict=False)
    bad = sorted(k for k in result.missing_keys if not _is_fresh(k)) + sorted(result.unexpected_keys)
    if bad:
        raise ConversionError(f"loading {ckpt_dir!r}: state dict mismatch {bad[:8]}")


def write_hf_dir(model: torch.nn.Module, mapping: ModelFamily, hf_src_dir: str, out_dir: str, dtype: torch.dtype, *,
                 overwrite: bool = False, progress: bool = False) -> None:
    """Write a loaded (bare) Megatron model as an HF safetensors dir; every rank calls it. The one gather path of
    megatron_to_hf and of the trainers' end-of-run export (trainer/roles.py Policy.export_hf): config and tokenizer
    files from `hf_src_dir`.

    One safetensors file per pipeline stage, written by the stage's first TP rank of DP replica 0; only it keeps the
    stage's tensors on the host, and other DP replicas (the same weights) do not gather. Rank 0 adds the index."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from safetensors.torch import save_file

    rank, pp = dist.get_rank(), ps.get_pipeline_model_parallel_world_size()
    role = export_role(ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank())
    writer = role == "write"
    tensors = {} if role == "skip" else host_tensors(gather_hf_weights(model, mapping, progress=progress),
                                                     dtype, keep=writer)
    if role == "skip" and ps.get_expert_model_parallel_world_size() > 1 and ps.get_expert_data_parallel_rank() == 0:
        # This DP replica holds other experts than replica 0: it joins the expert all-gathers, keeps nothing.
        host_tensors(gather_hf_weights(model, mapping, weights=expert_weights(model)), dtype, keep=False)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    fname = "model.safetensors" if pp == 1 else f"model-{pp_rank + 1:05d}-of-{pp:05d}.safetensors"
    if rank == 0:
        if overwrite and os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.makedirs(out_dir, exist_ok=True)
    dist.barrier()
    if writer:
        save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    written = [None] * dist.get_world_size()
    dist.all_gather_object(written, (fname, sorted(tensors), nbytes) if writer else None)
    if rank == 0:
        if pp > 1:
            stages = [w for w in written if w is not None]
            weight_map = {n: f for f, ns, _ in stages for n in ns}
            index = {"metadata": {"total_size": sum(b for _, _, b in stages)},
                     "weight_map": dict(sorted(weight_map.items()))}
            with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
        finish_hf_dir(hf_src_dir, out_dir, dtype)
    dist.barrier()


def finish_hf_dir(hf_src_dir: str, out_dir: str, dtype: torch.dtype) -> None:
    """Complete an HF directory whose safetensors are written: config and tokenizer files copied from `hf_src_dir`,
    the config's dtype set to the one the tensors were saved in."""
    for name in HF_AUX_FILES:
        if os.path.isfile(os.path.join(hf_src_dir, name)):
            shutil.copy2(os.path.join(hf_src_dir, name), os.path.join(out_dir, name))
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["dtype"] = str(dtype).replace("torch.", "")
    cfg.pop("torch_dtype", None)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)

