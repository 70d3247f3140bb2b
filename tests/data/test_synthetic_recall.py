"""Recall@3 of the gold passage on the synthetic world's single-hop questions, with the real retrievers."""
import os

import pytest

from megatron_searchr1.data import synthetic
from megatron_searchr1.data.synthetic import WorldConfig
from megatron_searchr1.search.retrievers import index_corpus, load_retriever

# the default world shape at about half size, so dense indexing stays within seconds on 2 cores
CFG = WorldConfig(seed=11, n_countries=6, n_cities=16, n_universities=16, n_companies=25, n_people=90,
                  n_products=20, n_distractors=30, n_train=500, n_validation=50, n_test=50)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("recall_world"))
    w, rows = synthetic.generate(CFG)
    synthetic.write_world(w, rows, out)
    single = [q for q in synthetic.enumerate_questions(w) if q["hops"] == 1]
    return out, single


def _recall_at_3(retriever, questions):
    hits = retriever.search([q["chain"][0]["query"] for q in questions], 3)
    return sum(q["chain"][0]["doc_id"] in [doc["id"] for doc, _ in h] for q, h in zip(questions, hits)) / len(hits)


@pytest.mark.parametrize("kind", ["bm25", "dense"])
def test_recall_at_3_single_hop(world, kind):
    out, single = world
    index_dir = os.path.join(out, f"index_{kind}")
    index_corpus(os.path.join(out, "corpus.jsonl"), index_dir, kind=kind, show_progress=False)
    retriever = load_retriever(index_dir)  # reopened from disk, as the server does
    assert len(single) > 200
    recall = _recall_at_3(retriever, single)
    print(f"{kind} recall@3 on {len(single)} single-hop questions: {recall:.3f}")
    assert recall >= 0.9
