"""tools/check_corpus.py: coverage of the synthetic world's questions by a real BM25 server on loopback, checked
against a count made here from the same server's passages; bad input is one error line."""
import json
import os
import re
import socket
import subprocess
import sys

import pytest

from megatron_searchr1.reward.qa_em import normalize_answer
from tests.dist_utils import REPO
from tests.rl_fixtures import child_env

TOOL = str(REPO / "tools" / "check_corpus.py")


def run_tool(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, TOOL, *args], cwd=REPO, env=child_env(), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def checked_world(tmp_path_factory):
    """A small synthetic world whose corpus no longer names one 1-hop train answer, its BM25 index and a live
    server: dict(url, train, victim)."""
    from megatron_searchr1.data.synthetic import WorldConfig, generate, write_world
    from megatron_searchr1.search.corpus import load_corpus, write_corpus
    from megatron_searchr1.search.launch import ServerProcess
    from megatron_searchr1.search.retrievers import index_corpus

    out = tmp_path_factory.mktemp("check_corpus")
    world, rows = generate(WorldConfig(seed=0, n_train=200, n_validation=20, n_test=20))
    paths = write_world(world, rows, str(out))
    victim = next(r for r in rows["train"] if r["extra_info"]["hops"] == 1
                  and r["reward_model"]["ground_truth"]["target"][0].isalpha())
    name = re.compile(rf"\b{re.escape(victim['reward_model']['ground_truth']['target'][0])}\b")
    docs = [{"id": d["id"], "contents": name.sub("Somewhere", d["contents"])} for d in load_corpus(paths["corpus"])]
    write_corpus(docs, paths["corpus"])
    index_corpus(paths["corpus"], out / "index_bm25", kind="bm25", show_progress=False)
    with ServerProcess(["--index-dir", str(out / "index_bm25")]) as proc:
        yield {"url": proc.url, "train": paths["train"], "victim": victim["extra_info"]["uid"], "dir": out}


def holds(answer: str, passage: str) -> bool:
    """The answer as whole words of the passage, both normalised like the EM reward."""
    return re.search(rf"(?<!\S){re.escape(normalize_answer(answer))}(?!\S)", normalize_answer(passage)) is not None


def expected(train: str, url: str, k_max: int) -> dict:
    """uid -> (data_source, question rank, [hop ranks]) from raw /retrieve calls, counted here."""
    import httpx
    import pyarrow.parquet as pq

    rows = pq.read_table(train).to_pylist()
    queries = sorted({r["extra_info"]["question"] for r in rows}
                     | {h["query"] for r in rows for h in r["extra_info"]["chain"]})
    body = httpx.post(f"{url}/retrieve", json={"queries": queries, "topk": k_max, "return_scores": False},
                      timeout=120).json()
    got = {q: [d["contents"] for d in docs] for q, docs in zip(queries, body["result"])}

    def rank(answers, q):
        return next((i + 1 for i, p in enumerate(got[q]) if any(holds(a, p) for a in answers)), None)

    return {r["extra_info"]["uid"]: (r["data_source"], rank(r["reward_model"]["ground_truth"]["target"],
                                                            r["extra_info"]["question"]),
                                     [rank([h["answer"]], h["query"]) for h in r["extra_info"]["chain"]])
            for r in rows}


@pytest.mark.slow
def test_coverage_matches_an_independent_count(checked_world):
    w = checked_world
    table, uncovered = w["dir"] / "table.json", w["dir"] / "uncovered.jsonl"
    # Search-R1's URL form (.../retrieve) and two top-k from one retrieval
    proc = run_tool(w["train"], "--retriever", f"{w['url']}/retrieve", "--topk", "10", "3", "--json", str(table),
                    "--uncovered", str(uncovered))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "synthetic_3hop" in proc.stdout and "mean rank" in proc.stdout

    truth = expected(w["train"], w["url"], 10)
    stats = {(s["data_source"], s["k"]): s for s in json.loads(table.read_text())}
    sources = sorted({src for src, _, _ in truth.values()})
    assert {s for s, _ in stats} == {*sources, "all"}
    for k in (3, 10):
        for src in [*sources, "all"]:
            mine = [v for v in truth.values() if src in ("all", v[0])]
            q_hits = [r for _, r, _ in mine if r is not None and r <= k]
            chain = [all(h is not None and h <= k for h in hops) for _, _, hops in mine]
            covered = [(r is not None and r <= k) or c for (_, r, _), c in zip(mine, chain)]
            s = stats[(src, k)]
            assert s["rows"] == len(mine)
            assert s["question"] == pytest.approx(len(q_hits) / len(mine)), (src, k)
            assert s["chain"] == pytest.approx(sum(chain) / len(mine)), (src, k)
            assert s["covered"] == pytest.approx(sum(covered) / len(mine)), (src, k)
            assert s["mean_rank"] == pytest.approx(sum(q_hits) / len(q_hits)), (src, k)
    # more passages never cover fewer rows, and BM25 does not find every multi-hop answer from the question alone
    assert stats[("all", 10)]["covered"] >= stats[("all", 3)]["covered"]
    assert stats[("synthetic_3hop", 3)]["question"] < stats[("synthetic_3hop", 3)]["chain"]

    lines = [json.loads(x) for x in uncovered.read_text().splitlines()]
    want = {uid for uid, (_, r, hops) in truth.items()
            if not ((r is not None and r <= 3) or all(h is not None and h <= 3 for h in hops))}
    assert {x["uid"] for x in lines} == want
    victim = next(x for x in lines if x["uid"] == w["victim"])
    assert victim["first_hit_rank"] is None and victim["chain"][-1]["first_hit_rank"] is None


def test_bad_input_is_one_error_line(tmp_path):
    proc = run_tool(str(tmp_path / "missing.parquet"))
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and "missing.parquet" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1

    from megatron_searchr1.data.synthetic import WorldConfig, generate, write_world

    world, rows = generate(WorldConfig(seed=0, n_train=20, n_validation=10, n_test=10))
    train = write_world(world, rows, str(tmp_path))["train"]
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = run_tool(train, "--retriever", f"http://127.0.0.1:{port}", timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --retriever"), proc.stderr
    assert "search.server" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not os.path.exists(os.path.join(tmp_path, "train.uncovered.jsonl"))


def test_rows_without_a_chain_and_search_r1_shapes():
    """Rows of tools/prepare_qa_data.py (no chain) and of Search-R1's own parquet (question only in the prompt),
    passages in the shapes the two servers send."""
    from megatron_searchr1.data.corpus_check import check_rows, passage_text, question_of, summarize
    from megatron_searchr1.data.qa import make_row

    ours = make_row("Where was Ada Lovelace born?", ["London"], "nq", "train", 0, "nq-train-0")
    theirs = {"data_source": "hotpotqa", "extra_info": {"split": "train", "index": 0},
              "prompt": [{"role": "user", "content": "Answer the given question. ... Question: Who wrote Hamlet?\n"}],
              "reward_model": {"ground_truth": {"target": ["Shakespeare", "William Shakespeare"]}}}
    assert question_of(theirs) == "Who wrote Hamlet?"
    served = {"Where was Ada Lovelace born?": [{"document": {"id": "1", "contents": '"Londoner"\nA Londoner.'}},
                                               {"document": {"id": "2", "title": "Ada", "text": "Born in London."}}],
              "Who wrote Hamlet?": [{"document": '"Hamlet"\nA play by William Shakespeare.', "score": 1.0}]}
    checks = check_rows([ours, theirs], {q: [passage_text(d) for d in ds] for q, ds in served.items()})
    assert [(c.rank, c.hop_ranks) for c in checks] == [(2, None), (1, None)]   # "Londoner" is not "London"
    stats = {(s.data_source, s.k): s for s in summarize(checks, [1, 2])}
    assert stats[("nq", 1)].covered == 0 and stats[("nq", 2)].covered == 1 and stats[("nq", 2)].chain is None
    assert stats[("all", 1)].question == 0.5 and stats[("all", 2)].mean_rank == 1.5
