"""Tree rollouts (Tree-GRPO, arXiv 2509.21240): each prompt grows M trees whose nodes are turn boundaries, and every
leaf is an ordinary, complete Trajectory.

    roots = [Trajectory.start(...) for each prompt, M times]      # one per tree (sample = the tree's number)
    trees, stats = grow_trees(engine, tokenizer, search, roots, settings, TreeSettings(rounds=1, samples=3))
    leaves = [leaf for tree in trees for leaf in tree]              # leaf.meta["tree"]: TreeCoords

The schedule (the Tree-GRPO repository's, AMAP-ML/Tree-GRPO `run_llm_loop_tree_search`):
  1. every root runs as one chain to its end (rollout/loop.py's per-turn `advance`, all trees batched); after each
     turn a trajectory that goes on leaves a node: the state after the turn's observation (or invalid-action
     feedback), where its next turn starts;
  2. L rounds: per tree, N nodes are drawn (with replacement) from the root and the tree's nodes (`select`:
     random, the paper's; or uncertainty, in proportion to the mean negative log-prob of the turn that led to the
     node); each draw forks its node: a new trajectory holding the node's tokens, masks, log-probs and counters,
     which samples its own continuation to the end (all forks of a round batched; a fork's nodes join the tree);
  3. with `max_leaves`, that many leaves per tree are kept, drawn at random (the repository's `sample_leaf`).
A tree so has 1 + L*N leaves (or max_leaves): a fixed count, so a prompt's group always holds M * that many.

KV reuse. A fork's context is its node's tokens, which the engine computed for the source trajectory. On an engine
with KV sessions (vLLM) each trajectory is a session; the source's session ends when it finishes and its full KV
blocks stay in vLLM's prefix cache, so the fork's first turn computes only the node's last partial block and the new
tokens (`Generation.num_cached_tokens` counts what was reused; tools/benchmarks/bench_tree.py measures it).

Seeds: every advance gets the settings' seed plus a running call number (so a fork's draw is not its source's), and
node choice draws from a Python RNG seeded from the same seed: the ranks of one vLLM engine (engine TP > 1) make the
same choices and feed the engine identical prompts.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional

from megatron_searchr1.data.prompts import INVALID_ACTION_FEEDBACK
from megatron_searchr1.rollout.engine import Engine, keeps_sessions
from megatron_searchr1.rollout.loop import LoopSettings, RolloutStats, Searcher, Trajectory, advance

SELECT_RULES = ("random", "uncertainty")
OPEN = 1 << 62
"""The end of a leaf's own stretch of its response (open-ended)."""


@dataclass(frozen=True)
class TreeSettings:
    """How trees grow (config.rollout.tree's fields, the trees per prompt being the number of roots given)."""

    rounds: int = 1
    """L: expansion rounds after the first chains."""
    samples: int = 2
    """N: forks per tree per round."""
    select: str = "random"
    """Node choice: random or uncertainty."""
    max_leaves: int = 0
    """Leaves kept per tree (0 = all)."""

    def __post_init__(self):
        if self.select not in SELECT_RULES:
            raise ValueError(f"select must be one of {', '.join(SELECT_RULES)}, got {self.select!r}")

    @property
    def leaves_per_tree(self) -> int:
        grown = 1 + self.rounds * self.samples
        return min(grown, self.max_leaves) if self.max_leaves else grown


@dataclass(frozen=True)
class TreeCoords:
    """Where a leaf sits in its tree (`leaf.meta["tree"]`)."""

    tree: str
    """The tree's id: the prompt's uid and the tree's number ("uid/2"); unique in the batch."""
    leaf: int
    """The leaf's number in its tree, in order of creation (0: the first chain)."""
    parent: int
    """The leaf it was forked from (-1: the first chain, or a fork of the root)."""
    depth: int
    """Turns taken at the node it branched from (0: the root)."""
    shared_prefix: int
    """Response tokens it shares with `parent` (the node's length; 0 at the root)."""
    segments: tuple[tuple[int, int], ...]
    """Which leaf generated each stretch of the response: (leaf, end) pairs, the last one its own (algo/tree.py)."""


@dataclass
class _Node:
    """A turn boundary of a trajectory of a tree: the state its next turn starts from."""

    owner: Trajectory
    length: int
    turns: int
    n_searches: int
    n_invalid: int
    n_queries: int
    uncertainty: float
    """Mean negative log-prob of the generated tokens of the turn that led here."""


@dataclass
class _Tree:
    root: Trajectory
    """The first chain (leaf 0)."""
    leaves: list[Trajectory] = field(default_factory=list)
    nodes: list[_Node] = field(default_factory=list)


def _coords(t: Trajectory) -> TreeCoords:
    return t.meta["tree"]


def _fork(tree: _Tree, tree_id: str, node: Optional[_Node]) -> Trajectory:
    """A new leaf of `tree` starting at `node` (None: the root, i.e. a new chain of the prompt)."""
    src = tree.root if node is None else node.owner
    number = len(tree.leaves)
    meta = {k: v for k, v in src.meta.items() if k != "tree"}
    if node is None:
        t = Trajectory(prompt_ids=list(src.prompt_ids), uid=src.uid, meta=meta)
        meta["tree"] = TreeCoords(tree_id, number, -1, 0, 0, ((number, OPEN),))
    else:
        n = node.length
        t = Trajectory(prompt_ids=list(src.prompt_ids), uid=src.uid, response_ids=src.response_ids[:n],
                       loss_mask=src.loss_mask[:n], logprobs=src.logprobs[:n], versions=src.versions[:n],
                       turns=node.turns, n_searches=node.n_searches, n_invalid=node.n_invalid,
                       queries=src.queries[:node.n_queries], meta=meta)
        segs, start = [], 0
        for owner, end in _coords(src).segments:  # the source's stretches up to the node, then this leaf's own
            if start >= n:
                break
            segs.append((owner, min(end, n)))
            start = end
        meta["tree"] = TreeCoords(tree_id, number, _coords(src).leaf, node.turns, n, tuple(segs) + ((number, OPEN),))
    tree.leaves.append(t)
    return t


def _uncertainty(t: Trajectory, start: int) -> float:
    """Mean -log p of the generated tokens after `start` (the turn just taken)."""
    lps = [lp for lp, m in zip(t.logprobs[start:], t.loss_mask[start:]) if m]
    return -sum(lps) / len(lps) if lps else 0.0


def _run(engine: Engine, tokenizer, search: Searcher, trajs: list[Trajectory], s: LoopSettings, stats: RolloutStats,
         tree_of: dict[int, _Tree], calls: list[int]) -> None:
    """Every trajectory of `trajs` to its end, turn by turn, each turn of each active one a node of its tree."""
    sessions = keeps_sessions(engine)
    invalid_ids = tokenizer.encode(INVALID_ACTION_FEEDBACK, add_special_tokens=False)
    for _ in range(s.max_turns + 2):  # advance finishes every trajectory at its turn max_turns + 1
        active = [t for t in trajs if t.active]
        if not active:
            return
        start = {id(t): len(t.response_ids) for t in active}
        seed = None if s.seed is None else s.seed + calls[0]
        calls[0] += 1
        advance(engine, tokenizer, search, active, s, lambda t: stats, invalid_ids, sessions, 0, seed)
        for t in active:
            if t.active:
                tree_of[id(t)].nodes.append(_Node(t, len(t.response_ids), t.turns, t.n_searches, t.n_invalid,
                                                  len(t.queries), _uncertainty(t, start[id(t)])))
    raise AssertionError("a trajectory outlived max_turns + 1 turns")  # advance's final turn always finishes


def _choose(tree: _Tree, k: int, rule: str, rng: random.Random) -> list[Optional[_Node]]:
    """k draws (with replacement) among the root (None) and the tree's nodes."""
    cands: list[Optional[_Node]] = [None] + list(tree.nodes)
    if rule == "random" or not tree.nodes:
        return rng.choices(cands, k=k)
    w = [n.uncertainty for n in tree.nodes]
    weights = [sum(w) / len(w)] + w
    if sum(weights) <= 0:
        return rng.choices(cands, k=k)
    return rng.choices(cands, weights=weights, k=k)


def grow_trees(engine: Engine, tokenizer, search: Searcher, roots: list[Trajectory], settings: LoopSettings,
               tree: TreeSettings) -> tuple[list[list[Trajectory]], RolloutStats]:
    """Grow one tree from each root (module doc); returns each tree's leaves (creation order, each finished, with
    `meta["tree"]`) and the rollout's counters. A root's `sample` is its tree's number among its prompt's trees;
    a leaf's `sample` becomes tree number * leaves per tree + its place among the kept leaves, unique per prompt."""
    s = settings
    stats = RolloutStats()
    rng = random.Random(0 if s.seed is None else s.seed)
    trees = [_Tree(root=r) for r in roots]
    ids = [f"{r.uid}/{r.sample}" for r in roots]
    tree_of: dict[int, _Tree] = {}
    calls = [0]
    try:
        firsts = []
        for tr, tid in zip(trees, ids):
            r = tr.root
            r.meta["tree"] = TreeCoords(tid, 0, -1, 0, 0, ((0, OPEN),))
            tr.leaves.append(r)
            tree_of[id(r)] = tr
            firsts.append(r)
        _run(engine, tokenizer, search, firsts, s, stats, tree_of, calls)
        for _ in range(tree.rounds):
            forks = []
            for tr, tid in zip(trees, ids):
                for node in _choose(tr, tree.samples, tree.select, rng):
                    f = _fork(tr, tid, node)
                    tree_of[id(f)] = tr
                    forks.append(f)
            _run(engine, tokenizer, search, forks, s, stats, tree_of, calls)
    finally:
        if keeps_sessions(engine):
            engine.end_sessions([id(t) for tr in trees for t in tr.leaves])
    out = []
    per_tree = tree.leaves_per_tree
    for tr in trees:
        leaves = tr.leaves
        if len(leaves) > per_tree:
            keep = set(rng.sample(range(len(leaves)), per_tree))
            leaves = [t for i, t in enumerate(leaves) if i in keep]
        number = tr.root.sample  # the tree's number among its prompt's trees (the root's sample is renumbered below)
        for i, t in enumerate(leaves):
            t.sample = number * per_tree + i
        out.append(leaves)
    stats.finish.update(t.finish_reason for leaves in out for t in leaves)
    return out, stats


def tree_metrics(trees: list[list[Trajectory]]) -> dict[str, float]:
    """What the trees look like: leaves per tree, forks' branch depth (turns) and shared-prefix share."""
    leaves = [t for tr in trees for t in tr]
    forks = [t for t in leaves if _coords(t).shared_prefix > 0]
    total = sum(len(t.response_ids) for t in leaves)
    return {"tree/leaves_per_tree": len(leaves) / max(len(trees), 1),
            "tree/forks_from_nodes": len(forks) / max(len(leaves), 1),
            "tree/branch_depth_mean": sum(_coords(t).depth for t in forks) / max(len(forks), 1),
            "tree/shared_token_share": sum(_coords(t).shared_prefix for t in forks) / max(total, 1)}
