"""What the trainers print and write about rollouts: reward tables, evaluation tables, sampled trajectories.

    reward_table([(data_source, reward, em), ...])      # the step's reward/* metrics
    summarize_eval(records); format_eval_table(report)  # validation and tools/evaluate.py
    turn_segments(tokenizer, traj)                      # [('model' | 'context', text)] turn by turn

Pure functions over plain records (no torch.distributed): the trainer gathers the records, these read them.
"""
from __future__ import annotations

from collections import Counter, defaultdict

from megatron_searchr1.rollout.loop import response_text


def reward_table(records: list[tuple[str, float, float]]) -> dict:
    """(data_source, reward, em) per trajectory -> reward and EM overall and per data source.

    >>> reward_table([("nq", 1.0, 1.0), ("nq", 0.0, 0.0), ("hotpotqa", 0.5, 0.0)])["reward/nq/mean"]
    0.5
    """
    out: dict[str, float] = {}
    for name, recs in [("", records)] + sorted(
            (f"{src}/", [x for x in records if x[0] == src]) for src in {x[0] for x in records}):
        n = max(len(recs), 1)
        out[f"reward/{name}mean"] = sum(x[1] for x in recs) / n
        out[f"reward/{name}em"] = sum(x[2] for x in recs) / n
    return out


def summarize_eval(records: list[dict], max_error_rate: float | None = None) -> dict:
    """Per data_source and overall: n, EM, sub-EM, F1, mean searches / turns / length, finish-reason shares.

    A trajectory ends at its first failed search (finish `search_error`), so the failed share of all searches is
    `search_error` trajectories over searches. Above `max_error_rate` the report is `invalid` (a reason string):
    its scores measure the retriever's outage, not the policy, so it carries no metrics and the table shows no EM.

    >>> recs = [{"data_source": "nq", "em": 1, "subem": 1, "f1": 1, "searches": 1, "turns": 2, "length": 9,
    ...          "finish": f} for f in ("answer", "search_error", "search_error")]
    >>> summarize_eval(recs, max_error_rate=0.2)["invalid"], summarize_eval(recs, max_error_rate=0.2)["metrics"]
    ('2 of 3 searches failed (more than retrieval.max_error_rate=0.2)', {})
    """
    groups: dict[str, list] = defaultdict(list)
    for rec in records:
        groups[rec["data_source"]].append(rec)
        if rec.get("split"):  # validation and test files of one source: also reported per split
            groups[f"split:{rec['split']}"].append(rec)
    groups["all"] = list(records)
    table, metrics = {}, {}
    for source, recs in sorted(groups.items()):
        n = max(len(recs), 1)
        row = {"n": len(recs)}
        for key in ("em", "subem", "f1", "searches", "turns", "length"):
            row[key] = sum(float(x[key]) for x in recs) / n
        finish = Counter(x["finish"] for x in recs)
        row["finish"] = {k: v / n for k, v in sorted(finish.items())}
        table[source] = row
        for key in ("em", "subem", "f1", "searches"):
            metrics[f"{source}/{key}"] = row[key]
    searches = sum(int(x["searches"]) for x in records)
    failed = sum(x["finish"] == "search_error" for x in records)
    if max_error_rate is not None and searches and failed / searches > max_error_rate:
        why = f"{failed} of {searches} searches failed (more than retrieval.max_error_rate={max_error_rate:g})"
        return {"table": table, "metrics": {}, "invalid": why}
    return {"table": table, "metrics": metrics}


def format_eval_table(report: dict, title: str = "evaluation") -> str:
    """The report as a table; an invalid one (see summarize_eval) says so and shows no scores."""
    if report.get("invalid"):
        lines = [f"{title}: INVALID, {report['invalid']}: scores withheld",
                 f"{'data_source':<22}{'n':>6}{'search':>8}{'turns':>7}  finish"]
        for source, row in report["table"].items():
            finish = " ".join(f"{k}={v:.2f}" for k, v in row["finish"].items())
            lines.append(f"{source:<22}{row['n']:>6}{row['searches']:>8.2f}{row['turns']:>7.2f}  {finish}")
        return "\n".join(lines)
    lines = [title, f"{'data_source':<22}{'n':>6}{'EM':>8}{'subEM':>8}{'F1':>8}{'search':>8}{'turns':>7}  finish"]
    for source, row in report["table"].items():
        finish = " ".join(f"{k}={v:.2f}" for k, v in row["finish"].items())
        lines.append(f"{source:<22}{row['n']:>6}{row['em']:>8.3f}{row['subem']:>8.3f}{row['f1']:>8.3f}"
                     f"{row['searches']:>8.2f}{row['turns']:>7.2f}  {finish}")
    return "\n".join(lines)


def turn_segments(tokenizer, traj) -> list[tuple[str, str]]:
    """[(kind, text)] of a trajectory: 'model' for generated runs (loss mask 1), 'context' for what was appended
    (observations, invalid-action feedback)."""
    out, start = [], 0
    mask = traj.loss_mask
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            kind = "model" if mask[start] == 1 else "context"
            out.append((kind, tokenizer.decode(traj.response_ids[start:i], skip_special_tokens=False)))
            start = i
    return out


def sample_records(tokenizer, trajs: list, scores: list, k: int) -> list[dict]:
    """The first `k` training trajectories as JSONL records (trajectories.jsonl)."""
    return [{"uid": tr.uid, "sample": tr.sample, "data_source": tr.meta["data_source"],
             "question": tr.meta["question"], "target": list(tr.meta["ground_truth"].get("target", [])),
             "response": response_text(tokenizer, tr), "answer": tr.answer, "score": sc["score"],
             "finish": tr.finish_reason, "searches": tr.n_searches} for tr, sc in zip(trajs[:k], scores[:k])]


def eval_record(tr, score: dict) -> dict:
    """One validation trajectory's record (what summarize_eval reads)."""
    return {"data_source": tr.meta["data_source"], "split": tr.meta.get("split", ""), "uid": tr.uid, **score,
            "searches": tr.n_searches, "turns": tr.turns, "finish": tr.finish_reason, "length": len(tr.response_ids)}


def eval_sample(tokenizer, tr, score: dict) -> dict:
    """One validation trajectory turn by turn (val_trajectories.jsonl)."""
    return {"uid": tr.uid, "question": tr.meta["question"], "score": score["score"],
            "target": list(tr.meta["ground_truth"].get("target", [])), "finish": tr.finish_reason,
            "turns": turn_segments(tokenizer, tr)}
