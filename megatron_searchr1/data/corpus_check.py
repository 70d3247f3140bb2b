"""How much of an RL parquet the corpus can answer: gold answers in the passages a retriever returns, before training.

    python tools/check_corpus.py data/mine/train.parquet --retriever http://127.0.0.1:8000 --topk 3 10

For each row the question (``extra_info.question``, else a top-level ``question``, else the text after the last
``Question:`` of the user prompt) is sent to the retriever once, at the largest requested top-k; smaller k are
prefixes of the same lists. A passage holds an answer when the answer, normalised as the EM reward normalises it
(`reward.qa_em.normalize_answer`), occurs in the normalised passage (title and text) as whole words; a short
answer (a year) that an unrelated passage also mentions counts too, so the figures are an upper bound. Per row:

- question hit at k: some gold answer (``reward_model.ground_truth.target``) is in the top-k for the question;
- chain hit at k (rows with a gold chain, ``extra_info.chain``: one ``{query, answer}`` per hop, as the synthetic
  world writes): every hop's answer is in the top-k for that hop's sub-query, so a model that searches hop by hop
  can read each bridge entity and the final answer;
- covered at k: a question hit or a chain hit. The rest are "uncovered": no search plan the data knows of finds
  the answer, so no policy can learn that row from this corpus.

The table has one line per ``data_source`` and k: rows, the three coverages, and the mean 1-based rank of the first
passage holding a gold answer for the question (over its question hits). Uncovered rows at the smallest k go to a
JSONL file with their first-hit ranks up to the largest k, so a row found at 10 but not at 3 is visible.

It talks to the server through `search.client.RetrievalClient`, so it works against our server and Search-R1's.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

from megatron_searchr1.cli import ArgumentParser, UsageError, above, at_least
from megatron_searchr1.reward.qa_em import golden_list, normalize_answer

_QUESTION_MARK = re.compile(r"Question:\s*(.*)", re.S)


# ------------------------------------------------------------------------------------------------ pure functions
def passage_text(item) -> str:
    """Title and text of one result item, in any shape the server sends: {"document": doc, "score": s}, a bare doc
    ({contents} or {title, text}), or a plain string (Search-R1's rerank server)."""
    doc = item.get("document", item) if isinstance(item, dict) else item
    if isinstance(doc, str):
        return doc
    contents = doc.get("contents")
    if contents is None:
        contents = f'{doc.get("title", "")}\n{doc.get("text", "")}'
    return contents


def first_hit(answers: list[str], passages: list[str]) -> int | None:
    """1-based rank of the first passage holding one of `answers` as whole normalised words, or None.

    >>> first_hit(["The Hague"], ["Amsterdam is a city.", "The government sits in the hague."])
    2
    >>> first_hit(["Paris"], ["Parisian cafés"]) is None
    True
    """
    needles = [f" {n} " for n in (normalize_answer(a) for a in answers) if n]
    for rank, text in enumerate(passages, start=1):
        hay = f" {normalize_answer(text)} "
        if any(n in hay for n in needles):
            return rank
    return None


def question_of(row: dict) -> str:
    """The question text of a Search-R1 row (see the module docstring for where it is looked up)."""
    extra = row.get("extra_info") or {}
    if extra.get("question"):
        return str(extra["question"])
    if row.get("question"):
        return str(row["question"])
    prompt = row.get("prompt") or []
    users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    text = users[-1] if users else ""
    match = None
    for match in _QUESTION_MARK.finditer(text):
        pass
    return (match.group(1) if match else text).strip()


@dataclass
class RowCheck:
    """What the retriever gives one row, at the largest top-k asked."""

    uid: str
    data_source: str
    question: str
    answers: list[str]
    rank: int | None
    """1-based rank of the first passage for the question that holds a gold answer (None: none in the top-k)."""
    hop_ranks: list[int | None] | None = None
    """per hop of the gold chain, the first rank holding that hop's answer; None for rows without a chain."""
    hops: list[dict] = field(default_factory=list)

    def question_hit(self, k: int) -> bool:
        return self.rank is not None and self.rank <= k

    def chain_hit(self, k: int) -> bool | None:
        if self.hop_ranks is None:
            return None
        return all(r is not None and r <= k for r in self.hop_ranks)

    def covered(self, k: int) -> bool:
        return self.question_hit(k) or bool(self.chain_hit(k))


def chain_of(row: dict) -> list[dict] | None:
    """The gold chain [{query, answer}, ...] of a row, or None when it has none."""
    chain = (row.get("extra_info") or {}).get("chain")
    if not chain:
        return None
    return [{"query": str(h["query"]), "answer": str(h["answer"])} for h in chain]


def queries_of(rows: list[dict]) -> list[str]:
    """Every distinct query to send (questions, then chain sub-queries), in first-seen order."""
    seen: dict[str, None] = {}
    for row in rows:
        seen.setdefault(question_of(row), None)
        for hop in chain_of(row) or []:
            seen.setdefault(hop["query"], None)
    return list(seen)


def check_rows(rows: list[dict], passages: dict[str, list[str]]) -> list[RowCheck]:
    """One RowCheck per row from `passages` (query -> ranked passage texts, as long as the largest top-k)."""
    out = []
    for i, row in enumerate(rows):
        extra = row.get("extra_info") or {}
        uid = str(extra.get("uid") or f"{row.get('data_source', '')}-{extra.get('split', '')}-"
                                        f"{extra.get('index', i)}")
        answers = golden_list((row["reward_model"]["ground_truth"] or {}).get("target", []))
        question = question_of(row)
        chain = chain_of(row)
        hop_ranks = None if chain is None else [first_hit([h["answer"]], passages[h["query"]]) for h in chain]
        out.append(RowCheck(uid=uid, data_source=str(row.get("data_source", "")), question=question,
                            answers=answers, rank=first_hit(answers, passages[question]), hop_ranks=hop_ranks,
                            hops=chain or []))
    return out


@dataclass
class SourceStats:
    """One line of the table: a data_source at one top-k."""

    data_source: str
    k: int
    rows: int
    question: float
    """share of rows with a question hit."""
    chain: float | None
    """share of rows with a chain, among rows that have one, whose every hop hits (None: no row has a chain)."""
    covered: float
    """share of rows with a question hit or a chain hit."""
    mean_rank: float | None
    """mean rank of the first hit over question hits (None: no hit)."""
    chained_rows: int = 0


def summarize(checks: list[RowCheck], ks: list[int]) -> list[SourceStats]:
    """SourceStats per data_source (sorted, then "all" when there are several) and k (ascending)."""
    groups: dict[str, list[RowCheck]] = {}
    for c in checks:
        groups.setdefault(c.data_source, []).append(c)
    named = sorted(groups.items())
    if len(named) > 1:
        named.append(("all", checks))
    out = []
    for name, group in named:
        for k in sorted(set(ks)):
            hits = [c.rank for c in group if c.question_hit(k)]
            chained = [c.chain_hit(k) for c in group if c.hop_ranks is not None]
            out.append(SourceStats(
                data_source=name, k=k, rows=len(group), question=len(hits) / len(group),
                chain=sum(chained) / len(chained) if chained else None,
                covered=sum(c.covered(k) for c in group) / len(group),
                mean_rank=sum(hits) / len(hits) if hits else None, chained_rows=len(chained)))
    return out


def format_table(stats: list[SourceStats]) -> str:
    """The per-data_source table as aligned text."""
    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    head = ("data_source", "topk", "rows", "question", "chain", "covered", "mean rank")
    body = [(s.data_source, str(s.k), str(s.rows), pct(s.question), pct(s.chain), pct(s.covered),
             "-" if s.mean_rank is None else f"{s.mean_rank:.2f}") for s in stats]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in [head, *body]]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def uncovered_records(checks: list[RowCheck], k: int) -> list[dict]:
    """JSON-ready records of the rows not covered at top-k (ranks are up to the largest k retrieved)."""
    out = []
    for c in checks:
        if c.covered(k):
            continue
        rec = {"uid": c.uid, "data_source": c.data_source, "question": c.question, "answers": c.answers,
               "topk": k, "first_hit_rank": c.rank}
        if c.hop_ranks is not None:
            rec["chain"] = [{**h, "first_hit_rank": r} for h, r in zip(c.hops, c.hop_ranks)]
        out.append(rec)
    return out


# ------------------------------------------------------------------------------------------------ driver
def retrieve_all(client, queries: list[str], k: int, batch_size: int) -> dict[str, list[str]]:
    """query -> ranked passage texts, `batch_size` queries per client call (the client splits each call into
    requests the server accepts). Raises RetrievalError when a batch fails for good."""
    out: dict[str, list[str]] = {}
    for s in range(0, len(queries), batch_size):
        batch = queries[s:s + batch_size]
        for q, items in zip(batch, client.retrieve(batch, topk=k)):
            out[q] = [passage_text(item) for item in items]
    return out


def default_uncovered_path(data: str) -> str:
    """<dir>/<stem>.uncovered.jsonl next to the data file."""
    stem = os.path.basename(data)
    stem = stem[: -len(".parquet")] if stem.endswith(".parquet") else stem
    return os.path.join(os.path.dirname(os.path.abspath(data)), f"{stem}.uncovered.jsonl")


def build_arg_parser() -> ArgumentParser:
    p = ArgumentParser(prog="tools/check_corpus.py",
                       description="Retrievable ceiling of an RL parquet: for each question, whether a gold answer "
                                   "appears in the passages the retriever returns for it (and for each hop of its "
                                   "gold chain, where the data has one); a table per data_source and the uncovered "
                                   "questions in a JSONL file.",
                       epilog="example:\n  python tools/check_corpus.py data/synthetic/train.parquet "
                              "--retriever http://127.0.0.1:8000 --topk 3 10")
    p.add_argument("data", help="an RL parquet in Search-R1's schema (tools/prepare_qa_data.py, "
                                "tools/make_synthetic_world.py)")
    p.add_argument("--retriever", default="http://127.0.0.1:8000",
                   help="the retrieval server: our server's root or Search-R1's .../retrieve URL")
    p.add_argument("--topk", type=at_least(1), nargs="+", default=[3],
                   help="passages per query; several values are measured from one retrieval at the largest")
    p.add_argument("--uncovered", default=None,
                   help="JSONL of the rows uncovered at the smallest --topk (default: <data>.uncovered.jsonl "
                        "next to the data)")
    p.add_argument("--json", default=None, help="also write the table as JSON to this path")
    p.add_argument("--batch-size", type=at_least(1), default=512, help="queries per client call")
    p.add_argument("--timeout", type=above(0), default=60.0, help="seconds per HTTP request")
    p.add_argument("--limit", type=at_least(1), default=None, help="check only the first N rows")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    from megatron_searchr1.data.rl_data import DataError, check_schema, read_rows

    try:
        check_schema([args.data], what="DATA")
    except DataError as e:
        raise UsageError(str(e)) from None
    uncovered_path = args.uncovered or default_uncovered_path(args.data)
    if not os.path.isdir(os.path.dirname(os.path.abspath(uncovered_path))):
        raise UsageError(f"--uncovered {uncovered_path}: its folder does not exist")

    from megatron_searchr1.search.client import RetrievalClient, RetrievalError

    ks = sorted(set(args.topk))
    client = RetrievalClient(args.retriever, topk=ks[-1], timeout=args.timeout, max_retries=1)
    try:
        try:  # one probe query: our server and Search-R1's both answer /retrieve (Search-R1's has no /health)
            client.retrieve(["probe"], topk=1)
        except RetrievalError as e:
            raise UsageError(f"--retriever {args.retriever}: no answer from the retrieval server ({e}); start it "
                             "(python -m megatron_searchr1.search.server --index-dir DIR --port 8000) or pass "
                             "its URL") from None
        rows = read_rows([args.data])[: args.limit]
        queries = queries_of(rows)
        print(f"check_corpus: {len(rows)} rows, {len(queries)} distinct queries, top-{ks[-1]} from "
              f"{args.retriever}", flush=True)
        try:
            passages = retrieve_all(client, queries, ks[-1], args.batch_size)
        except RetrievalError as e:
            raise UsageError(f"--retriever {args.retriever}: retrieval failed ({e})") from None
    finally:
        client.close()

    checks = check_rows(rows, passages)
    stats = summarize(checks, ks)
    print(format_table(stats))
    uncovered = uncovered_records(checks, ks[0])
    with open(uncovered_path, "w", encoding="utf-8") as f:
        for rec in uncovered:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    print(f"check_corpus: {len(uncovered)} of {len(rows)} rows uncovered at top-{ks[0]} -> {uncovered_path}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([s.__dict__ for s in stats], f, indent=1)
    return 0
