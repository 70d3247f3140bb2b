"""rollout/engine_groups.py against megatron.core's own rank generator: an engine never spans two replicas."""
import pytest

from megatron_searchr1.config import ConfigError, load_config
from megatron_searchr1.config.layout import replicas
from megatron_searchr1.rollout.engine_groups import EngineLayout, LayoutError


def _megatron_replicas(tp, pp, dp):
    from megatron.core.parallel_state import RankGenerator

    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")  # parallel_state's default order
    return sorted(sorted(g) for g in gen.get_ranks("tp-pp"))


def _layouts(max_world=64):
    for world in range(1, max_world + 1):
        for tp in range(1, world + 1):
            for pp in range(1, world // tp + 1):
                if world % (tp * pp):
                    continue
                for e in range(1, world + 1):
                    if world % e == 0:
                        yield world, tp, pp, world // (tp * pp), e


def test_every_layout_up_to_64_ranks_matches_megatron_and_never_spans_replicas():
    accepted = refused = 0
    cache = {}
    for world, tp, pp, dp, e in _layouts():
        key = (tp, pp, dp)
        if key not in cache:
            cache[key] = _megatron_replicas(tp, pp, dp)
            assert sorted(replicas(world, tp, pp)) == cache[key], key
        replica_of = {r: i for i, g in enumerate(cache[key]) for r in g}
        # what vLLM's external_launcher does: consecutive ranks
        vllm_groups = [list(range(s, s + e)) for s in range(0, world, e)]
        spans = any(len({replica_of[r] for r in g}) > 1 for g in vllm_groups)
        try:
            layout = EngineLayout(world, tp, pp, e)
        except LayoutError:
            assert spans, (tp, pp, dp, e)  # refused only where an engine really would span replicas
            assert dp > 1 and tp % e
            refused += 1
            continue
        assert not spans, (tp, pp, dp, e)
        accepted += 1
        assert layout.groups == vllm_groups
        # one rule for both scopes: the engines that hold a list each take items[k::n], every item goes to exactly
        # one engine, each engine's ranks agree on k and exactly one of them (its first) hands the results in
        for scope, holders in (("replica", cache[key]), ("world", [list(range(world))])):
            for ranks in holders:
                items = list(range(3 * len(ranks) + 1))
                shards = {r: layout.shard(r, scope) for r in ranks}
                taken = sorted(x for r, sh in shards.items() if sh.contributes for x in sh.take(items))
                assert taken == items, (scope, tp, pp, dp, e)
                for r, sh in shards.items():
                    engine = vllm_groups[r // e]
                    assert all(shards[q].index == sh.index for q in engine) and sh.contributes == (r == engine[0])
                    assert sh.count == (len(ranks) // e if scope == "replica" or dp > 1 else world // e)
            # validation keeps its old rule (rows[rank // engine_tp :: engines]), training its old shares
            assert all(layout.shard(r, "world").index == r // e for r in range(world))
            assert all(layout.shard(r, "replica").index == layout.replica_groups(layout.replica_of[r]).index(r // e)
                       for r in range(world))
        # seeds: the same on the ranks of one engine, different between engines (so between DP ranks)
        seeds = {g[0]: layout.sampling_seed(11, g[0]) for g in vllm_groups}
        assert len(set(seeds.values())) == len(vllm_groups)
        assert all(layout.sampling_seed(11, r) == seeds[g[0]] for g in vllm_groups for r in g)
    assert accepted > 1000 and refused > 100


def test_the_issue_layouts():
    with pytest.raises(LayoutError, match=r"rollout.engine_tp=4 puts ranks \[0, 1, 2, 3\].*parallel.tp=2.*parallel.pp"):
        EngineLayout(8, tp=2, pp=2, engine_tp=4)
    with pytest.raises(LayoutError):  # tp=1, pp=2, dp=2: the old check (tp*pp % engine_tp) let this through
        EngineLayout(4, tp=1, pp=2, engine_tp=2)
    ok = EngineLayout(8, tp=2, pp=2, engine_tp=2)
    assert ok.groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [ok.shard(r, "replica").index for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [ok.shard(r, "world").index for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [ok.shard(r, "replica").contributes for r in range(8)] == [True, False] * 4
    assert EngineLayout(4, tp=2, pp=2, engine_tp=4).groups == [[0, 1, 2, 3]]  # DP = 1: one replica, one engine


def test_config_validate_refuses_an_engine_spanning_replicas(tmp_path):
    for overrides, world in ((["parallel.tp=2", "parallel.pp=2", "rollout.engine_tp=4"], 8),
                             (["parallel.pp=2", "rollout.engine_tp=2"], 4)):
        cfg = load_config(None, overrides + ["data.train_batch_size=8", "algo.ppo_mini_batch_size=8"])
        with pytest.raises(ConfigError, match="rollout.engine_tp=.*parallel.tp"):
            cfg.validate(world_size=world, check_files=False)
    load_config(None, ["parallel.tp=2", "parallel.pp=2", "rollout.engine_tp=2"]).validate(world_size=8,
                                                                                          check_files=False)


def test_seeds_differ_between_dp_ranks_and_so_do_samples():
    """Two DP ranks (engine_tp=1, tp=pp=1) sampling the same prompt at the same step draw different tokens."""
    import torch

    from megatron_searchr1.rollout.engine import SamplingParams
    from megatron_searchr1.rollout.engines.hf_engine import HFEngine
    from transformers import Qwen2Config, Qwen2ForCausalLM

    layout = EngineLayout(2, tp=1, pp=1, engine_tp=1)
    seeds = [layout.sampling_seed(1_000_003, rank) for rank in (0, 1)]
    assert seeds[0] != seeds[1]
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))

    class Tok:
        pad_token_id = 0

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    engine = HFEngine(model, tokenizer=Tok())
    out = [engine.generate([[1, 2, 3]], SamplingParams(max_tokens=16, temperature=1.0, seed=s))[0].token_ids
           for s in seeds]
    assert out[0] != out[1]


def test_shard_merge_puts_every_engines_results_back_in_list_order():
    layout = EngineLayout(8, tp=2, pp=2, engine_tp=1)  # replica 0 = [0, 1, 4, 5]: four engines, one per rank
    items = list("abcdefghij")
    shards = [layout.shard(r, "replica") for r in (0, 1, 4, 5)]
    parts = {sh.index: [x.upper() for x in sh.take(items)] for sh in shards}
    assert shards[0].merge(parts) == list("ABCDEFGHIJ")
    with pytest.raises(ValueError, match="expected shards 0..3"):
        shards[0].merge({0: parts[0], 1: parts[1]})
    with pytest.raises(ValueError, match="scope"):
        layout.shard(0, "dp")
