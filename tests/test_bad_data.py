"""Bad data and bad model directories are one `error:` line and exit 2 before a model is built (never a traceback
after the heavy start-up): schema problems from the parquet footers before torch loads, token lengths and the
tokenizer right after the tokenizer loads."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_searchr1.data.qa import make_row, write_rows
from tests.dist_utils import REPO
from tests.rl_fixtures import child_env


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megatron_searchr1.models.tiny import TinyModelConfig, make_tiny_model

    out = str(tmp_path_factory.mktemp("badmodel") / "tiny")
    make_tiny_model(TinyModelConfig(output_dir=out, vocab_size=300, hidden_size=64, intermediate_size=64,
                                    num_layers=2, num_heads=2, num_kv_heads=2))
    return out


def _good(path, question="who founded acme"):
    write_rows([make_row(question, ["Bo"], "nq", "train", 0, uid="nq-train-0")], str(path))
    return str(path)


def _run_train(model: str, train: str, val: str, out, *extra: str, timeout: float = 120):
    args = [f"model.path={model}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
            "data.train_batch_size=1", "algo.ppo_mini_batch_size=1", "rollout.engine=hf",
            "retrieval.launch=true", "retrieval.server_args=[--index-dir,/nonexistent]", f"trainer.output_dir={out}",
            *extra]
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "megatron_searchr1.train", *args], cwd=REPO, capture_output=True,
                          text=True, env=child_env(), timeout=timeout)
    return proc, time.time() - start


def _one_error_line(proc) -> str:
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    return lines[0]


def _write_bad(kind: str, path) -> None:
    if kind == "empty":  # the right schema, no row
        write_rows([], str(path))
    elif kind == "not_parquet":
        path.write_text("question,answer\nwho,bo\n")
    elif kind == "no_reward_model":
        pq.write_table(pa.table({"prompt": [[{"role": "user", "content": "q"}]], "data_source": ["nq"]}), str(path))
    elif kind == "reward_model_not_struct":
        pq.write_table(pa.table({"prompt": [[{"role": "user", "content": "q"}]], "data_source": ["nq"],
                                 "reward_model": ["Bo"]}), str(path))
    elif kind == "prompt_not_messages":  # the schema is right, the rows are not (passed the check, failed 9 s later)
        pq.write_table(pa.table({"prompt": [["q"]], "data_source": ["nq"],
                                 "reward_model": [{"ground_truth": {"target": ["Bo"]}}]}), str(path))


SCHEMA_CASES = {"empty": "has no rows", "not_parquet": "is not a readable parquet file",
                "no_reward_model": "lacks column(s) ['reward_model']",
                "reward_model_not_struct": "reward_model must be a struct with a ground_truth field",
                "prompt_not_messages": "row 0 has a prompt that is ['q']; the prompt column must hold a list of chat "
                                       "messages"}


@pytest.mark.parametrize("kind", sorted(SCHEMA_CASES))
def test_bad_parquet_is_one_line_before_torch(tmp_path, kind):
    """Footer checks run before the retriever and torch: a config whose model dir is only a config.json is enough
    (no model is ever loaded), and the answer comes in seconds."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_attention_heads": 2, "num_hidden_layers": 2}))
    bad = tmp_path / "train.parquet"
    _write_bad(kind, bad)
    proc, elapsed = _run_train(str(model), str(bad), _good(tmp_path / "val.parquet"), tmp_path / "out",
                               timeout=60)
    line = _one_error_line(proc)
    assert f"data.train_files: {bad}" in line and SCHEMA_CASES[kind] in line, line
    assert elapsed < 15, f"{elapsed:.1f}s: the data must be checked before torch loads"
    assert not (tmp_path / "out").exists()


def test_a_bad_validation_file_is_named_too(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_attention_heads": 2, "num_hidden_layers": 2}))
    bad = tmp_path / "val.parquet"
    _write_bad("no_reward_model", bad)
    proc, _ = _run_train(str(model), _good(tmp_path / "train.parquet"), str(bad), tmp_path / "out", timeout=60)
    assert f"data.val_files: {bad} lacks column(s) ['reward_model']" in _one_error_line(proc)


def test_prompts_all_over_the_budget_stop_before_the_models(tmp_path, model_dir):
    """Every prompt longer than data.max_prompt_length: the error names the longest prompt and the field, and comes
    from the data step (no process group, no model, no server was started: the server args point nowhere)."""
    long_q = "what is " + "very " * 60 + "long"
    train = _good(tmp_path / "train.parquet", long_q)
    proc, _ = _run_train(model_dir, train, _good(tmp_path / "val.parquet"), tmp_path / "out",
                         "data.max_prompt_length=40")
    line = _one_error_line(proc)
    assert "data.train_files: no usable prompt" in line and "data.max_prompt_length=40" in line, line
    assert "the longest has" in line and "raise data.max_prompt_length" in line
    assert f"data: {train}: 1 rows, 1 dropped (1 longer than data.max_prompt_length=40" in proc.stdout


def test_a_model_dir_without_tokenizer_files_is_refused(tmp_path, model_dir):
    import shutil

    bare = tmp_path / "no_tokenizer"
    bare.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(f"{model_dir}/{name}", bare / name)
    proc, _ = _run_train(str(bare), _good(tmp_path / "train.parquet"), _good(tmp_path / "val.parquet"),
                         tmp_path / "out")
    line = _one_error_line(proc)
    assert f"model.path={bare} has no tokenizer files" in line, line


def test_an_unknown_sft_dataset_name_lists_the_known_ones_before_torch(tmp_path, model_dir):
    """data.datasets names a dataset dataset_info.json lacks: one line with the names it has, from the SFT entry's
    pre-torch check (seconds), not an SFTDataError traceback after the model is built."""
    (tmp_path / "a.jsonl").write_text(json.dumps({"instruction": "q", "output": "a"}) + "\n")
    (tmp_path / "dataset_info.json").write_text(json.dumps({"alpha": {"file_name": "a.jsonl"},
                                                            "beta": {"file_name": "a.jsonl"}}))
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "megatron_searchr1.sft", f"model.path={model_dir}",
                           f"data.dataset_dir={tmp_path}", "data.datasets=[alpha,mine]",
                           f"trainer.output_dir={tmp_path / 'out'}"], cwd=REPO, capture_output=True, text=True,
                          env=child_env(), timeout=120)
    line = _one_error_line(proc)
    assert f"data.datasets: unknown SFT dataset(s) 'mine'; {tmp_path / 'dataset_info.json'} defines 'alpha', 'beta'" \
        in line, line
    assert time.time() - start < 15, "the names must be checked before torch loads"
    assert not (tmp_path / "out").exists()
    # the held-out sets too: before, a wrong name there surfaced as a traceback once the model was built
    proc = subprocess.run([sys.executable, "-m", "megatron_searchr1.sft", f"model.path={model_dir}",
                           f"data.dataset_dir={tmp_path}", "data.datasets=[alpha]", "data.val_datasets=[held]",
                           f"trainer.output_dir={tmp_path / 'out'}"], cwd=REPO, capture_output=True, text=True,
                          env=child_env(), timeout=120)
    assert "data.val_datasets: unknown SFT dataset(s) 'held'" in _one_error_line(proc)
    assert not (tmp_path / "out").exists()


def test_an_unknown_data_source_is_refused_before_torch(tmp_path):
    """A data_source the reward registry cannot score (prepare_qa_data's `mine=PATH`) would fail every rank at its
    first reward, after the whole start-up: the pre-torch data check reads the column and names the source and the
    known ones."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_attention_heads": 2, "num_hidden_layers": 2}))
    bad = tmp_path / "train.parquet"
    write_rows([make_row("who founded acme", ["Bo"], "nq", "train", 0, uid="nq-train-0"),
                make_row("who runs acme", ["Al"], "mine", "train", 0, uid="mine-train-0")], str(bad))
    proc, elapsed = _run_train(str(model), str(bad), _good(tmp_path / "val.parquet"), tmp_path / "out", timeout=60)
    line = _one_error_line(proc)
    assert f"data.train_files: {bad}: no reward for data_source 'mine'; known: nq, triviaqa" in line, line
    assert "synthetic_<h>hop" in line and "tools/prepare_qa_data.py" in line
    assert elapsed < 15, f"{elapsed:.1f}s: the data must be checked before torch loads"


def test_evaluation_does_not_need_the_train_files(tmp_path, model_dir):
    """tools/evaluate.py sets trainer.val_only: the recipe's data.train_files (the CPU demo's, absent here) are not
    read by any check. The run gets past the config and data checks to the retrieval check (a closed port here),
    which is the next pre-torch step, so the error is about the server, not the train file."""
    import socket

    with socket.socket() as s:  # a free loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    missing = tmp_path / "absent" / "train.parquet"
    proc = subprocess.run([sys.executable, "-m", "megatron_searchr1.evaluate", "examples/grpo_tiny_cpu.yaml",
                           f"model.path={model_dir}", "model.megatron_ckpt=", "parallel.tp=1", f"data.train_files=[{missing}]",
                           f"data.val_files=[{_good(tmp_path / 'val.parquet')}]", "retrieval.launch=false",
                           f"retrieval.url=http://127.0.0.1:{port}/retrieve", f"trainer.output_dir={tmp_path / 'out'}"],
                          cwd=REPO, capture_output=True, text=True, env=child_env(), timeout=120)
    line = _one_error_line(proc)
    assert f"the retrieval server at http://127.0.0.1:{port}/retrieve does not answer" in line, line
    assert "train.parquet" not in line


def test_a_truncated_safetensors_under_model_path_is_the_converters_one_line(tmp_path, model_dir):
    """The converter refused this directory in one line; the trainer's ranks crashed with SafetensorError after the
    whole start-up. The config check runs the converter's check (headers and sizes) before torch loads."""
    import shutil

    cut = tmp_path / "cut_model"
    shutil.copytree(model_dir, cut)
    weights = cut / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size - 1000)
    proc, elapsed = _run_train(str(cut), _good(tmp_path / "train.parquet"), _good(tmp_path / "val.parquet"),
                               tmp_path / "out")
    line = _one_error_line(proc)
    assert f"model.path={cut}: {weights} has {size - 1000} bytes but its tensors need {size}" in line, line
    assert "truncated or corrupt: copy or download it again" in line
    assert elapsed < 15, f"{elapsed:.1f}s: the weights must be checked before torch loads"
    assert not (tmp_path / "out").exists()
