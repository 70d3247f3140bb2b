"""The converters' checks that run before torch loads (models/hf_files.py, models/convert_cli.py): every broken input
or flag that the files alone reveal is one `error:` line naming the file or flag, exit code 2, within a few seconds,
from the real scripts with torch made unimportable (a check that ran after torch loads would be an ImportError).

Also: the torch-free copies (architecture table, parallel-size rules, checkpoint metadata names) agree with what
models/families, models/config.check_parallel_sizes and models/convert.py decide.
"""
import itertools
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

from megatron_searchr1.cli import UsageError
from megatron_searchr1.models import hf_files
from tests.checkpoints_convert.cli_utils import HF_TO_MEGATRON, MEGATRON_TO_HF, tiny
from tests.dist_utils import REPO


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return pathlib.Path(tiny(tmp_path_factory.mktemp("fast") / "qwen2"))


@pytest.fixture
def bare_seconds():
    """How long a bare interpreter takes to start here now (the machine may be busy: the bound scales with it)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    return time.perf_counter() - t0


def run_without_torch(script, args, env=None):
    """(exit code, stderr, seconds) of `python script args` with `import torch` failing."""
    code = ("import runpy, sys; sys.modules['torch'] = None; sys.modules['megatron'] = None\n"
            f"sys.argv = [{str(script)!r}, *{[str(a) for a in args]!r}]\n"
            f"runpy.run_path({str(script)!r}, run_name='__main__')")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), "WORLD_SIZE": "1", **(env or {})})
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - t0


def fails_fast(script, args, *needles, bare=0.0, env=None):
    rc, out, seconds = run_without_torch(script, args, env)
    assert rc == 2, out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out
    for needle in needles:
        assert needle in lines[0], lines[0]
    # importing torch alone takes seconds, megatron ten or more; an unloaded machine answers in about half a second
    assert seconds < 4.0 + 3 * bare, f"{seconds:.1f}s to fail (python itself: {bare:.1f}s)"
    return lines[0]


def copy_with(src, dst, config=None, drop=(), extra=None):
    """A copy of model dir `src` with config.json changed (`config`: dict of updates, or text), files dropped."""
    shutil.copytree(src, dst)
    for name in drop:
        os.unlink(os.path.join(dst, name))
    if isinstance(config, str):
        (dst / "config.json").write_text(config)
    elif config:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    for name, text in (extra or {}).items():
        (dst / name).write_text(text)
    return dst


# ---- hf_to_megatron ------------------------------------------------------------------------------------------------

def test_config_json_missing_corrupt_or_not_an_object(hf_dir, tmp_path, bare_seconds):
    out = tmp_path / "out"
    gone = copy_with(hf_dir, tmp_path / "gone", drop=["config.json"])
    fails_fast(HF_TO_MEGATRON, ["--hf-dir", gone, "--out-dir", out], f"--hf-dir '{gone}' has no config.json",
               "save_pretrained", bare=bare_seconds)
    cut = copy_with(hf_dir, tmp_path / "cut", config='{"architectures": ["Qwen2ForCausalLM"], "num_attention')
    fails_fast(HF_TO_MEGATRON, ["--hf-dir", cut, "--out-dir", out], f"{cut}/config.json is not valid JSON",
               bare=bare_seconds)
    listed = copy_with(hf_dir, tmp_path / "list", config="[1, 2]")
    fails_fast(HF_TO_MEGATRON, ["--hf-dir", listed, "--out-dir", out], "holds a JSON list, not an object",
               bare=bare_seconds)
    fields = copy_with(hf_dir, tmp_path / "fields", config={"num_attention_heads": "four"})
    fails_fast(HF_TO_MEGATRON, ["--hf-dir", fields, "--out-dir", out], "num_attention_heads='four' must be a positive",
               bare=bare_seconds)


def test_unsupported_architecture(hf_dir, tmp_path, bare_seconds):
    gemma = copy_with(hf_dir, tmp_path / "gemma", config={"architectures": ["GemmaForCausalLM"], "model_type": "gemma"})
    fails_fast(HF_TO_MEGATRON, ["--hf-dir", gemma, "--out-dir", tmp_path / "out"], "GemmaForCausalLM",
               "Qwen2ForCausalLM", "LlamaForCausalLM", bare=bare_seconds)
    # no architectures listed: the model_type decides, as families.get_family does
    typed = copy_with(hf_dir, tmp_path / "typed", config={"architectures": [], "model_type": "gemma"})
    fails_fast(HF_TO_MEGATRON, ["--hf-dir", typed, "--out-dir", tmp_path / "out"], "['gemma']", bare=bare_seconds)


@pytest.mark.parametrize("flags, needles", [
    (["--tp", "3"], ["TP=3 does not divide num_attention_heads=4", "TP=3 does not divide intermediate_size=64"]),
    (["--pp", "3"], ["PP=3 does not divide num_hidden_layers=2", "choose a --pp"]),
    (["--ep", "2"], ["EP=2 needs a mixture-of-experts model", "drop --ep"]),
    (["--tp", "2"], ["world size 1 is not a multiple of tp*pp=2",
                     "torchrun --nproc_per_node 2 checkpoints_convert/hf_to_megatron.py"]),
])
def test_parallel_sizes_against_the_model_and_the_world(hf_dir, tmp_path, bare_seconds, flags, needles):
    fails_fast(HF_TO_MEGATRON, ["--hf-dir", hf_dir, "--out-dir", tmp_path / "out", *flags], "config.json", *needles,
               bare=bare_seconds)


def test_expert_parallel_against_an_moe_config(tmp_path, bare_seconds):
    moe = tmp_path / "moe"
    moe.mkdir()
    (moe / "config.json").write_text(json.dumps(dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, num_hidden_layers=2, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32)))
    fails_fast(HF_TO_MEGATRON, ["--hf-dir", moe, "--out-dir", tmp_path / "out", "--ep", "4"],
               "EP=4 does not divide num_experts=6", "--ep 1", bare=bare_seconds)
    # under torchrun's world of 4 the layout fits: the next check (tokenizer files) is what stops it
    fails_fast(HF_TO_MEGATRON, ["--hf-dir", moe, "--out-dir", tmp_path / "out", "--ep", "2", "--tp", "2"],
               "has no tokenizer files", bare=bare_seconds, env={"WORLD_SIZE": "4"})


def test_tokenizer_config_alone_is_no_tokenizer(hf_dir, tmp_path, bare_seconds):
    """transformers turns a lone tokenizer_config.json into a tokenizer of its added tokens: every text encodes to
    [], so such a directory must be refused, not converted."""
    only_cfg = copy_with(hf_dir, tmp_path / "only_cfg", drop=["tokenizer.json", "chat_template.jinja"])
    assert (only_cfg / "tokenizer_config.json").is_file()
    fails_fast(HF_TO_MEGATRON, ["--hf-dir", only_cfg, "--out-dir", tmp_path / "out"], "has no tokenizer files",
               "tokenizer.save_pretrained", bare=bare_seconds)
    cut = copy_with(hf_dir, tmp_path / "cut_tok")
    text = (cut / "tokenizer.json").read_text()
    (cut / "tokenizer.json").write_text(text[: len(text) // 2])
    fails_fast(HF_TO_MEGATRON, ["--hf-dir", cut, "--out-dir", tmp_path / "out"], f"{cut}/tokenizer.json is not valid "
               "JSON", bare=bare_seconds)


def test_a_shard_listed_in_the_index_but_missing(hf_dir, tmp_path, bare_seconds):
    sharded = copy_with(hf_dir, tmp_path / "sharded")
    os.rename(sharded / "model.safetensors", sharded / "model-00001-of-00002.safetensors")
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    fails_fast(HF_TO_MEGATRON, ["--hf-dir", sharded, "--out-dir", tmp_path / "out"],
               "model-00002-of-00002.safetensors listed in model.safetensors.index.json are missing", bare=bare_seconds)


def test_output_directory_that_cannot_be_written(hf_dir, tmp_path, bare_seconds):
    full = tmp_path / "full"
    full.mkdir()
    (full / "something").write_text("x")
    fails_fast(HF_TO_MEGATRON, ["--hf-dir", hf_dir, "--out-dir", full], "is not empty", "--overwrite",
               bare=bare_seconds)
    fails_fast(HF_TO_MEGATRON, ["--hf-dir", hf_dir, "--out-dir", hf_dir, "--overwrite"], "is the input directory",
               bare=bare_seconds)
    fails_fast(HF_TO_MEGATRON, ["--hf-dir", hf_dir, "--out-dir", hf_dir / "config.json" / "sub"],
               f"{hf_dir}/config.json is a file", bare=bare_seconds)
    # /proc takes no new files, also for root (whose permission bits say nothing)
    fails_fast(HF_TO_MEGATRON, ["--hf-dir", hf_dir, "--out-dir", "/proc/searchr1_out"],
               "--out-dir '/proc/searchr1_out' is not writable", bare=bare_seconds)


# ---- megatron_to_hf ------------------------------------------------------------------------------------------------

def fake_checkpoint(root, hf_dir, meta=None, drop=()):
    """A directory with the files check_checkpoint_files reads (no tensors: those are convert.py's to check)."""
    root.mkdir()
    (root / "hf").mkdir()
    shutil.copy(hf_dir / "config.json", root / "hf" / "config.json")
    for name in (".metadata", "metadata.json"):
        (root / name).write_text("{}")
    (root / "searchr1_checkpoint.json").write_text(
        meta if isinstance(meta, str) else json.dumps(meta or {"format": "megatron_searchr1.model_checkpoint"}))
    for name in drop:
        os.unlink(root / name)
    return root


def test_megatron_to_hf_checks_the_checkpoint_files(hf_dir, tmp_path, bare_seconds):
    out = tmp_path / "out"
    fails_fast(MEGATRON_TO_HF, ["--ckpt-dir", hf_dir, "--out-dir", out], "has no searchr1_checkpoint.json",
               "convert the model again", bare=bare_seconds)
    bad = fake_checkpoint(tmp_path / "bad", hf_dir, meta='{"format": ')
    fails_fast(MEGATRON_TO_HF, ["--ckpt-dir", bad, "--out-dir", out], "searchr1_checkpoint.json is not valid JSON",
               bare=bare_seconds)
    other = fake_checkpoint(tmp_path / "other", hf_dir, meta={"format": "something"})
    fails_fast(MEGATRON_TO_HF, ["--ckpt-dir", other, "--out-dir", out], "format 'something'", bare=bare_seconds)
    partial = fake_checkpoint(tmp_path / "partial", hf_dir, drop=[".metadata"])
    fails_fast(MEGATRON_TO_HF, ["--ckpt-dir", partial, "--out-dir", out], "has no .metadata", "incomplete",
               bare=bare_seconds)
    no_cfg = fake_checkpoint(tmp_path / "no_cfg", hf_dir, drop=["hf/config.json"])
    fails_fast(MEGATRON_TO_HF, ["--ckpt-dir", no_cfg, "--out-dir", out], "has no hf/config.json", bare=bare_seconds)
    good = fake_checkpoint(tmp_path / "good", hf_dir)
    fails_fast(MEGATRON_TO_HF, ["--ckpt-dir", good, "--out-dir", out, "--tp", "2"],
               "torchrun --nproc_per_node 2 checkpoints_convert/megatron_to_hf.py", bare=bare_seconds)
    fails_fast(MEGATRON_TO_HF, ["--ckpt-dir", good, "--out-dir", "/proc/searchr1_out"], "is not writable",
               bare=bare_seconds)


# ---- the torch-free copies agree with the torch side ------------------------------------------------------------

def test_read_json_object_names_the_file_and_ends_in_the_callers_remedy(tmp_path):
    """Both converters read their JSON (config.json, the checkpoint's metadata) through one helper; each message
    names the file and ends in the remedy its caller gave."""
    good, cut, listed = tmp_path / "good.json", tmp_path / "cut.json", tmp_path / "list.json"
    good.write_text('{"a": 1}')
    cut.write_text('{"a": ')
    listed.write_text("[1]")
    assert hf_files.read_json_object(str(good), "x") == {"a": 1}
    with pytest.raises(UsageError, match=rf"^{cut} is not valid JSON \(.*\): convert the model again$"):
        hf_files.read_json_object(str(cut), "convert the model again")
    with pytest.raises(UsageError, match=rf"^{listed} holds a JSON list, not an object: copy it again$"):
        hf_files.read_json_object(str(listed), "copy it again")
    with pytest.raises(UsageError, match=rf"^{tmp_path} cannot be read \(.*\): check its permissions or copy it"):
        hf_files.read_json_object(str(tmp_path), "copy it again")  # a directory: open() raises an OSError


def test_architecture_table_matches_the_families():
    from megatron_searchr1.models.families import FAMILIES

    assert hf_files.ARCHITECTURES == {f.architectures[0]: f.model_types[0] for f in FAMILIES}


def test_checkpoint_metadata_names_match_the_converter():
    from megatron_searchr1.models import convert, convert_cli

    assert (convert_cli.META_FILE, convert_cli.HF_SUBDIR, convert_cli.META_FORMAT) == \
        (convert.META_FILE, convert.HF_SUBDIR, convert.META_FORMAT)


def _tiny_configs():
    from megatron_searchr1.models.tiny import TinyModelConfig, build_hf_config

    for arch, heads, kv, ffn, layers in [("qwen2", 4, 2, 64, 2), ("qwen2", 6, 3, 96, 3), ("llama", 8, 8, 48, 4),
                                         ("qwen3_moe", 4, 2, 64, 2), ("qwen2_moe", 4, 1, 48, 4)]:
        cfg = TinyModelConfig(output_dir="unused", arch=arch, num_heads=heads, num_kv_heads=kv, hidden_size=32 * heads,
                              intermediate_size=ffn, num_layers=layers, num_experts=6, moe_intermediate_size=32)
        yield build_hf_config(cfg, vocab_size=64, pad_id=0, eos_id=1)


def test_parallel_fit_agrees_with_check_parallel_sizes():
    """Over a grid of models, sizes and worlds, the torch-free rules accept exactly what the converter's
    check_parallel_sizes (with expert TP = TP, as the converter builds) accepts."""
    from megatron_searchr1.models.config import check_parallel_sizes

    checked = 0
    for config in _tiny_configs():
        raw = config.to_dict()
        for tp, pp, ep, world in itertools.product((1, 2, 3, 4), (1, 2, 3), (1, 2, 3), (1, 4, 6, 12)):
            try:
                check_parallel_sizes(config, tp, pp, world_size=world, ep=ep, expert_tp=tp)
                torch_side = None
            except ValueError as e:
                torch_side = str(e)
            try:
                hf_files.check_parallel_fit(raw, tp, pp, ep, world)
                fast = None
            except UsageError as e:
                fast = str(e)
            assert (torch_side is None) == (fast is None), (raw["architectures"], tp, pp, ep, world, torch_side, fast)
            checked += 1
    assert checked == 5 * 4 * 3 * 3 * 4
