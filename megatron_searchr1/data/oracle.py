"""Gold trajectories for supervised warm-up: an oracle that follows each question's gold chain with a REAL retriever.

For a question with chain [(q1, a1), (q2, a2), ...] the oracle writes, turn by turn:

    <think> I need to find the CEO of Quorvin Labs. </think>\n<search> Who is the CEO of Quorvin Labs? </search>
    \n\n<information>{what the retriever returned for q1}</information>\n\n          (an `observation` message)
    <think> The CEO of Quorvin Labs is Talven Orrick. Next I need to find ... </think>\n<search> q2 </search>
    ...
    <think> The founding year of Velmora University is 1856. </think>\n<answer> 1856 </answer>

The observation text is produced by the retriever the policy will later talk to (a `RetrievalClient` against a
running server, or a retriever object formatted with the client's `format_docs`), so warm-up data and RL rollouts
see the same bytes. A trajectory whose retrieval missed a gold passage is flagged (`gold_retrieved: false`): its
thoughts state a fact the observation does not show, so by default it is not written.

A train trajectory can also be *shown* a held-out passage: the questions of the train split never ask about the
held-out region (synthetic.py), but a search for a train fact can still rank a held-out entity's passage in its
top-k (BM25 matches shared words such as "University" or "founded"; a few percent of train searches).
With `heldout_titles` the oracle flags such trajectories (`shows_heldout: true`) by the titles of the passages in
each observation (every synthetic name is a fresh word, so a title names exactly one passage; the same check
works on the server's text and on in-process results), and by default `write_sft` does not write them either, so
SFT never trains on a held-out fact.

A lazy demonstrator (`stop_early`): with that probability at each point where a multi-hop chain needs another
search, the trajectory stops searching and answers a guess instead (the final answer of another question of the
same split that ends in the same relation, so the right kind of value and almost surely wrong):

    <think> The CEO of Quorvin Labs is Talven Orrick. I will guess the answer. </think>\n<answer> 1961 </answer>

Why: a warm-up on perfect chains leaves RL little to do; one that copies a demonstrator who gives up early on
multi-hop questions leaves the decision Search-R1's RL is about (search again, or answer now) to be learned from
the reward. Single-hop trajectories always search (the warm-up must still know how to search and read).

Either protocol (`protocol`): Search-R1's tags as above, or the tool_calls protocol's (rows made with the
`tool_calls` template): LLaMA-Factory's own tool data, each search a `function_call` message holding the same
thought as Search-R1's turn in a think block, then the call (`<think> I need to find ... </think>\n{"name": "search",
"arguments": {"query": ...}}`: LLaMA-Factory keeps such a block and renders it before the call, as Qwen's template
renders an assistant message's content before `<tool_call>`), its result an `observation` message (the search tool's
text, document ids included: pass a searcher that writes them, `retriever_searcher(..., doc_ids=True)`), the answer
an assistant message with its thought (as in Search-R1's format), and the record's `tools` (the search tool's
schema); `write_sft` declares the `tools` column. data/sft_data.py tokenizes such records to the tool_calls
rollout's ids. The thought is what carries the decision to search again ("X is Y. Next I need to find ...") and the
name the next query copies; without it a second call would start right after the observation with nothing leading
to it.

Output: sharegpt-style JSONL (`{"messages": [{"role", "content"}, ...]}` with roles system?/user/assistant/
observation) and a LLaMA-Factory `dataset_info.json` describing it.
"""
from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Callable, Collection

from megatron_searchr1.data.prompts import THINK_END, THINK_START, answer_turn, format_observation, search_turn
from megatron_searchr1.data.qa import plain
from megatron_searchr1.data.synthetic import RELATIONS
from megatron_searchr1.search.client import is_search_failure

# queries -> one observation text per query (the `format_docs` string, before <information> wrapping)
Searcher = Callable[[list[str]], list[str]]

DATASET_TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
                "observation_tag": "observation", "system_tag": "system"}


def retriever_searcher(retriever, topk: int = 3, doc_ids: bool = False) -> Searcher:
    """Search in-process with a retriever object (`load_retriever(index_dir)`), formatted like the server's
    results are by the client (`doc_ids`: with each document's id, as the tool_calls protocol's search tool)."""
    from megatron_searchr1.search.client import format_docs

    def search(queries: list[str]) -> list[str]:
        return [format_docs([doc for doc, _ in hits], doc_ids) for hits in retriever.search(queries, topk)]

    return search


def client_searcher(client) -> Searcher:
    """Search through a running server (`RetrievalClient(url, topk=3)`)."""
    return client.search


# one `Doc {i}(Title: "{title}") text` entry of client.format_docs; titles of FlashRAG corpora keep their quotes
_DOC_HEAD = re.compile(r'^Doc (\d+)\((?:id: [^,\n]*, )?Title: "(.*?)"\) ', re.MULTILINE)


def observed_titles(text: str) -> list[str]:
    """Titles (quotes stripped) of the passages in one observation text, in rank order.

    Only heads numbered 1, 2, 3, ... in sequence count, so a passage text that happens to contain a line like
    `Doc 2(Title: "x") ` cannot add a title out of order.

    >>> observed_titles('Doc 1(Title: "Paris") Capital.\\nDoc 2(id: 9, Title: "Lyon") A city.\\n')
    ['Paris', 'Lyon']
    """
    titles = []
    for m in _DOC_HEAD.finditer(text):
        if int(m.group(1)) == len(titles) + 1:
            titles.append(m.group(2))
    return titles


def call_turn(thought: str, query: str) -> str:
    """A `function_call` turn's content in the tool_calls protocol: the thought search_turn writes, as a think block
    (LLaMA-Factory's `<think>...</think>` in a function_call turn, rendered before the call), then the JSON call.

    >>> print(call_turn("I need to find the CEO of Acme.", "Who is the CEO of Acme?"))
    <think> I need to find the CEO of Acme. </think>
    {"name": "search", "arguments": {"query": "Who is the CEO of Acme?"}}
    """
    return f"{THINK_START} {thought} {THINK_END}\n" + json.dumps({"name": "search", "arguments": {"query": query}})


def _fact(hop: dict) -> str:
    """'the CEO of Quorvin Labs' for a hop (the object phrase with the resolved subject name)."""
    return RELATIONS[hop["relation"]].phrase.format(x=hop["subject"])


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def gold_trajectories(rows: list[dict], search: Searcher, gold_text: dict[str, str] | None = None,
                      batch_size: int = 256, heldout_titles: Collection[str] | None = None,
                      stop_early: float = 0.0, seed: int = 0, protocol: str = "search_r1") -> list[dict]:
    """One trajectory per parquet row (a synthetic question with `extra_info.chain`).

    Queries of the same hop are sent together in batches of `batch_size`. gold_text maps doc id -> passage text;
    with it, `gold_retrieved` checks that each hop's gold passage is in its observation, without it that the hop's
    subject and answer are. heldout_titles (`synthetic.heldout_titles(world)`; pass it for TRAIN rows only, the
    held-out passages are the gold of validation/test): `shows_heldout` is true when any observation contains a
    passage with one of these titles (always false without it). stop_early: the lazy demonstrator's probability of
    answering a guess at each point where a chain needs another search (module docstring), drawn with `seed`;
    `searches` says how many hops a trajectory searched and `answer` is what it answers. protocol: search_r1 or
    tool_calls (module docstring).
    """
    if protocol not in ("search_r1", "tool_calls"):
        raise ValueError(f"protocol must be search_r1 or tool_calls, got {protocol!r}")
    if not 0.0 <= stop_early <= 1.0:
        raise ValueError(f"stop_early must be a probability in [0, 1], got {stop_early}")
    rows = [plain(r) for r in rows]
    heldout = frozenset(heldout_titles or ())
    chains = [r["extra_info"]["chain"] for r in rows]
    obs: list[list[str]] = [[] for _ in rows]
    for h in range(max((len(c) for c in chains), default=0)):
        todo = [i for i, c in enumerate(chains) if len(c) > h]
        for s in range(0, len(todo), batch_size):
            part = todo[s: s + batch_size]
            texts = search([chains[i][h]["query"] for i in part])
            if len(texts) != len(part):
                raise RuntimeError(f"searcher returned {len(texts)} results for {len(part)} queries")
            for i, t in zip(part, texts):
                if is_search_failure(t):  # the client's error observation: never train on it
                    raise RuntimeError(f"retrieval failed for {chains[i][h]['query']!r}: {t}")
                obs[i].append(t)
    rng = random.Random(seed)
    guesses: dict[str, list[str]] = {}  # final relation -> final answers of the split, the lazy answer's pool
    for c in chains:
        guesses.setdefault(c[-1]["relation"], []).append(c[-1]["answer"])
    out = []
    for row, chain, texts in zip(rows, chains, obs):
        messages = [dict(m) for m in row["prompt"]]
        thought = f"I need to find {_fact(chain[0])}."
        found, shown = True, False
        answer = chain[-1]["answer"]
        for h, (hop, text) in enumerate(zip(chain, texts)):
            if protocol == "tool_calls":
                messages.append({"role": "function_call", "content": call_turn(thought, hop["query"])})
                messages.append({"role": "observation", "content": text.strip()})
            else:
                messages.append({"role": "assistant", "content": search_turn(thought, hop["query"])})
                messages.append({"role": "observation", "content": format_observation(text)})
            if gold_text is not None:
                found &= gold_text[hop["doc_id"]] in text
            else:
                found &= hop["subject"] in text and hop["answer"] in text
            shown |= not heldout.isdisjoint(observed_titles(text))
            thought = f"{_cap(_fact(hop))} is {hop['answer']}."
            if h + 1 < len(chain):
                if stop_early and rng.random() < stop_early:
                    pool = [g for g in guesses[chain[-1]["relation"]] if g != answer]
                    if pool:
                        answer = rng.choice(pool)
                        thought += " I will guess the answer."
                        break
                thought += f" Next I need to find {_fact(chain[h + 1])}."
        messages.append({"role": "assistant", "content": answer_turn(thought, answer)})
        out.append({"messages": messages, "uid": row["extra_info"]["uid"], "data_source": row["data_source"],
                    "hops": len(chain), "searches": h + 1, "answer": answer, "gold_retrieved": bool(found),
                    "shows_heldout": shown})
        if protocol == "tool_calls":
            from megatron_searchr1.config.tools import BUILTIN

            s = BUILTIN["search"]
            out[-1]["tools"] = json.dumps([{"name": s.name, "description": s.description, "parameters": s.parameters}])
    return out


def write_sft(trajectories: dict[str, list[dict]], out_dir: str, prefix: str = "synthetic_sft",
              keep_misses: bool = False, keep_heldout: bool = False) -> dict[str, int]:
    """`<out_dir>/<split>.jsonl` per split and `<out_dir>/dataset_info.json` naming them `<prefix>_<split>`.

    Skips trajectories that missed a gold passage (unless keep_misses) and those shown a held-out passage (unless
    keep_heldout); `skipped_counts` says how many of each. Returns the number of trajectories written per split.
    """
    os.makedirs(out_dir, exist_ok=True)
    info, counts = {}, {}
    for split, trajs in trajectories.items():
        kept = [t for t in trajs if (keep_misses or t["gold_retrieved"])
                and (keep_heldout or not t.get("shows_heldout", False))]
        path = os.path.join(out_dir, f"{split}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            for t in kept:
                f.write(json.dumps(t, ensure_ascii=False) + "\n")
        info[f"{prefix}_{split}"] = {"file_name": f"{split}.jsonl", "formatting": "sharegpt",
                                     "columns": {"messages": "messages"}, "tags": dict(DATASET_TAGS)}
        if any("tools" in t for t in trajs):  # the tool_calls protocol's records (gold_trajectories)
            info[f"{prefix}_{split}"]["columns"]["tools"] = "tools"
            info[f"{prefix}_{split}"]["tags"]["function_tag"] = "function_call"
        counts[split] = len(kept)
    with open(os.path.join(out_dir, "dataset_info.json"), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=2)
    return counts


def skipped_counts(trajectories: list[dict]) -> dict[str, int]:
    """How many trajectories missed a gold passage and how many were shown a held-out one (the two can overlap)."""
    return {"missed_gold": sum(not t["gold_retrieved"] for t in trajectories),
            "shows_heldout": sum(bool(t.get("shows_heldout", False)) for t in trajectories)}
