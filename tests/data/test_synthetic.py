"""The synthetic world: determinism, disjoint splits, answers derivable along the gold chain, hop counts."""
import json
import os
import re
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from megatron_searchr1.data import make_world, synthetic
from megatron_searchr1.data.prompts import make_prefix
from megatron_searchr1.data.synthetic import SPLITS, SYNTH_EXTRA_INFO_TYPE, WorldConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = dict(n_countries=4, n_cities=12, n_universities=10, n_companies=15, n_people=50, n_products=12,
             n_distractors=20, n_train=300, n_validation=40, n_test=60)


def _read_split(out_dir, split):
    return pq.read_table(os.path.join(out_dir, f"{split}.parquet")).to_pylist()


def _read_corpus(out_dir):
    with open(os.path.join(out_dir, "corpus.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def world_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("world"))
    make_world.main(["--out-dir", out, "--seed", "3"] + [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()])
    return out


def _files(out_dir):
    return {name: open(os.path.join(out_dir, name), "rb").read()
            for name in ["corpus.jsonl", "world.json"] + [f"{s}.parquet" for s in SPLITS]}


def test_same_seed_same_bytes_different_seed_differs(world_dir, tmp_path):
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]
    make_world.main(["--out-dir", str(tmp_path / "again"), "--seed", "3"] + argv)
    make_world.main(["--out-dir", str(tmp_path / "other"), "--seed", "4"] + argv)
    assert _files(world_dir) == _files(tmp_path / "again")
    other = _files(tmp_path / "other")
    assert all(other[name] != data for name, data in _files(world_dir).items())
    names = {json.loads(line)["contents"].split("\n")[0] for line in open(os.path.join(world_dir, "corpus.jsonl"))}
    other_names = {json.loads(line)["contents"].split("\n")[0] for line in open(tmp_path / "other" / "corpus.jsonl")}
    assert len(names & other_names) < len(names) // 10  # a different world, not a reshuffle of the same one


def test_splits_sizes_schema_and_disjoint(world_dir):
    rows = {s: _read_split(world_dir, s) for s in SPLITS}
    assert {s: len(r) for s, r in rows.items()} == {"train": 300, "validation": 40, "test": 60}
    for s in SPLITS:
        assert pq.read_schema(os.path.join(world_dir, f"{s}.parquet")).field("extra_info").type == SYNTH_EXTRA_INFO_TYPE
    questions = {s: [r["extra_info"]["question"] for r in rs] for s, rs in rows.items()}
    for s in SPLITS:
        assert len(set(questions[s])) == len(questions[s]), f"repeated question within {s}"
    assert not set(questions["train"]) & set(questions["test"])
    assert not set(questions["train"]) & set(questions["validation"])
    assert not set(questions["validation"]) & set(questions["test"])
    uids = [r["extra_info"]["uid"] for rs in rows.values() for r in rs]
    assert len(set(uids)) == len(uids)
    r = rows["train"][0]
    assert r["prompt"] == [{"role": "user", "content": make_prefix(r["extra_info"]["question"])}]
    assert r["ability"] == "fact-reasoning" and r["reward_model"]["style"] == "rule"


def test_every_answer_follows_from_the_corpus_along_the_gold_chain(world_dir):
    corpus = {d["id"]: d["contents"] for d in _read_corpus(world_dir)}
    titles = [c.split("\n")[0] for c in corpus.values()]
    assert len(set(titles)) == len(titles), "passage titles (entity names) must be unique"
    hop_counts = set()
    for split in SPLITS:
        for row in _read_split(world_dir, split):
            info, chain = row["extra_info"], row["extra_info"]["chain"]
            assert 1 <= info["hops"] == len(chain) <= 3
            assert row["data_source"] == f"synthetic_{info['hops']}hop"
            hop_counts.add(info["hops"])
            assert chain[0]["subject"] in info["question"]  # the chain starts at the entity the question names
            for i, hop in enumerate(chain):
                title, text = corpus[hop["doc_id"]].split("\n", 1)
                assert title == f'"{hop["subject"]}"'  # the gold passage is the subject's own passage
                assert hop["subject"] in hop["query"] and hop["query"].endswith("?")
                assert re.search(rf"\b{re.escape(hop['answer'])}\b", text), (hop, text)
                if i + 1 < len(chain):
                    assert chain[i + 1]["subject"] == hop["answer"]  # the next hop asks about this hop's answer
            assert row["reward_model"]["ground_truth"]["target"] == [chain[-1]["answer"]]
            if info["hops"] > 1:  # a multi-hop question names only the start entity, not intermediate answers
                assert all(h["answer"] not in info["question"] for h in chain)
    assert hop_counts == {1, 2, 3}


def test_answers_agree_with_the_world_facts(world_dir):
    """The chain (derived from the corpus) and world.json (the generator's ground truth) tell the same story."""
    world = json.load(open(os.path.join(world_dir, "world.json")))
    by_name = {e["name"]: e for e in world["entities"].values()}
    for row in _read_split(world_dir, "test"):
        for hop in row["extra_info"]["chain"]:
            obj = by_name[hop["subject"]]["facts"][hop["relation"]]
            assert world["entities"].get(obj, {"name": obj})["name"] == hop["answer"]


def test_too_many_questions_is_a_clear_error():
    cfg = WorldConfig(**{**SMALL, "n_train": 100000})
    with pytest.raises(ValueError, match="distinct 1-hop questions.*raise the entity counts"):
        synthetic.generate(cfg)
    with pytest.raises(ValueError, match="n_people"):
        WorldConfig(n_people=5, n_companies=10)
    with pytest.raises(ValueError, match="hop_fractions"):
        WorldConfig(hop_fractions=(1, 0))


def test_single_hop_only_and_tool_script(tmp_path):
    out = tmp_path / "w"
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "make_synthetic_world.py"), "--out-dir", str(out),
                    "--hop-fractions", "1,0,0", "--n-train", "50", "--n-validation", "5", "--n-test", "5"],
                   check=True, capture_output=True, text=True)
    rows = _read_split(out, "train")
    assert len(rows) == 50 and {r["extra_info"]["hops"] for r in rows} == {1}


def test_chat_template_rows():
    _, rows = synthetic.generate(WorldConfig(**{**SMALL, "template": "chat"}))
    row = rows["validation"][0]
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert row["prompt"][1]["content"] == f"Question: {row['extra_info']['question']}"


def test_heldout_region_keeps_test_facts_out_of_train(world_dir):
    rows = {s: _read_split(world_dir, s) for s in SPLITS}
    world = json.load(open(os.path.join(world_dir, "world.json")))
    region = {e["name"]: e["region"] for e in world["entities"].values()}
    train_facts = {(h["subject"], h["relation"]) for r in rows["train"] for h in r["extra_info"]["chain"]}
    for split in ("validation", "test"):
        for r in rows[split]:
            for h in r["extra_info"]["chain"]:
                assert region[h["subject"]] == "heldout" and (h["subject"], h["relation"]) not in train_facts
    assert {region[h["subject"]] for r in rows["train"] for h in r["extra_info"]["chain"]} == {"seen"}


def test_heldout_titles_name_exactly_the_heldout_entity_passages():
    world, rows = synthetic.generate(WorldConfig(**SMALL))
    held = synthetic.heldout_titles(world)
    title_of = {p["id"]: p["title"] for p in world.passages}
    n_held = sum(e["region"] == "heldout" for e in world.entities.values())
    assert len(held) == n_held > 0
    gold = {s: {title_of[h["doc_id"]] for r in rs for h in r["extra_info"]["chain"]} for s, rs in rows.items()}
    assert gold["validation"] | gold["test"] <= held and not gold["train"] & held
    single, _ = synthetic.generate(WorldConfig(**{**SMALL, "heldout_fraction": 0.0}))
    assert synthetic.heldout_titles(single) == set()


def test_single_region_world():
    _, rows = synthetic.generate(WorldConfig(**{**SMALL, "heldout_fraction": 0.0}))
    questions = [r["extra_info"]["question"] for rs in rows.values() for r in rs]
    assert len(questions) == len(set(questions)) == 400
    with pytest.raises(ValueError, match="heldout_fraction"):
        WorldConfig(heldout_fraction=1.0)
    with pytest.raises(ValueError, match="heldout region would get"):
        WorldConfig(**{**SMALL, "n_countries": 1, "heldout_fraction": 0.3})


def test_name_maker_reserves_suffixed_names_and_redraws_on_a_clash():
    import random

    names = synthetic.NameMaker(random.Random(7))
    country = names.word(["land"])
    stem = country[: -len("land")]
    assert country.endswith("land") and {stem.lower(), country.lower()} <= names.used
    # a later plain word can never be the suffixed name: word() skips every name in `used`
    later = {names.word() for _ in range(300)}
    assert country not in later and stem not in later and len(later) == 300
    # the same stream with the suffixed name already taken (as if an earlier word were "Kaboland") must redraw
    # instead of handing out a duplicate
    clash = synthetic.NameMaker(random.Random(7))
    clash.used.add(country.lower())
    other = clash.word(["land"])
    assert other != country and other.endswith("land") and country.lower() in clash.used
    # and a plain word that happens to equal a stem + suffix blocks that combination the same way
    plain = synthetic.NameMaker(random.Random(7))
    plain.used.add(stem.lower())
    assert plain.word(["land"]) != country
