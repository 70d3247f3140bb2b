"""What a Hugging Face model directory and a conversion's flags must satisfy, checked without torch: a parseable
config.json of an architecture we map, tokenizer files, whole safetensors files, TP/PP/EP sizes that fit the model
and the world, an output directory that can be written. The converters run these before torch loads (a mistake is
one `error:` line in about a second, not after the imports); the trainer's tokenizer check uses the same file list.

    config = read_config("/models/qwen2.5-3b")             # dict; UsageError naming the file and what to do
    check_architecture(config, "/models/qwen2.5-3b/config.json")
    check_parallel_fit(config, tp=2, pp=2, ep=1, world_size=4)
    check_writable_dir("/ckpt/qwen2.5-3b-mcore")
    check_hf_files("/models/qwen2.5-3b")                   # tokenizer present, every *.safetensors whole

The architecture table and the size rules repeat, for config.json dicts, what models/families and
models/config.check_parallel_sizes decide after torch loads (tests keep the two in agreement); those stay the
authority for what this module does not look at (uneven pipeline stages, RoPE and activation features).
"""
from __future__ import annotations

import json
import os
import tempfile

from megatron_searchr1 import weight_files
from megatron_searchr1.cli import UsageError

# Any one of these holds a vocabulary. tokenizer_config.json alone does not: transformers then builds a tokenizer of
# only the added special tokens, and every prompt encodes to [].
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")

# architecture -> model_type of the families models/families maps (families.SUPPORTED_ARCHITECTURES; a test keeps
# them equal). A config that lists architectures is judged by them, one that lists none by its model_type.
ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama",
                 "MistralForCausalLM": "mistral", "Qwen3MoeForCausalLM": "qwen3_moe",
                 "Qwen2MoeForCausalLM": "qwen2_moe"}


def read_json_object(path: str, remedy: str) -> dict:
    """The JSON object in `path`; a UsageError naming the file and ending in `remedy` (what the user should do, e.g.
    "copy the model's config.json again") when it cannot be read, is not JSON, or holds another JSON value."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{path} cannot be read ({e}): check its permissions or {remedy}") from None
    except ValueError as e:
        raise UsageError(f"{path} is not valid JSON ({e}): {remedy}") from None
    if not isinstance(value, dict):
        raise UsageError(f"{path} holds a JSON {type(value).__name__}, not an object: {remedy}")
    return value


def read_config(model_dir: str, flag: str = "--hf-dir") -> dict:
    """config.json of `model_dir` as a dict; a UsageError naming the file when it is missing, unreadable, not JSON
    or not a JSON object."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise UsageError(f"{flag} {model_dir!r} has no config.json: not a Hugging Face model directory (give the "
                         "directory save_pretrained wrote: config.json, *.safetensors, tokenizer files)")
    return read_json_object(path, "copy the model's config.json again")


def check_architecture(config: dict, where: str) -> str:
    """The architecture of a config.json dict (`where`: its path, for the message), or a UsageError listing the
    supported ones."""
    wanted = list(config.get("architectures") or [])
    if wanted:
        found = [a for a in wanted if a in ARCHITECTURES]
    else:
        model_type = config.get("model_type")
        wanted = [model_type] if model_type else []
        found = [a for a, t in ARCHITECTURES.items() if t == model_type]
    if not found:
        raise UsageError(f"{where}: unsupported model architecture {wanted or '(none given)'}; supported "
                         f"architectures: {', '.join(ARCHITECTURES)}")
    return found[0]


def _int_field(config: dict, key: str, where: str, default=None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{where}: {key}={value!r} must be a positive integer: copy the model's config.json again")
    return value


def check_parallel_fit(config: dict, tp: int, pp: int, ep: int = 1, world_size: int = 1,
                       where: str = "config.json", script: str = "checkpoints_convert/hf_to_megatron.py") -> None:
    """A UsageError listing every way --tp/--pp/--ep do not fit the model of a config.json dict or the world size.

    Megatron's rules, as models/config.check_parallel_sizes applies them (with the converter's expert TP = TP):
    TP divides the attention heads and the MLP width, the KV heads are a multiple of TP or divide it, PP divides
    the layers (the converter splits them evenly), EP divides the experts of an MoE model (EP > 1 needs one), and
    the world size is a multiple of TP*PP*EP (`script`: the command the torchrun line in the message runs)."""
    heads = _int_field(config, "num_attention_heads", where)
    groups = _int_field(config, "num_key_value_heads", where, default=heads)
    ffn = _int_field(config, "intermediate_size", where)
    layers = _int_field(config, "num_hidden_layers", where)
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    problems = []
    if heads % tp:
        problems.append(f"TP={tp} does not divide num_attention_heads={heads}: choose a --tp that divides it")
    if groups % tp and tp % groups:
        problems.append(f"num_key_value_heads={groups} must be a multiple of TP={tp} or divide it: choose such a --tp")
    if ffn % tp:
        problems.append(f"TP={tp} does not divide intermediate_size={ffn}: choose a --tp that divides it")
    if layers % pp:
        problems.append(f"PP={pp} does not divide num_hidden_layers={layers}: choose a --pp that divides it")
    if experts:
        if experts % ep:
            problems.append(f"EP={ep} does not divide num_experts={experts}: choose an --ep that divides it")
        moe_ffn = _int_field(config, "moe_intermediate_size", where)
        if moe_ffn % tp:
            problems.append(f"TP={tp} does not divide moe_intermediate_size={moe_ffn}: choose a --tp that divides it")
        shared = config.get("shared_expert_intermediate_size") or 0
        if shared % tp:
            problems.append(f"TP={tp} does not divide shared_expert_intermediate_size={shared}: choose a --tp that "
                            "divides it")
    elif ep > 1:
        problems.append(f"EP={ep} needs a mixture-of-experts model; this one is dense: drop --ep")
    if world_size % (tp * pp * ep):
        n = tp * pp * ep
        single = "--tp 1 --pp 1" + (" --ep 1" if ep > 1 else "")
        problems.append(f"world size {world_size} is not a multiple of tp*pp{'*ep' if ep > 1 else ''}={n}: launch with "
                        f"`torchrun --nproc_per_node {n} {script} ...` (or use {single} in one process)")
    if problems:
        raise UsageError(f"{where}: " + "; ".join(problems))


def check_writable_dir(path: str, flag: str = "--out-dir") -> None:
    """A UsageError when `path` cannot become a directory we write into: it, or the nearest part of it that
    exists, is not a directory, or a file cannot be created there (read-only filesystem, permissions). Probed by
    creating and removing a file, so it holds also for root, for whom permission bits say nothing."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        what = f"{flag} {path!r} is a file" if probe == os.path.abspath(path) else \
            f"{flag} {path!r} cannot be created: {probe} is a file"
        raise UsageError(f"{what}: give a directory path")
    try:
        fd, name = tempfile.mkstemp(prefix=".searchr1_write_check.", dir=probe)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        raise UsageError(f"{flag} {path!r} is not writable: creating a file in {probe} failed ({e.strerror}): "
                         "choose a directory you can write") from None


def check_hf_files(hf_dir: str, flag: str = "--hf-dir") -> None:
    """What can be read without torch: config.json parses, a tokenizer is there (the trainer and vLLM need it next
    to the weights), and every *.safetensors file is whole (its header parses and its tensors end inside the file;
    a copy cut short otherwise fails deep inside the reader without naming the file)."""
    read_config(hf_dir, flag)
    if not any(os.path.isfile(os.path.join(hf_dir, f)) for f in TOKENIZER_FILES):
        raise UsageError(f"{flag} {hf_dir!r} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): copy the model's "
                         "tokenizer into it (tokenizer.save_pretrained(dir)); the converted model is useless without it")
    # tokenizer.json is one JSON document: a cut copy is a tokenizer that does not load
    tok_json = os.path.join(hf_dir, "tokenizer.json")
    if os.path.isfile(tok_json):
        try:
            with open(tok_json, encoding="utf-8") as f:
                json.load(f)
        except (ValueError, UnicodeDecodeError):
            raise UsageError(f"{tok_json} is not valid JSON (truncated or corrupt): copy the model's tokenizer "
                             "again (tokenizer.save_pretrained(dir))") from None
    check_weight_files(hf_dir, flag)


def check_weight_files(hf_dir: str, flag: str = "--hf-dir", require: bool = True) -> None:
    """UsageError unless every *.safetensors file (and shard listed by the index) is whole: weight_files.py's check,
    shared with the trainer's config check."""
    try:
        weight_files.check_weight_files(hf_dir, flag, require)
    except weight_files.WeightFileError as e:
        raise UsageError(str(e)) from None


def check_safetensors(path: str) -> None:
    """UsageError naming `path` when it is not a whole safetensors file (weight_files.check_safetensors)."""
    try:
        weight_files.check_safetensors(path)
    except weight_files.WeightFileError as e:
        raise UsageError(str(e)) from None
