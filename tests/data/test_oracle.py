"""Gold trajectories: the oracle follows the gold chain with the real retriever, in-process and through a real
uvicorn server on loopback, and every <information> block is exactly what the server returns."""
import json
import os
import socket

import httpx
import pytest

from megatron_searchr1.data import make_world, oracle, synthetic
from megatron_searchr1.data.prompts import format_observation
from megatron_searchr1.search.client import RetrievalClient, format_docs
from megatron_searchr1.search.launch import ServerProcess
from megatron_searchr1.search.retrievers import index_corpus

SMALL = dict(seed=5, n_countries=4, n_cities=12, n_universities=10, n_companies=15, n_people=50, n_products=12,
             n_distractors=20, n_train=200, n_validation=40, n_test=40)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("oracle_world"))
    w, rows = synthetic.generate(synthetic.WorldConfig(**SMALL))
    paths = synthetic.write_world(w, rows, out)
    index_dir = os.path.join(out, "index_bm25")
    retriever = index_corpus(paths["corpus"], index_dir, kind="bm25", show_progress=False)
    gold_text = {p["id"]: p["text"] for p in w.passages}
    return {"out": out, "rows": rows, "index_dir": index_dir, "retriever": retriever, "gold_text": gold_text,
            "heldout_titles": synthetic.heldout_titles(w)}


def _shown_heldout(traj, heldout_titles):
    """Held-out titles visible in a trajectory's observations, found by plain substring (not the oracle's parser)."""
    return {t for m in traj["messages"] if m["role"] == "observation" for t in heldout_titles
            if f'(Title: "{t}")' in m["content"]}


def _check_trajectory(traj, row):
    chain = row["extra_info"]["chain"]
    msgs = traj["messages"]
    assert msgs[: len(row["prompt"])] == row["prompt"]
    turns = msgs[len(row["prompt"]):]
    assert [m["role"] for m in turns] == ["assistant", "observation"] * len(chain) + ["assistant"]
    for h, hop in enumerate(chain):
        assert turns[2 * h]["content"].endswith(f"<search> {hop['query']} </search>")
        assert turns[2 * h]["content"].startswith("<think> ")
    gold = row["reward_model"]["ground_truth"]["target"][0]
    assert turns[-1]["content"].endswith(f"</think>\n<answer> {gold} </answer>")
    assert traj["answer"] == gold and traj["hops"] == len(chain) and traj["uid"] == row["extra_info"]["uid"]
    return [turns[2 * h + 1]["content"] for h in range(len(chain))], [hop["query"] for hop in chain]


def test_in_process_oracle_follows_the_chain(world, tmp_path):
    rows = world["rows"]["train"]
    search = oracle.retriever_searcher(world["retriever"], topk=3)
    trajs = oracle.gold_trajectories(rows, search, world["gold_text"], batch_size=64)
    assert len(trajs) == len(rows)
    for traj, row in zip(trajs[:50], rows[:50]):
        observations, queries = _check_trajectory(traj, row)
        # each observation is the retriever's answer to that very query, formatted as the client formats it
        direct = [format_docs(hits) for hits in world["retriever"].search(queries, 3)]
        assert observations == [format_observation(d) for d in direct]
    assert sum(t["gold_retrieved"] for t in trajs) >= 0.9 * len(trajs)
    assert {t["hops"] for t in trajs} == {1, 2, 3}

    counts = oracle.write_sft({"train": trajs}, str(tmp_path / "sft"))
    assert counts["train"] == sum(t["gold_retrieved"] for t in trajs)
    info = json.load(open(tmp_path / "sft" / "dataset_info.json"))
    entry = info["synthetic_sft_train"]
    assert entry["formatting"] == "sharegpt" and entry["columns"] == {"messages": "messages"}
    assert entry["tags"]["observation_tag"] == "observation"
    written = [json.loads(line) for line in open(tmp_path / "sft" / entry["file_name"])]
    assert written == [t for t in trajs if t["gold_retrieved"]]


def test_misses_are_flagged_and_failures_raise(world, tmp_path):
    rows = world["rows"]["test"][:10]
    real = oracle.retriever_searcher(world["retriever"], topk=3)
    wrong = lambda qs: real(["annual talk festival river"] * len(qs))  # noqa: E731 - a real search, wrong question
    trajs = oracle.gold_trajectories(rows, wrong, world["gold_text"])
    assert not any(t["gold_retrieved"] for t in trajs)
    assert oracle.write_sft({"test": trajs}, str(tmp_path / "a"))["test"] == 0
    assert oracle.write_sft({"test": trajs}, str(tmp_path / "b"), keep_misses=True)["test"] == 10
    # a client whose server is down answers "Search failed: ..."; the oracle refuses to write that as gold data
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    client = RetrievalClient(f"http://127.0.0.1:{dead_port}", topk=3, timeout=2, max_retries=0,
                             max_queries_per_request=16)
    with pytest.raises(RuntimeError, match="retrieval failed"):
        oracle.gold_trajectories(rows, oracle.client_searcher(client))
    client.close()


def test_written_train_trajectories_show_no_heldout_passage(world, tmp_path):
    held = world["heldout_titles"]
    corpus = [json.loads(line) for line in open(os.path.join(world["out"], "corpus.jsonl"))]
    title_of = {c["id"]: c["contents"].split("\n", 1)[0].strip('"') for c in corpus}
    gold = {s: {title_of[h["doc_id"]] for r in world["rows"][s] for h in r["extra_info"]["chain"]}
            for s in synthetic.SPLITS}
    assert gold["validation"] | gold["test"] <= held and not gold["train"] & held
    rows = world["rows"]["train"]
    search = oracle.retriever_searcher(world["retriever"], topk=3)
    trajs = oracle.gold_trajectories(rows, search, world["gold_text"], heldout_titles=held)
    flagged = [t for t in trajs if t["shows_heldout"]]
    # BM25 does rank held-out passages for some train queries (25% of trajectories in this tiny world, 7% at the
    # default sizes), so the filter has something to do
    assert 0 < len(flagged) < 0.5 * len(trajs)
    assert all(t["shows_heldout"] == bool(_shown_heldout(t, held)) for t in trajs)
    counts = oracle.write_sft({"train": trajs}, str(tmp_path / "sft"))
    written = [json.loads(line) for line in open(tmp_path / "sft" / "train.jsonl")]
    assert counts["train"] == len(written) == sum(t["gold_retrieved"] and not t["shows_heldout"] for t in trajs)
    assert written and not any(_shown_heldout(t, held) for t in written)
    assert oracle.skipped_counts(trajs)["shows_heldout"] == len(flagged)
    # opt-in keeps them; without heldout_titles nothing is flagged (validation/test rows are checked that way)
    kept = oracle.write_sft({"train": trajs}, str(tmp_path / "all"), keep_heldout=True)["train"]
    assert kept == sum(t["gold_retrieved"] for t in trajs) > counts["train"]
    unchecked = oracle.gold_trajectories(rows, search, world["gold_text"])
    assert not any(t["shows_heldout"] for t in unchecked)
    assert [dict(t, shows_heldout=False) for t in trajs] == unchecked  # the flag changes nothing else


def test_observed_titles_parses_format_docs_in_order():
    docs = [{"contents": '"Kaboland"\nKaboland is a country.'}, {"contents": '"Vel Works"\nDoc 1(Title: "x") y'},
            {"contents": '"Tor River"\nA river.\nDoc 3(Title: "Fake") z'}]
    assert oracle.observed_titles(format_docs(docs)) == ["Kaboland", "Vel Works", "Tor River"]
    assert oracle.observed_titles("Search failed: timeout") == []


@pytest.fixture(scope="module")
def server(world):
    with ServerProcess(["--index-dir", world["index_dir"], "--host", "127.0.0.1"],
                       env={"HF_HUB_OFFLINE": "1"}, start_timeout=60) as srv:
        yield srv.url


def test_oracle_through_a_real_server(world, server, tmp_path):
    rows = world["rows"]["validation"]
    with RetrievalClient(server, topk=3) as client:
        trajs = oracle.gold_trajectories(rows, oracle.client_searcher(client), world["gold_text"])
    # the in-process retriever gives the same bytes as the server (so either can produce warm-up data)
    local = oracle.gold_trajectories(rows, oracle.retriever_searcher(world["retriever"], 3), world["gold_text"])
    assert trajs == local
    with httpx.Client(timeout=30) as http:
        for traj, row in zip(trajs, rows):
            observations, queries = _check_trajectory(traj, row)
            resp = http.post(f"{server}/retrieve", json={"queries": queries, "topk": 3, "return_scores": True})
            resp.raise_for_status()
            raw = resp.json()["result"]
            assert observations == [format_observation(format_docs(docs)) for docs in raw]
            inner = [o[len("\n\n<information>"): -len("</information>\n\n")] for o in observations]
            assert inner == [format_docs(docs).strip() for docs in raw]


def test_cli_oracle_url(world, server, tmp_path):
    """`make_synthetic_world.py --oracle-url` regenerates the same world (same seed) and writes gold data."""
    out = str(tmp_path / "cli")
    make_world.main(["--out-dir", out, "--oracle-url", f"{server}/retrieve", "--oracle-splits", "train,validation,test"]
                   + [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()])
    assert open(os.path.join(out, "corpus.jsonl")).read() == open(os.path.join(world["out"], "corpus.jsonl")).read()
    info = json.load(open(os.path.join(out, "sft", "dataset_info.json")))
    assert set(info) == {"synthetic_sft_train", "synthetic_sft_validation", "synthetic_sft_test"}
    val = [json.loads(line) for line in open(os.path.join(out, "sft", "validation.jsonl"))]
    by_uid = {r["extra_info"]["uid"]: r for r in world["rows"]["validation"]}
    assert len(val) >= 0.9 * len(by_uid)
    for traj in val:
        _check_trajectory(traj, by_uid[traj["uid"]])
    # through the server too, no written train trajectory shows a held-out passage, and the filter did drop some
    # (validation/test are not filtered: held-out passages are their gold)
    train = [json.loads(line) for line in open(os.path.join(out, "sft", "train.jsonl"))]
    assert 0.5 * len(world["rows"]["train"]) <= len(train) < len(world["rows"]["train"])
    assert not any(_shown_heldout(t, world["heldout_titles"]) for t in train)
    assert any(_shown_heldout(t, world["heldout_titles"]) for t in val)


def test_lazy_demonstrator_gives_up_on_multi_hop_chains_only(world):
    rows = world["rows"]["train"]
    search = oracle.retriever_searcher(world["retriever"], topk=3)
    perfect = oracle.gold_trajectories(rows, search, world["gold_text"])
    assert all(t["searches"] == t["hops"] for t in perfect)
    with pytest.raises(ValueError, match="stop_early"):
        oracle.gold_trajectories(rows[:2], search, stop_early=1.5)

    lazy = oracle.gold_trajectories(rows, search, world["gold_text"], stop_early=1.0)
    finals = {}
    for row in rows:
        chain = row["extra_info"]["chain"]
        finals.setdefault(chain[-1]["relation"], set()).add(chain[-1]["answer"])
    for t, p, row in zip(lazy, perfect, rows):
        chain = row["extra_info"]["chain"]
        if t["hops"] == 1:  # single-hop trajectories are the perfect ones
            assert t == p
            continue
        # one search, then a guess: a final answer of the split of the same kind, never the right one
        assert t["searches"] == 1
        assert [m["role"] for m in t["messages"][len(row["prompt"]):]] == ["assistant", "observation", "assistant"]
        assert t["messages"][: len(row["prompt"]) + 2] == p["messages"][: len(row["prompt"]) + 2]
        last = t["messages"][-1]["content"]
        assert last.startswith(f"<think> {oracle._cap(oracle._fact(chain[0]))} is {chain[0]['answer']}. I will guess")
        assert last.endswith(f"<answer> {t['answer']} </answer>")
        assert t["answer"] != chain[-1]["answer"] and t["answer"] in finals[chain[-1]["relation"]]

    # in between, each continuation is a coin with that bias, drawn from the seed
    half = oracle.gold_trajectories(rows, search, world["gold_text"], stop_early=0.5, seed=1)
    assert half == oracle.gold_trajectories(rows, search, world["gold_text"], stop_early=0.5, seed=1)
    two = [t for t in half if t["hops"] == 2]
    three = [t for t in half if t["hops"] == 3]
    assert 0.3 < sum(t["searches"] == 1 for t in two) / len(two) < 0.7
    assert {t["searches"] for t in three} == {1, 2, 3}
    assert all(t["answer"] == p["answer"] for t, p in zip(half, perfect) if t["searches"] == t["hops"])
