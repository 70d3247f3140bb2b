"""FlashRAG QA files -> training/validation parquet in Search-R1's schema.

Input: FlashRAG-format files (``.jsonl`` or ``.parquet``) with columns ``question``, ``golden_answers`` (a list of
strings; a bare string is accepted) and optionally ``id``. The data source name (nq, hotpotqa, ...) comes from the
command line (``nq=path``) or, for FlashRAG's ``<dir>/<name>/<split>.jsonl`` layout, from the folder name.

Output row (Search-R1's, plus ``extra_info.uid``)::

    {"data_source": "nq",
     "prompt": [{"role": "user", "content": <template applied to the question>}],
     "ability": "fact-reasoning",
     "reward_model": {"style": "rule", "ground_truth": {"target": ["answer", ...]}},
     "extra_info": {"split": "train", "index": 17, "uid": "nq-train-17", "id": "train_17", "question": "...?"}}

``index`` restarts at 0 for every source, as in Search-R1 (kept for compatibility); ``uid`` is unique across all
sources merged into one file, so GRPO groups never collide.

The command line is `data/qa_cli.py` (`searchr1-prepare-qa`, `tools/prepare_qa_data.py`).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from megatron_searchr1.data.prompts import make_prompt, normalize_question

REQUIRED_COLUMNS = ("question", "golden_answers")
SEARCH_R1_SOURCES = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
SPLIT_FILE_NAMES = ("train", "dev", "test", "validation", "val")
ABILITY = "fact-reasoning"
# Show a progress bar only when it is worth looking at.
_PROGRESS_MIN_ROWS = 20_000

# Explicit arrow schema: the same types whatever the first row looks like (an empty `id` column would otherwise
# become null-typed, and the trainer would see different schemas for different files).
MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string())])
REWARD_MODEL_TYPE = pa.struct(
    [("style", pa.string()), ("ground_truth", pa.struct([("target", pa.list_(pa.string()))]))]
)
QA_EXTRA_INFO_TYPE = pa.struct(
    [("split", pa.string()), ("index", pa.int64()), ("uid", pa.string()), ("id", pa.string()),
     ("question", pa.string())]
)


def row_schema(extra_info_type: pa.DataType = QA_EXTRA_INFO_TYPE) -> pa.Schema:
    """Arrow schema of one Search-R1 row; the synthetic world passes a richer `extra_info` struct."""
    return pa.schema(
        [("data_source", pa.string()), ("prompt", pa.list_(MESSAGE_TYPE)), ("ability", pa.string()),
         ("reward_model", REWARD_MODEL_TYPE), ("extra_info", extra_info_type)]
    )


class QADataError(ValueError):
    """A QA input file that cannot be used as given (bad JSON, missing columns, ...); the message names the file,
    the line or row, and what is expected."""


@dataclass
class SourceFile:
    """One input file and the data source name its rows get."""

    name: str
    """data_source value (nq, hotpotqa, ...); also the prefix of `extra_info.uid`."""
    path: str
    """a FlashRAG .jsonl or .parquet file."""


def source_name_from_path(path: str) -> str:
    """`raw/nq/test.jsonl` -> `nq` (FlashRAG layout); `raw/bamboogle.jsonl` -> `bamboogle`."""
    stem = os.path.basename(path).split(".")[0]
    if stem in SPLIT_FILE_NAMES:
        parent = os.path.basename(os.path.dirname(os.path.abspath(path)))
        if parent:
            return parent
    return stem


def parse_source_spec(spec: str) -> SourceFile:
    """`nq=path/to/file.jsonl` or just a path (name from the path)."""
    if "=" in spec and not os.path.exists(spec):
        name, path = spec.split("=", 1)
        if not name:
            raise QADataError(f"source spec {spec!r} has an empty name; write NAME=PATH, e.g. nq=raw/nq/train.jsonl")
    else:
        name, path = source_name_from_path(spec), spec
    return SourceFile(name=name, path=path)


def read_flashrag(path: str) -> list[dict]:
    """Read a FlashRAG QA file into dicts with `question`, `golden_answers` (list[str]) and `id` (str or None).

    Errors name the file, and the line or column, so the user knows what to fix.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"QA file {path!r} does not exist")
    if path.endswith(".parquet"):
        try:
            table = pq.read_table(path)
        except pa.ArrowException as err:
            raise QADataError(f"{path}: not a readable parquet file ({err})") from None
        missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
        if missing:
            raise QADataError(
                f"{path}: missing column(s) {missing}; FlashRAG QA files need {list(REQUIRED_COLUMNS)} "
                f"(found {table.column_names})"
            )
        records = table.to_pylist()
    elif path.endswith(".jsonl") or path.endswith(".json"):
        records = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as err:
                    raise QADataError(f"{path}:{lineno}: not valid JSON ({err.msg}); expected one object per line")
                if not isinstance(rec, dict):
                    raise QADataError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
                missing = [c for c in REQUIRED_COLUMNS if c not in rec]
                if missing:
                    raise QADataError(f"{path}:{lineno}: missing column(s) {missing} (found {sorted(rec)})")
                records.append(rec)
    else:
        raise QADataError(f"{path}: unsupported file type; give a FlashRAG .jsonl or .parquet file")
    out = []
    for i, rec in enumerate(records):
        where = f"{path} row {i}"
        question, answers = rec["question"], rec["golden_answers"]
        if not isinstance(question, str) or not question.strip():
            raise QADataError(f"{where}: column 'question' must be a non-empty string, got {question!r}")
        if isinstance(answers, str):
            answers = [answers]
        if not isinstance(answers, (list, tuple)) or not answers or not all(isinstance(a, str) for a in answers):
            raise QADataError(f"{where}: column 'golden_answers' must be a non-empty list of strings, got {answers!r}")
        rid = rec.get("id")
        out.append({"question": question, "golden_answers": list(answers), "id": None if rid is None else str(rid)})
    return out


def make_row(question: str, answers: list[str], data_source: str, split: str, index: int, uid: str,
             template: str = "base", extra: dict | None = None) -> dict:
    """One Search-R1 parquet row. `extra` adds fields to `extra_info` (the synthetic world's hops and chain)."""
    question = normalize_question(question)
    extra_info = {"split": split, "index": index, "uid": uid, "question": question}
    extra_info.update(extra or {})
    return {
        "data_source": data_source,
        "prompt": make_prompt(question, template),
        "ability": ABILITY,
        "reward_model": {"style": "rule", "ground_truth": {"target": list(answers)}},
        "extra_info": extra_info,
    }


def build_split(sources: list[SourceFile], split: str, template: str = "base") -> list[dict]:
    """Rows of one split, sources concatenated in the given order; uid = `<source>-<split>-<index>`."""
    names = [s.name for s in sources]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise QADataError(f"{split}: data source(s) {dups} given twice; their uids would collide. Give each once.")
    rows = []
    for src in sources:
        records = read_flashrag(src.path)
        it = tqdm(records, desc=f"{split}/{src.name}", disable=len(records) < _PROGRESS_MIN_ROWS)
        for idx, rec in enumerate(it):
            rows.append(make_row(rec["question"], rec["golden_answers"], src.name, split, idx,
                                 uid=f"{src.name}-{split}-{idx}", template=template, extra={"id": rec["id"]}))
    return rows


def plain(obj):
    """A parquet row as plain python: numpy arrays (how pyarrow/pandas hand back lists) become lists, recursively.

    >>> import numpy as np; plain({"target": np.array(["a", "b"]), "n": [np.array([1])]})
    {'target': ['a', 'b'], 'n': [[1]]}
    """
    if hasattr(obj, "tolist"):
        obj = obj.tolist()
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj


def write_rows(rows: list[dict], path: str, extra_info_type: pa.DataType = QA_EXTRA_INFO_TYPE) -> None:
    """Write rows to parquet with an explicit schema (so every file of a run has the same types)."""
    uids = [r["extra_info"]["uid"] for r in rows]
    if len(set(uids)) != len(uids):
        raise AssertionError(f"{path}: extra_info.uid is not unique")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=row_schema(extra_info_type)), path)


def find_flashrag_file(root: str, name: str, splits: tuple[str, ...]) -> str:
    """First existing `<root>/<name>/<split>.{jsonl,parquet}` among `splits` (Search-R1 uses dev when no test)."""
    tried = []
    for split in splits:
        for ext in ("jsonl", "parquet"):
            path = os.path.join(root, name, f"{split}.{ext}")
            tried.append(path)
            if os.path.isfile(path):
                return path
    raise FileNotFoundError(f"no FlashRAG file for source {name!r}; looked for {tried}")
