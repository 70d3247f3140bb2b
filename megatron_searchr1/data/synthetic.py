"""A seeded fictional world: corpus, single- and multi-hop questions, splits. It knows nothing of retrieval or of
the oracle: oracle.py writes gold trajectories over it, make_world.py is the command line that does both.

Why: a model can only learn to *search* if it cannot already know the answers. Every name here is made of invented
syllables, so no pretrained model has seen them; the only way to answer is to retrieve.

The world: countries, cities, universities, companies, people and products, tied by functional relations
(each subject has exactly one object, so every question has one answer):

    city -country_of-> country -capital-> city          university -located_in-> city, -founded-> year
    company -headquarters-> city, -founded-> year, -ceo-> person
    person -born_year-> year, -birthplace-> city, -alma_mater-> university, -employer-> company
    product -maker-> company, -launch_year-> year

Corpus: one passage per entity holding that entity's facts (so the passage of a question's subject is its gold
passage), plus distractor passages (lectures, festivals, rivers) that mention entities but state none of the
asked relations.
Questions: every chain of 1-3 relations from every entity whose entities are all distinct, e.g.
ceo -> alma_mater -> founded: "In which year was the university attended by the CEO of Quorvin Labs founded?".
Each question keeps its gold chain of sub-queries (one single-hop question per hop) and gold passage ids.

Splits: all candidate questions are enumerated once (texts are unique: every name is a fresh word), shuffled by
the seed, and each split takes a disjoint slice per hop count, so no question text appears in two splits
(asserted in `generate`). By default a quarter of the world is a held-out region (relations never leave a region)
that only validation/test ask about. What is guaranteed:
  - no train question, and no hop of a train gold chain (its sub-queries, answers and gold passages), involves a
    held-out entity; every validation/test hop does (tested in tests/data/test_synthetic.py);
  - the facts of a held-out entity are stated only in its own passage (`heldout_titles`); distractor passages may
    name held-out entities but state none of the asked relations;
  - retrieval is not bound by regions: a train search can return a held-out passage in its top-k (a few percent
    of train searches with BM25 top-3 in the default world). The oracle flags those trajectories and `write_sft` drops
    them unless told to keep them (--keep-heldout), so no WRITTEN train trajectory shows a held-out passage
    (tested in tests/data/test_oracle.py). RL rollouts on train questions search the whole corpus and can see them.

No shortcuts: a multi-hop question needs one search per hop. Relations are stated in the subject's passage only
(a CEO's passage does not name the company, which names its CEO), and fact-free overview passages soak up the
generic words of the questions, so one BM25 search with the whole question never returns the passages of all its
hops (tested in tests/data/test_synthetic_shortcuts.py). Names are invented words, never a real place or common
name (`real_names.py`).

    python tools/make_synthetic_world.py --out-dir data/synthetic --seed 0
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pyarrow as pa

from megatron_searchr1.data.prompts import TEMPLATES
from megatron_searchr1.data.qa import make_row, write_rows
from megatron_searchr1.data.real_names import REAL_NAMES
from megatron_searchr1.search.corpus import make_contents, write_corpus

SPLITS = ("train", "validation", "test")
DATA_SOURCE = "synthetic"

# extra_info of a synthetic row: Search-R1's split/index, our uid, the raw question, the hop count and the chain.
HOP_TYPE = pa.struct(
    [("query", pa.string()), ("subject", pa.string()), ("relation", pa.string()), ("answer", pa.string()),
     ("doc_id", pa.string())]
)
SYNTH_EXTRA_INFO_TYPE = pa.struct(
    [("split", pa.string()), ("index", pa.int64()), ("uid", pa.string()), ("question", pa.string()),
     ("hops", pa.int64()), ("chain", pa.list_(HOP_TYPE))]
)


@dataclass
class WorldConfig:
    """Size knobs of the synthetic world; the output is a pure function of this config."""

    seed: int = 0
    """everything (names, facts, question choice, split) is drawn from random.Random(seed)."""
    n_countries: int = 10
    """countries (each gets a capital among its cities)."""
    n_cities: int = 36
    """cities, spread over the countries (at least one per country)."""
    n_universities: int = 36
    """universities, each in a city with a founding year."""
    n_companies: int = 64
    """companies, each with a headquarters city, a founding year and a CEO drawn from the people."""
    n_people: int = 240
    """people (must be >= n_companies: every company has its own CEO)."""
    n_products: int = 48
    """products, each made by a company with a launch year."""
    n_distractors: int = 60
    """passages (lectures, festivals, rivers) that mention entities but state none of the asked relations."""
    n_train: int = 2000
    """train questions."""
    n_validation: int = 200
    """validation questions."""
    n_test: int = 200
    """test questions."""
    hop_fractions: tuple[float, float, float] = (0.4, 0.35, 0.25)
    """share of 1-, 2- and 3-hop questions in every split (set e.g. (1, 0, 0) for single-hop only)."""
    heldout_fraction: float = 0.25
    """share of every entity kind put in a separate region that only validation/test questions ask about, so no
    fact needed for a held-out question appears in a train question, its gold chain or a written train
    trajectory (a model cannot pass the test by memorising the train world; see the module docstring for what
    retrieval can still show). 0 = one region for all splits."""
    template: str = "base"
    """prompt template of the parquet rows: base (Search-R1 raw prompt), chat, short, or tool_calls (the tool_calls
    protocol's prompt: rollout.protocol=tool_calls)."""

    def __post_init__(self):
        self.hop_fractions = tuple(float(f) for f in self.hop_fractions)
        if len(self.hop_fractions) != 3 or min(self.hop_fractions) < 0 or sum(self.hop_fractions) <= 0:
            raise ValueError(f"hop_fractions must be 3 non-negative numbers (1/2/3 hops), got {self.hop_fractions}")
        if self.n_people < self.n_companies:
            raise ValueError(f"n_people ({self.n_people}) must be >= n_companies ({self.n_companies}): one CEO each")
        if self.n_cities < self.n_countries:
            raise ValueError(f"n_cities ({self.n_cities}) must be >= n_countries ({self.n_countries})")
        for name in ("n_countries", "n_universities", "n_companies", "n_products"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {self.heldout_fraction}")
        region_sizes(self)  # raises if a region would lack entities
        if self.template not in TEMPLATES + ("tool_calls",):
            raise ValueError(f"template must be one of {TEMPLATES + ('tool_calls',)}, got {self.template!r}")


# ----------------------------------------------------------------------------------------------- names
_ONSETS = ["b", "br", "d", "dr", "f", "g", "gr", "k", "kr", "l", "m", "n", "p", "pr", "r", "s", "st", "t", "tr",
           "v", "z", "sh", "th", "h", "j", "qu", "y", "w"]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "ei", "ou", "ia", "y"]
_CODAS = ["", "", "n", "r", "l", "s", "th", "m", "x", "nd", "rk", "lt", "sk"]


class NameMaker:
    """Invented words from syllables; every word is used once per world, so names never collide.

    `used` holds every name handed out (lower case), a suffixed one ("Kaboland") as well as its stem ("Kabo"):
    a one-word name made of stem + suffix could otherwise equal a word drawn later (or earlier), and two entities
    with one name would make two questions with one text. A word that is a real place or a common name
    (`real_names.REAL_NAMES`: "Roma", "Provo", "Mila") is redrawn: a model may know facts about it.
    """

    def __init__(self, rng: random.Random):
        self.rng, self.used = rng, set()

    def word(self, suffixes: Sequence[str] | None = None) -> str:
        """A fresh word; with `suffixes`, a fresh word plus one of them drawn at random, the whole also fresh."""
        for _ in range(1000):
            n = self.rng.choice((2, 2, 3))
            w = "".join(self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) for _ in range(n))
            w = (w + self.rng.choice(_CODAS)).capitalize()
            if not 4 <= len(w) <= 11 or w.lower() in self.used or w.lower() in REAL_NAMES:
                continue
            # the suffix is drawn only here, as before suffixes were passed in, so worlds without a clash keep
            # their exact bytes
            full = w + self.rng.choice(suffixes) if suffixes else w
            if full.lower() in self.used or full.lower() in REAL_NAMES:
                continue  # redraw both: this stem + suffix is a name already taken, or a real one
            self.used.update((w.lower(), full.lower()))
            return full
        raise RuntimeError("name space exhausted; lower the entity counts")


_COUNTRY_SUFFIXES = ["ia", "a", "or", "land", ""]
_COMPANY_SUFFIXES = ["Systems", "Industries", "Labs", "Dynamics", "Holdings", "Works", "Group", "Foods", "Motors"]
_INDUSTRIES = ["software", "textile", "shipping", "food", "robotics", "chemicals", "banking", "furniture", "media"]
_PROFESSIONS = ["engineer", "economist", "designer", "chemist", "lawyer", "architect", "accountant", "biologist"]
_PRODUCT_KINDS = ["handheld scanner", "electric kettle", "drone", "smartwatch", "tractor", "desk lamp", "camera"]
_PRODUCT_SUFFIXES = ["Pro", "One", "Max", "Mini", "Air", "Go"]


# ----------------------------------------------------------------------------------------------- relations
@dataclass(frozen=True)
class Relation:
    """A functional relation and the English it is asked and chained with."""

    name: str
    subject: str  # entity type of the subject
    object: str  # entity type of the object ("year" for literal years)
    question: str  # single-hop question, {x} = subject name or nested noun phrase
    phrase: str  # noun phrase naming the object, for nesting and for the oracle's thoughts


RELATIONS = {r.name: r for r in [
    Relation("country_of", "city", "country", "In which country is {x}?", "the country of {x}"),
    Relation("capital", "country", "city", "What is the capital of {x}?", "the capital of {x}"),
    Relation("located_in", "university", "city", "In which city is {x} located?", "the home city of {x}"),
    Relation("university_founded", "university", "year", "In which year was {x} founded?",
             "the founding year of {x}"),
    Relation("headquarters", "company", "city", "In which city is {x} headquartered?",
             "the headquarters city of {x}"),
    Relation("company_founded", "company", "year", "In which year was {x} founded?", "the founding year of {x}"),
    Relation("ceo", "company", "person", "Who is the CEO of {x}?", "the CEO of {x}"),
    Relation("born_year", "person", "year", "In which year was {x} born?", "the birth year of {x}"),
    Relation("birthplace", "person", "city", "In which city was {x} born?", "the birthplace of {x}"),
    Relation("alma_mater", "person", "university", "Which university did {x} attend?",
             "the university attended by {x}"),
    Relation("employer", "person", "company", "Which company does {x} work for?", "the company {x} works for"),
    Relation("maker", "product", "company", "Which company makes {x}?", "the company that makes {x}"),
    Relation("launch_year", "product", "year", "In which year was {x} launched?", "the launch year of {x}"),
]}


# ----------------------------------------------------------------------------------------------- the world
@dataclass
class World:
    """Entities by id (`{id, type, name, facts: {relation: object id or year string}}`) and corpus passages."""

    config: WorldConfig
    entities: dict[str, dict] = field(default_factory=dict)
    passages: list[dict] = field(default_factory=list)  # {id, title, text}; id = row number as a string
    doc_of: dict[str, str] = field(default_factory=dict)  # entity id -> passage id

    def name(self, ref: str) -> str:
        """Surface form of a fact object: an entity's name, or the literal (a year)."""
        return self.entities[ref]["name"] if ref in self.entities else ref

    def of_type(self, kind: str) -> list[dict]:
        return [e for e in self.entities.values() if e["type"] == kind]


REGIONS = ("seen", "heldout")
_KINDS = ("countries", "cities", "universities", "companies", "people", "products")


def region_sizes(cfg: WorldConfig) -> dict[str, dict[str, int]]:
    """Entity counts per region: `heldout_fraction` of every kind goes to the held-out region (if > 0)."""
    sizes: dict[str, dict[str, int]] = {"seen": {}, "heldout": {}}
    for kind in _KINDS:
        total = getattr(cfg, f"n_{kind}")
        held = min(max(round(total * cfg.heldout_fraction), 1), total - 1) if cfg.heldout_fraction > 0 else 0
        sizes["seen"][kind], sizes["heldout"][kind] = total - held, held
    if cfg.heldout_fraction == 0:
        del sizes["heldout"]
    for region, n in sizes.items():
        if n["people"] < n["companies"] or n["cities"] < n["countries"] or min(n.values()) < 1:
            raise ValueError(f"the {region} region would get {n}: every kind needs at least one entity, every "
                             f"company its own CEO and every country a city; raise the entity counts or change "
                             f"heldout_fraction")
    return sizes


def build_world(cfg: WorldConfig) -> World:
    """Draw entities and facts per region, then write one passage per entity plus distractors.

    Relations never cross regions, so a question about a held-out entity involves held-out facts only.
    """
    rng = random.Random(cfg.seed)
    names = NameMaker(rng)
    w = World(cfg)
    counts: dict[str, int] = {}

    def add(kind: str, region: str, name: str, **facts) -> dict:
        counts[kind] = counts.get(kind, 0) + 1
        e = {"id": f"{kind}{counts[kind] - 1}", "type": kind, "region": region, "name": name, "facts": dict(facts)}
        w.entities[e["id"]] = e
        return e

    for region, n in region_sizes(cfg).items():
        _populate(region, n, add, names, rng)

    docs = [(e["name"], _entity_text(w, e, rng), e["id"]) for e in w.entities.values()]
    docs += [(*_distractor(w, names, rng), None) for _ in range(cfg.n_distractors)]
    docs += [(title, text, None) for title, text in _overviews(names)]
    rng.shuffle(docs)  # so that passage ids carry no hint of the entity type
    for i, (title, text, eid) in enumerate(docs):
        w.passages.append({"id": str(i), "title": title, "text": text})
        if eid is not None:
            w.doc_of[eid] = str(i)
    return w


def _populate(region: str, n: dict[str, int], add, names: NameMaker, rng: random.Random) -> None:
    """Entities of one region; every fact object is drawn from the same region."""
    countries = [add("country", region, names.word(_COUNTRY_SUFFIXES))
                 for _ in range(n["countries"])]
    cities = [add("city", region, names.word(), country_of=countries[i]["id"] if i < len(countries)
                  else rng.choice(countries)["id"]) for i in range(n["cities"])]
    for c in countries:  # the first city drawn for a country becomes its capital
        c["facts"]["capital"] = next(x["id"] for x in cities if x["facts"]["country_of"] == c["id"])
    uni_patterns = ["{} University", "University of {}", "{} Institute of Technology", "{} College"]
    universities = [add("university", region, rng.choice(uni_patterns).format(names.word()),
                        located_in=rng.choice(cities)["id"], university_founded=str(rng.randint(1700, 1990)))
                    for _ in range(n["universities"])]
    companies = [add("company", region, f"{names.word()} {rng.choice(_COMPANY_SUFFIXES)}",
                     headquarters=rng.choice(cities)["id"], company_founded=str(rng.randint(1890, 2015)),
                     industry=rng.choice(_INDUSTRIES))
                 for _ in range(n["companies"])]
    people = [add("person", region, f"{names.word()} {names.word()}", born_year=str(rng.randint(1940, 1998)),
                  birthplace=rng.choice(cities)["id"], alma_mater=rng.choice(universities)["id"],
                  employer=rng.choice(companies)["id"], profession=rng.choice(_PROFESSIONS))
              for _ in range(n["people"])]
    for company, person in zip(companies, rng.sample(people, len(companies))):
        company["facts"]["ceo"] = person["id"]
        # A CEO's own passage does not name the company: only the company's passage links the two. Were the link
        # stated both ways, one search for "the birth year of the CEO of O" would return O's passage and the CEO's
        # together (the whole chain: 19 of 19 such questions did), and the question would need no second search.
        del person["facts"]["employer"]
        person["facts"]["profession"] = "business executive"
    for _ in range(n["products"]):
        add("product", region, f"{names.word()} {rng.choice(_PRODUCT_SUFFIXES)}", maker=rng.choice(companies)["id"],
            launch_year=str(rng.randint(1985, 2024)), category=rng.choice(_PRODUCT_KINDS))


def _entity_text(w: World, e: dict, rng: random.Random) -> str:
    """The entity's passage: every fact about it, in one of a few phrasings."""
    n, f = e["name"], e["facts"]
    pick = rng.choice
    if e["type"] == "country":
        return pick(["{n} is a country. Its capital is {c}.", "{n} is a small country whose capital city is {c}."]
                    ).format(n=n, c=w.name(f["capital"]))
    if e["type"] == "city":
        return pick(["{n} is a city located in {c}.", "{n} is a town in the country of {c}."]
                    ).format(n=n, c=w.name(f["country_of"]))
    if e["type"] == "university":
        return pick(["{n} is a university located in {c}. It was founded in {y}.",
                     "Founded in {y}, {n} is a public university in the city of {c}."]
                    ).format(n=n, c=w.name(f["located_in"]), y=f["university_founded"])
    if e["type"] == "company":
        return pick(["{n} is a {i} company founded in {y}. It is headquartered in {c}. Its CEO is {p}.",
                     "{n} is headquartered in {c}. The {i} company was founded in {y}, and {p} is its CEO."]
                    ).format(n=n, i=f["industry"], y=f["company_founded"], c=w.name(f["headquarters"]),
                             p=w.name(f["ceo"]))
    if e["type"] == "person":
        last = n.split()[-1]
        job = f"{_article(f['profession'])} {f['profession']}"
        if "employer" not in f:  # a CEO (see _populate): no company named here
            return pick(["{n} (born {y} in {b}) attended {u}. {l} is {j}.",
                         "{n} was born in {b} in {y}. After attending {u}, {l} became {j}."]
                        ).format(n=n, y=f["born_year"], b=w.name(f["birthplace"]), l=last,
                                 u=w.name(f["alma_mater"]), j=job)
        return pick(["{n} (born {y} in {b}) attended {u}. {l} works for {o} as {j}.",
                     "{n} was born in {b} in {y}. After attending {u}, {l} now works for {o} as {j}."]
                    ).format(n=n, y=f["born_year"], b=w.name(f["birthplace"]), l=last,
                             u=w.name(f["alma_mater"]), o=w.name(f["employer"]), j=job)
    if e["type"] == "product":
        return pick(["{n} is {a} {k} made by {o}. It was first launched in {y}.",
                     "The {n}, a {k}, is made by {o} and was launched in {y}."]
                    ).format(n=n, k=f["category"], a=_article(f["category"]), o=w.name(f["maker"]), y=f["launch_year"])
    raise AssertionError(e["type"])


def _article(noun: str) -> str:
    return "an" if noun[0] in "aeiou" else "a"


def _distractor(w: World, names: NameMaker, rng: random.Random) -> tuple[str, str]:
    """A passage that mentions entities (so it competes in retrieval) but states none of the asked relations."""
    people = [e["name"] for e in w.of_type("person")]
    cities = [e["name"] for e in w.of_type("city")]
    kind = rng.random()
    if kind < 0.35:  # names a person, a university and a company together: hard for "which university did P attend?"
        title = f"{names.word()} Lecture"
        p = rng.choice(people)
        u, o = rng.choice(w.of_type("university"))["name"], rng.choice(w.of_type("company"))["name"]
        return title, (f"The {title} is an annual talk hosted by {u}. In {rng.randint(1990, 2024)} it was given "
                       f"by {p}, who spoke about the history of {o}.")
    if kind < 0.7:
        title = f"{rng.randint(1950, 2024)} {names.word()} Festival"
        a, b = rng.sample(people, 2)
        return title, f"The {title} was a cultural event held in {rng.choice(cities)}. Guests included {a} and {b}."
    title = f"{names.word()} River"
    a, b = rng.sample(cities, 2)
    return title, f"The {title} is a river that flows past {a} and {b}. It is about {rng.randint(40, 900)} km long."


_NOUN = {"city": "city", "country": "country", "university": "university", "company": "company",
         "person": "person", "product": "product"}


def _overviews(names: NameMaker) -> list[tuple[str, str]]:
    """Two fact-free passages per relation, worded like its question and its phrase ("the founding year of a
    university ... In which year was a university founded?"). Why: without them a whole multi-hop question such as
    "In which year was the university attended by P founded?" ranks P's passage first and then, on the generic
    words alone, whichever two university passages BM25 likes best, so now and then the second hop's gold passage
    came back by chance and one search answered the question. These passages match the generic words better than
    any entity passage and name no entity, so only a search with the first hop's answer finds the second hop's
    passage; a search that names an entity still gets that entity's passage first."""
    out = []
    for r in RELATIONS.values():
        noun = _NOUN[r.subject]
        question = r.question.format(x=f"a {noun}" if noun[0] not in "aeiou" else f"an {noun}")
        phrase = r.phrase.format(x=f"each {noun}")
        # Never "<phrase> is ...": a trajectory's reasoning says "The <phrase of X> is <answer>", and a passage
        # with "<phrase> is not given" is a pattern a small model copies from instead of the entity's passage.
        out.append((f"{names.word()} Handbook",
                    f"A reference handbook. Readers often ask: {question} The handbook explains how records of "
                    f"{phrase} are kept, and why they matter, without listing any {noun} by name."))
        out.append((f"{names.word()} Survey",
                    f"A survey about {phrase}. The survey's opening question is: {question} It reports general "
                    f"trends only and names no {noun} in particular; for {phrase} ask about one {noun}."))
    return out


# ----------------------------------------------------------------------------------------------- questions
def _chains(max_hops: int = 3) -> list[tuple[str, ...]]:
    """Every relation sequence whose types line up (object of hop i = subject of hop i+1), up to max_hops."""
    out = [(r,) for r in RELATIONS]
    frontier = list(out)
    for _ in range(max_hops - 1):
        frontier = [c + (r,) for c in frontier for r, rel in RELATIONS.items()
                    if rel.subject == RELATIONS[c[-1]].object]
        out += frontier
    return out


def enumerate_questions(w: World) -> list[dict]:
    """All answerable questions: every chain from every entity of the right type, entities all distinct."""
    out, seen = [], set()
    for chain in _chains():
        for start in w.of_type(RELATIONS[chain[0]].subject):
            node, hops, visited = start["id"], [], {start["id"]}
            for r in chain:
                obj = w.entities[node]["facts"].get(r)
                if obj is None:  # this entity lacks the relation (a CEO has no `employer`): no such question
                    break
                hops.append({"query": RELATIONS[r].question.format(x=w.name(node)), "subject": w.name(node),
                             "relation": r, "answer": w.name(obj), "doc_id": w.doc_of[node]})
                if obj in visited:  # e.g. capital of the country of a capital: the answer would be the start
                    break
                visited.add(obj)
                node = obj
            else:
                phrase = start["name"]
                for r in chain[:-1]:
                    phrase = RELATIONS[r].phrase.format(x=phrase)
                question = RELATIONS[chain[-1]].question.format(x=phrase)
                if question in seen:
                    raise AssertionError(f"duplicate question text {question!r}")  # names are unique words
                seen.add(question)
                out.append({"question": question, "answer": hops[-1]["answer"], "hops": len(chain), "chain": hops,
                            "region": start["region"]})
    return out


def split_questions(questions: list[dict], cfg: WorldConfig) -> dict[str, list[dict]]:
    """Disjoint train/validation/test slices with the configured hop mix.

    Each (region, hop count) pool is shuffled once and cut into consecutive slices, one per split, so a question
    can only land in one split. With a held-out region, validation and test draw from it and train from the rest.
    """
    rng = random.Random(cfg.seed + 1)  # a separate stream: changing question counts does not change the world
    heldout = cfg.heldout_fraction > 0
    region_of = {"train": "seen", "validation": "heldout" if heldout else "seen", "test": "heldout" if heldout
                 else "seen"}
    pools = {(r, h): [q for q in questions if q["hops"] == h and q["region"] == r] for r in REGIONS for h in (1, 2, 3)}
    for key in sorted(pools):
        rng.shuffle(pools[key])
    taken = {key: 0 for key in pools}
    total = sum(cfg.hop_fractions)
    out = {}
    for split, n in (("test", cfg.n_test), ("validation", cfg.n_validation), ("train", cfg.n_train)):
        counts = [int(n * f / total) for f in cfg.hop_fractions]
        for i in sorted(range(3), key=lambda i: -cfg.hop_fractions[i])[: n - sum(counts)]:
            counts[i] += 1  # rounding leftovers go to the biggest shares
        rows = []
        for h, k in zip((1, 2, 3), counts):
            key = (region_of[split], h)
            if taken[key] + k > len(pools[key]):
                raise ValueError(
                    f"the {key[0]} region of the world has only {len(pools[key])} distinct {h}-hop questions, and "
                    f"the splits drawing from it ask for {taken[key] + k} so far; raise the entity counts "
                    f"(n_people, n_companies, ...), lower n_train/n_validation/n_test or change hop_fractions or "
                    f"heldout_fraction"
                )
            rows += pools[key][taken[key]: taken[key] + k]
            taken[key] += k
        rng.shuffle(rows)
        out[split] = rows
    return {s: out[s] for s in SPLITS}


def question_rows(split_qs: dict[str, list[dict]], template: str = "base") -> dict[str, list[dict]]:
    """Search-R1 parquet rows; `data_source` is synthetic_<h>hop so validation metrics break down by hop count.
    template `tool_calls`: the prompt is the tool_calls protocol's (rollout/protocols/tool_calls.py
    `tool_calls_messages`; the chat template adds the tools when the rollout renders it)."""
    out = {}
    for split, qs in split_qs.items():
        out[split] = [
            make_row(q["question"], [q["answer"]], f"{DATA_SOURCE}_{q['hops']}hop", split, i,
                     uid=f"{DATA_SOURCE}-{split}-{i}", template="chat" if template == "tool_calls" else template,
                     extra={"hops": q["hops"], "chain": q["chain"]})
            for i, q in enumerate(qs)
        ]
        if template == "tool_calls":
            from megatron_searchr1.rollout.protocols.tool_calls import tool_calls_messages

            for row in out[split]:
                row["prompt"] = tool_calls_messages(row["extra_info"]["question"])
    return out


def heldout_titles(w: World) -> set[str]:
    """Titles of the held-out entities' passages: the only passages that state held-out facts (titles are unique,
    every name being a fresh word). Empty for a world without a held-out region."""
    titles = {p["id"]: p["title"] for p in w.passages}
    return {titles[w.doc_of[e["id"]]] for e in w.entities.values() if e["region"] == "heldout"}


def corpus_records(w: World) -> list[dict]:
    """Corpus rows in the Search-R1 / FlashRAG format."""
    return [{"id": p["id"], "contents": make_contents(p["title"], p["text"])} for p in w.passages]


def generate(cfg: WorldConfig) -> tuple[World, dict[str, list[dict]]]:
    """The world and its parquet rows per split."""
    world = build_world(cfg)
    rows = question_rows(split_questions(enumerate_questions(world), cfg), cfg.template)
    texts = {s: {r["extra_info"]["question"] for r in rs} for s, rs in rows.items()}
    for a in SPLITS:
        for b in SPLITS:
            if a < b and texts[a] & texts[b]:
                raise AssertionError(f"question overlap between {a} and {b}")
    return world, rows


def write_world(world: World, rows: dict[str, list[dict]], out_dir: str) -> dict[str, str]:
    """corpus.jsonl, <split>.parquet and world.json (entities and facts, for debugging and tests)."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"corpus": os.path.join(out_dir, "corpus.jsonl"), "world": os.path.join(out_dir, "world.json")}
    write_corpus(corpus_records(world), paths["corpus"])
    for split, rs in rows.items():
        paths[split] = os.path.join(out_dir, f"{split}.parquet")
        write_rows(rs, paths[split], SYNTH_EXTRA_INFO_TYPE)
    with open(paths["world"], "w", encoding="utf-8") as f:
        json.dump({"config": dataclasses.asdict(world.config), "entities": world.entities, "doc_of": world.doc_of},
                  f, indent=1, sort_keys=True)
    return paths
