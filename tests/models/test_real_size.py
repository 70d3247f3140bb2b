"""Real-size dry runs, no weights and no GPU: Qwen2.5-3B/7B, Qwen3-4B-Instruct-2507, Qwen3-8B and Llama-3.1-8B
(tests/models/real_configs/: their public config.json values) built on the meta device at the recipes' TP/PP and at
an uneven PP.

For each: every HF tensor (from `transformers`' own model class on the meta device) maps to exactly one Megatron
tensor of the shape the Megatron stage has, and back (models/families/); the TP shards have the sizes the planner
counts; the weight sync (rollout/weight_sync.py's WeightSync, planned per stage) delivers every HF name once, and
with vLLM's stacking rules (`packed_modules_mapping` of vLLM's model class for the architecture: q/k/v into
qkv_proj, gate/up into gate_up_proj) every vLLM parameter gets each of its shards exactly once; its bucket count is
what megatron_searchr1/plan.py reports, its peak extra bytes those of a hand count (HAND_PEAK). vLLM's parameter
names are derived from the HF names by those rules (building vLLM's model needs its distributed and config
context), not read off a vLLM model.
"""
import collections
import json
import os

import pytest
import torch

from megatron_searchr1 import plan
from megatron_searchr1.models.config import padded_vocab_size
from megatron_searchr1.models.families import OUTPUT_LAYER, mapping_for, tp_merge, tp_split
from megatron_searchr1.rollout import weight_sync
from tests.dist_utils import REPO

CONFIGS = os.path.join(REPO, "tests", "models", "real_configs")
# model -> (tp, pp, last stage layers): the recipe's TP (Qwen2.5 recipes; TP 4 for the others) and an uneven PP
CASES = [
    ("Qwen2.5-3B-Instruct", 2, 1, None), ("Qwen2.5-3B-Instruct", 2, 3, 10),
    ("Qwen2.5-7B-Instruct", 4, 1, None), ("Qwen2.5-7B-Instruct", 4, 3, 10),
    ("Qwen3-4B-Instruct-2507", 4, 1, None), ("Qwen3-4B-Instruct-2507", 2, 3, 10),
    ("Qwen3-8B", 4, 1, None), ("Qwen3-8B", 4, 3, 10),
    ("Llama-3.1-8B", 4, 1, None), ("Llama-3.1-8B", 2, 3, 10),
]
BUCKET = 64 << 20
# The weight sync's peak extra bytes on one GPU, by hand: the largest bucket is the embedding (or the output layer,
# the same size), which travels alone. Its bytes in flight: this rank's bf16 shard (V_pad / tp) x h x 2, the
# all-gathered TP shards and the merged tensor (2 x V_pad x h x 2), the HF tensor at the real vocabulary V x h x 2,
# and with PP > 1 the broadcast buffer once more (V x h x 2). V_pad: V up to a multiple of 128 x tp.
#   Qwen2.5-3B   V 151936, h 2048, V_pad 152064 (tp 2): 311,427,072 + 1,245,708,288 + 622,329,856 (+ 622,329,856)
#   Qwen2.5-7B   V 152064, h 3584, V_pad 152064 (tp 4): 272,498,688 + 2,179,989,504 + 1,089,994,752 (+ 1,089,994,752)
#   Qwen3-4B     V 151936, h 2560, V_pad 152064: tp 4: 194,641,920 + 1,557,135,360 + 777,912,320;
#                tp 2: 389,283,840 + 1,557,135,360 + 777,912,320 + 777,912,320
#   Qwen3-8B     V 151936, h 4096, V_pad 152064 (tp 4): 311,427,072 + 2,491,416,576 + 1,244,659,712 (+ 1,244,659,712)
#   Llama-3.1-8B V 128256, h 4096: tp 4, V_pad 128512: 263,192,576 + 2,105,540,608 + 1,050,673,152;
#                tp 2, V_pad 128256: 525,336,576 + 2,101,346,304 + 1,050,673,152 + 1,050,673,152
HAND_PEAK = {
    ("Qwen2.5-3B-Instruct", 2, 1): 2_179_465_216, ("Qwen2.5-3B-Instruct", 2, 3): 2_801_795_072,
    ("Qwen2.5-7B-Instruct", 4, 1): 3_542_482_944, ("Qwen2.5-7B-Instruct", 4, 3): 4_632_477_696,
    ("Qwen3-4B-Instruct-2507", 4, 1): 2_529_689_600, ("Qwen3-4B-Instruct-2507", 2, 3): 3_502_243_840,
    ("Qwen3-8B", 4, 1): 4_047_503_360, ("Qwen3-8B", 4, 3): 5_292_163_072,
    ("Llama-3.1-8B", 4, 1): 3_419_406_336, ("Llama-3.1-8B", 2, 3): 4_728_029_184,
}


@pytest.fixture(scope="module")
def megatron_world():
    from megatron_searchr1.megatron.initialize import destroy_megatron, initialize_megatron

    initialize_megatron(tp=1, pp=1, device="cpu")
    yield
    destroy_megatron()


def load(name):
    with open(os.path.join(CONFIGS, f"{name}.json")) as f:
        return json.load(f)


def hf_meta_params(raw) -> dict:
    """name -> meta tensor of transformers' own model for this config (tied weights listed once)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw))
    return dict(model.named_parameters())


def vllm_packed_modules(architecture) -> dict:
    import importlib

    module = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}[architecture]
    return getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), architecture).packed_modules_mapping


def meta_stages(dims, pp, last):
    """(stage model, [(global name, param)]) per stage; a tied model's last-stage output-layer copy left out."""
    out = []
    for s in range(pp):
        model = plan.build_meta_stage(dims, pp, s, last_stage_layers=last)
        named = [(g, p) for _, g, p in weight_sync.global_param_names(model)
                 if not (g == OUTPUT_LAYER and dims.tie_embeddings)]
        out.append((model, named))
    return out


@pytest.mark.parametrize("name,tp,pp,last", CASES)
def test_real_size_mapping_tp_shards_and_weight_sync(megatron_world, monkeypatch, name, tp, pp, last):
    raw = load(name)
    dims = plan.read_dims_of(raw)
    hf = hf_meta_params(raw)
    stages = meta_stages(dims, pp, last)
    counts = plan.count_params(dims, tp, pp, last_stage_layers=last)
    assert [st.layers for st in counts.stages] == [len(m.decoder.layers) for m, _ in stages]

    # every Megatron tensor on exactly one stage; HF <-> Megatron, one to one, at the Megatron stage's shapes
    mapping = mapping_for(dims, padded_vocab_size=padded_vocab_size(dims.vocab_size, 1))
    megatron = collections.Counter(g for _, named in stages for g, _ in named)
    assert set(megatron) == set(mapping.megatron_names()) and max(megatron.values()) == 1
    used = collections.Counter()
    for _, named in stages:
        for g, param in named:
            sources = mapping.hf_sources(g)
            used.update(sources)
            full = mapping.hf_to_megatron(g, {s: hf[s] for s in sources})
            assert tuple(full.shape) == tuple(param.shape), g
            back = mapping.megatron_to_hf(g, full)
            assert [n for n, _ in back] == sources and all(t.shape == hf[n].shape for n, t in back), g
    assert set(used) == set(hf) and max(used.values()) == 1

    # TP shards: equal sizes, merged back to the full tensor, the sizes the planner counts
    mapping_tp = mapping_for(dims, padded_vocab_size=padded_vocab_size(dims.vocab_size, tp))
    for _, named in stages:
        for g, param in named:
            full = mapping_tp.hf_to_megatron(g, {s: hf[s] for s in mapping_tp.hf_sources(g)})
            shards = tp_split(g, full, tp)
            assert len({tuple(s.shape) for s in shards}) == 1 and tp_merge(g, shards).shape == full.shape
            assert shards[0].numel() == plan.shard_numel(g, param.shape, dims, tp), g

    # the weight sync: per stage, planned by WeightSync itself over this rank's shapes (TP shards, bf16)
    for model, named in stages:
        shapes = {g: tp_split(g, mapping_tp.hf_to_megatron(g, {s: hf[s] for s in mapping_tp.hf_sources(g)}),
                              tp)[0].shape for g, _ in named}
        for (_, g, p) in weight_sync.global_param_names(model):
            p.data = torch.empty(shapes.get(g, p.shape), dtype=torch.bfloat16, device="meta")
    monkeypatch.setattr(weight_sync, "_parallel_groups", lambda: (tp, None, 1, 0, None))
    syncs = [weight_sync.WeightSync(m, mapping_tp, bucket_bytes=BUCKET, dtype=torch.bfloat16, transport="collective")
             for m, _ in stages]
    delivered = collections.Counter(n for s in syncs for n in s.hf_names)
    assert set(delivered) == set(hf) and max(delivered.values()) == 1

    # vLLM: its stacked parameters each get every shard once, the others once
    packed = vllm_packed_modules(dims.architecture)
    vllm = collections.defaultdict(list)
    for n in delivered:
        for stacked, parts in packed.items():
            hit = next((part for part in parts if f".{part}." in n), None)
            if hit:
                vllm[n.replace(f".{hit}.", f".{stacked}.")].append(hit)
                break
        else:
            vllm[n].append(None)
    for n, shards in vllm.items():
        stacked = next((s for s in packed if f".{s}." in n), None)
        assert sorted(map(str, shards)) == sorted(map(str, packed[stacked] if stacked else [None])), n

    # bucket count as the planner reports it; its peak extra bytes against the hand count (HAND_PEAK), whose
    # bucket is WeightSync's largest: the embedding (or the output layer), alone, its rank's shard V_pad / tp x h
    buckets = sum(len(s._send) for s in syncs)
    vpad, h = padded_vocab_size(dims.vocab_size, tp), dims.hidden_size
    largest = max((b for s in syncs for b in s._send), key=lambda b: b.gather_layout.nbytes)
    assert (largest.gather_layout.nbytes, largest.hf_layout.nbytes) == (vpad // tp * h * 2, dims.vocab_size * h * 2)
    assert plan.sync_plan(counts, BUCKET, 2) == (buckets, HAND_PEAK[name, tp, pp])
    assert sum(s.nbytes for sy in syncs for b in sy._send for s in b.hf_layout.slots) == \
        sum(t.numel() for t in hf.values()) * 2
