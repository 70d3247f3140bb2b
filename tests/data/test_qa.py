"""FlashRAG QA files -> Search-R1 parquet: exact schema, normalised questions, uids unique across merged sources."""
import json
import os
import subprocess
import sys

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_searchr1.cli import UsageError
from megatron_searchr1.data import qa, qa_cli
from megatron_searchr1.data.prompts import make_prefix

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _write_jsonl(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


@pytest.fixture
def flashrag(tmp_path):
    """nq as jsonl in FlashRAG's <dir>/<name>/<split>.jsonl layout, hotpotqa as parquet (with a dev split only)."""
    root = tmp_path / "raw"
    _write_jsonl(str(root / "nq" / "train.jsonl"), [
        {"id": "train_0", "question": "  who wrote dune  ", "golden_answers": ["Frank Herbert", "Herbert"]},
        {"id": "train_1", "question": "Capital of France?", "golden_answers": ["Paris"]},
        {"id": "train_2", "question": "when did the war end", "golden_answers": "1945"},  # bare string accepted
    ])
    _write_jsonl(str(root / "nq" / "test.jsonl"), [{"id": "test_0", "question": "q test", "golden_answers": ["a"]}])
    os.makedirs(root / "hotpotqa")
    for split, n in (("train", 2), ("dev", 1)):
        frame = pd.DataFrame({"id": [f"h{split}{i}" for i in range(n)],
                              "question": [f"hotpot {split} {i}" for i in range(n)],
                              "golden_answers": [[f"ans{i}"] for i in range(n)]})
        frame.to_parquet(root / "hotpotqa" / f"{split}.parquet")
    return root


def test_round_trip_two_sources_merged(flashrag, tmp_path):
    out = tmp_path / "out"
    qa_cli.main(["--train", f"nq={flashrag}/nq/train.jsonl", str(flashrag / "hotpotqa" / "train.parquet"),
             "--out-dir", str(out)])
    table = pq.read_table(out / "train.parquet")
    assert table.schema.equals(qa.row_schema()), table.schema
    assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    rows = table.to_pylist()
    assert [r["data_source"] for r in rows] == ["nq"] * 3 + ["hotpotqa"] * 2  # name from the FlashRAG folder
    first = rows[0]
    assert first["prompt"] == [{"role": "user", "content": make_prefix("who wrote dune?")}]
    assert first["ability"] == "fact-reasoning"
    assert first["reward_model"] == {"style": "rule", "ground_truth": {"target": ["Frank Herbert", "Herbert"]}}
    assert first["extra_info"] == {"split": "train", "index": 0, "uid": "nq-train-0", "id": "train_0",
                                   "question": "who wrote dune?"}
    questions = [r["extra_info"]["question"] for r in rows]
    assert all(q.endswith("?") and q == q.strip() for q in questions)
    assert questions[1] == "Capital of France?"  # no second '?'
    assert rows[2]["reward_model"]["ground_truth"]["target"] == ["1945"]
    # Search-R1's index restarts per source; our uid does not collide
    assert [r["extra_info"]["index"] for r in rows] == [0, 1, 2, 0, 1]
    uids = [r["extra_info"]["uid"] for r in rows]
    assert len(set(uids)) == len(uids)
    # pandas (what most trainers use) reads it back too
    df = pd.read_parquet(out / "train.parquet")
    assert list(df["data_source"]) == ["nq"] * 3 + ["hotpotqa"] * 2


def test_flashrag_dir_cli_and_chat_template(flashrag, tmp_path):
    out = tmp_path / "out"
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "prepare_qa_data.py"), "--flashrag-dir",
                    str(flashrag), "--train-sources", "nq,hotpotqa", "--test-sources", "nq,hotpotqa",
                    "--template", "chat", "--out-dir", str(out)], check=True, capture_output=True, text=True)
    train, test = (pq.read_table(out / f"{s}.parquet").to_pylist() for s in ("train", "test"))
    assert len(train) == 5
    # hotpotqa has no test file: its dev file is used, as Search-R1 does
    assert [(r["data_source"], r["extra_info"]["id"]) for r in test] == [("nq", "test_0"), ("hotpotqa", "hdev0")]
    assert [r["extra_info"]["uid"] for r in test] == ["nq-test-0", "hotpotqa-test-0"]
    assert [m["role"] for m in test[0]["prompt"]] == ["system", "user"]
    assert test[0]["prompt"][1]["content"] == "Question: q test?"


def test_missing_id_column_is_allowed(tmp_path):
    path = tmp_path / "bamboogle.jsonl"
    _write_jsonl(str(path), [{"question": "q", "golden_answers": ["a"]}])
    qa_cli.main(["--test", str(path), "--out-dir", str(tmp_path / "out")])
    (row,) = pq.read_table(tmp_path / "out" / "test.parquet").to_pylist()
    assert row["data_source"] == "bamboogle" and row["extra_info"]["id"] is None


@pytest.mark.parametrize("case, content, match", [
    ("missing_column", [{"id": "1", "question": "q"}], r"bad\.jsonl:1: missing column\(s\) \['golden_answers'\]"),
    ("bad_json", None, r"bad\.jsonl:2: not valid JSON"),
    ("empty_question", [{"question": "  ", "golden_answers": ["a"]}], r"bad\.jsonl row 0: column 'question'"),
    ("empty_answers", [{"question": "q", "golden_answers": []}], r"bad\.jsonl row 0: column 'golden_answers'"),
    ("not_object", [["q", "a"]], r"bad\.jsonl:1: expected a JSON object"),
])
def test_bad_jsonl_inputs_name_file_and_column(tmp_path, case, content, match):
    path = tmp_path / "bad.jsonl"
    if content is None:
        path.write_text('{"question": "q", "golden_answers": ["a"]}\n{"question": \n')
    else:
        _write_jsonl(str(path), content)
    with pytest.raises(UsageError, match=match):  # the CLI: one `error:` line, exit 2
        qa_cli.main(["--train", f"nq={path}", "--out-dir", str(tmp_path / "out")])
    with pytest.raises(qa.QADataError, match=match):  # the library: a ValueError naming file and line
        qa.read_flashrag(str(path))
    assert not (tmp_path / "out" / "train.parquet").exists()


def test_bad_files_and_sources(flashrag, tmp_path):
    pq.write_table(pa.table({"id": ["1"], "query": ["q"]}), tmp_path / "x.parquet")
    with pytest.raises(ValueError, match=r"x\.parquet: missing column\(s\) \['question', 'golden_answers'\]"):
        qa.read_flashrag(str(tmp_path / "x.parquet"))
    with pytest.raises(UsageError, match=r"--train: QA file '.*nope\.jsonl' \(source 'nq'\) does not exist"):
        qa_cli.main(["--train", f"nq={tmp_path}/nope.jsonl", "--out-dir", str(tmp_path / "out")])
    (tmp_path / "a.csv").write_text("question,golden_answers\n")
    with pytest.raises(ValueError, match="unsupported file type"):
        qa.read_flashrag(str(tmp_path / "a.csv"))
    with pytest.raises(UsageError, match=r"data source\(s\) \['nq'\] given twice"):
        qa_cli.main(["--train", f"nq={flashrag}/nq/train.jsonl", f"nq={flashrag}/nq/test.jsonl",
                 "--out-dir", str(tmp_path / "out")])
    with pytest.raises(UsageError, match=r"--train: source name 'mine' \(for .*train\.jsonl\) has no reward; known: "
                                         r"nq, .*synthetic_<h>hop: write NAME=PATH"):
        qa_cli.main(["--train", f"mine={flashrag}/nq/train.jsonl", "--out-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out" / "train.parquet").exists()
    with pytest.raises(UsageError, match="no FlashRAG file for source 'musique'"):
        qa_cli.main(["--flashrag-dir", str(flashrag), "--test-sources", "musique", "--out-dir", str(tmp_path / "out")])
    with pytest.raises(UsageError, match="nothing to do"):
        qa_cli.main(["--out-dir", str(tmp_path / "out")])
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(UsageError, match=r"bad\.parquet: not a readable parquet file"):
        qa_cli.main(["--test", f"nq={tmp_path}/bad.parquet", "--out-dir", str(tmp_path / "out")])


def test_the_libraries_import_no_command_line():
    """data/qa.py (and what builds on it: rl_data, oracle, synthetic) and models/tiny.py are libraries; their
    command lines are data/qa_cli.py and models/tiny_cli.py."""
    code = ("import sys\nimport megatron_searchr1.data.qa, megatron_searchr1.data.rl_data\n"
            "import megatron_searchr1.data.oracle, megatron_searchr1.data.synthetic, megatron_searchr1.models.tiny\n"
            "print(sorted(m for m in sys.modules if m == 'megatron_searchr1.cli' or m.endswith('_cli')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
