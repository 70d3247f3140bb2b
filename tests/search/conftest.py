"""Fixtures for the retrieval tests: a generated 300-passage corpus and one index of each kind per session.

Dense encoding on 2 shared cores is the slow part, so each index is built once (session scope) and shared.
"""
import itertools
import os
import random

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

PROFESSIONS = ["baker", "astronomer", "carpenter", "violinist", "surgeon", "beekeeper", "pilot", "glassblower",
               "librarian", "fisherman", "architect", "chemist"]
CITIES = ["Lisbon", "Nairobi", "Oslo", "Kyoto", "Lima", "Cairo", "Toronto", "Sydney", "Warsaw", "Hanoi"]
HOBBIES = ["chess", "surfing", "pottery", "birdwatching", "knitting", "rock climbing", "origami", "sailing",
           "gardening", "fencing"]
# Passages on topics nothing else in the corpus touches: a paraphrased question must find them top-1 with
# any sensible retriever, dense included.
TOPICS = [
    ("Volcano", "The volcano erupted at dawn, sending a column of ash and molten lava down its slopes.",
     "lava and ash pouring from an erupting mountain"),
    ("Penguins", "Emperor penguins huddle together through the Antarctic winter to keep their eggs warm.",
     "birds in Antarctica keeping their eggs warm"),
    ("Espresso", "Espresso is brewed by forcing hot water through finely ground coffee beans under pressure.",
     "how strong coffee is made with pressure"),
    ("Tides", "Ocean tides rise and fall twice a day because of the gravitational pull of the moon.",
     "why the sea level changes with the moon"),
    ("Bicycle", "A bicycle chain transfers power from the pedals to the rear wheel.",
     "how pedalling moves the back wheel of a bike"),
    ("Photosynthesis", "Plants turn sunlight, water and carbon dioxide into sugar and oxygen by photosynthesis.",
     "how leaves use sunlight to make food"),
    ("Chess clock", "Tournament chess games use a clock that counts down each player's remaining time.",
     "timer used in competitive chess matches"),
    ("Glacier", "A glacier is a slow river of ice that carves valleys as it creeps downhill.",
     "moving ice that shapes mountain valleys"),
    ("Violin", "A violin has four strings and is played with a bow strung with horsehair.",
     "string instrument played with a horsehair bow"),
    ("Submarine", "Submarines dive by flooding ballast tanks with seawater and surface by blowing them out.",
     "how an underwater boat descends and ascends"),
]


def make_world(n: int = 300, seed: int = 0) -> tuple[list[dict], list[str], list[int]]:
    """`n` passages (TOPICS first, then invented people), one question per passage, and the topic rows.

    Each person has a unique (profession, city, hobby) triple, so the question naming the triple has exactly one
    right passage; the question's answer row is its index.
    """
    rng = random.Random(seed)
    docs = [{"id": f"topic{i}", "title": t, "text": text} for i, (t, text, _) in enumerate(TOPICS)]
    queries = [q for _, _, q in TOPICS]
    combos = list(itertools.product(PROFESSIONS, CITIES, HOBBIES))
    rng.shuffle(combos)
    syllables = ["ka", "lo", "mi", "ra", "ven", "tor", "zel", "dri", "os", "bel", "qua", "fin"]
    for i, (prof, city, hobby) in enumerate(combos[: n - len(TOPICS)]):
        first = "".join(rng.choice(syllables) for _ in range(3)).capitalize()
        last = "".join(rng.choice(syllables) for _ in range(2)).capitalize()
        docs.append({"id": f"person{i}", "title": f"{first} {last}",
                     "text": f"{first} {last} is a {prof} who lives in {city}. "
                             f"In their free time {first} enjoys {hobby}."})
        queries.append(f"the {prof} from {city} who enjoys {hobby}")
    return docs, queries, list(range(len(TOPICS)))


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    """The corpus on disk in FlashRAG format plus its questions: dict(path, docs, queries, topic_rows)."""
    from megatron_searchr1.search.corpus import write_corpus

    docs, queries, topic_rows = make_world()
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    write_corpus(docs, path)
    return {"path": str(path), "docs": docs, "queries": queries, "topic_rows": topic_rows}


def _built(tmp_path_factory, world, kind, **options):
    from megatron_searchr1.search.retrievers import index_corpus

    out = tmp_path_factory.mktemp(f"index_{kind}")
    return str(out), index_corpus(world["path"], out, kind=kind, show_progress=False, **options)


@pytest.fixture(scope="session")
def bm25_index(tmp_path_factory, world):
    """(index_dir, retriever) for BM25 over the world corpus."""
    return _built(tmp_path_factory, world, "bm25")


@pytest.fixture(scope="session")
def dense_index(tmp_path_factory, world):
    """(index_dir, retriever) for the packaged MiniLM + faiss Flat over the world corpus."""
    return _built(tmp_path_factory, world, "dense")


@pytest.fixture(scope="session")
def hybrid_index(tmp_path_factory, world):
    """(index_dir, retriever): BM25 + MiniLM/HNSW fused by RRF."""
    return _built(tmp_path_factory, world, "hybrid", index_type="hnsw")
