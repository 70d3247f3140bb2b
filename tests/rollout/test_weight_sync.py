"""Tests for megatron_searchr1/rollout/weight_sync.py.

Bucketing is tested as pure functions. The sync itself runs tests/rollout/weight_sync_script.py's checks under real
torchrun (gloo): a tiny Qwen2 (head_dim 32, vocab not a multiple of Megatron's padding so the trim matters), tied and
untied, synced from Megatron into a receiving `transformers` model: its tensors equal the checkpoint's exactly, its
log-probs equal Megatron's, and a second sync after the weights change makes them the new model's. Those checks run
inside the convert tests' launches of the same world size (tests/models/launches.py: one start of the ranks for
both files); the shared-memory transport has a launch of its own.
"""
from pathlib import Path

import pytest
import torch

from megatron_searchr1.models.gpt import padded_vocab_size
from megatron_searchr1.rollout.weight_sync import (
    ALIGN, layout_bucket, pack_bucket, plan_buckets, unpack_bucket,
)
from tests.dist_utils import rank_results, run_torchrun
from tests.models.launches import launch, sync_models

SCRIPT = Path(__file__).with_name("weight_sync_script.py")


# ----------------------------------------------------------------------------------------------------------------
# Bucketing
# ----------------------------------------------------------------------------------------------------------------
def _tensors():
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(3, 5, generator=g)),                        # 60 B
        ("b", torch.randn(7, generator=g).to(torch.bfloat16)),         # 14 B, odd size: the next offset aligns
        ("c", torch.randint(0, 100, (2, 3), generator=g)),             # int64
        ("d", torch.randn(40, 10, generator=g)),                       # 1600 B
        ("e", torch.randn(1, generator=g).to(torch.float16)),
    ]


def test_pack_unpack_round_trip_exact():
    named = _tensors()
    layout = layout_bucket([(n, t.shape, t.dtype) for n, t in named])
    assert all(s.offset % ALIGN == 0 for s in layout.slots)
    flat = pack_bucket([t for _, t in named], layout)
    assert flat.dtype == torch.uint8 and flat.numel() == layout.nbytes
    out = unpack_bucket(flat, layout)
    assert [n for n, _ in out] == [n for n, _ in named]
    for (_, got), (_, want) in zip(out, named):
        assert got.dtype == want.dtype and torch.equal(got, want)
    # views, not copies: writing the buffer changes what unpack returned
    flat.zero_()
    assert float(out[3][1].abs().sum()) == 0.0


def test_pack_rejects_a_tensor_that_does_not_match_the_plan():
    named = _tensors()
    layout = layout_bucket([(n, t.shape, t.dtype) for n, t in named])
    wrong = [t for _, t in named]
    wrong[0] = wrong[0].double()
    with pytest.raises(ValueError, match="a: got"):
        pack_bucket(wrong, layout)


def test_plan_buckets_splits_mid_list_and_keeps_oversized_tensors_alone():
    named = _tensors()
    sizes = [t.numel() * t.element_size() for _, t in named]  # 60, 14, 48, 1600, 2 -> aligned 64 each but d
    runs = plan_buckets(sizes, 3 * ALIGN)
    assert runs == [range(0, 3), range(3, 4), range(4, 5)]  # a boundary mid-list; d > bucket_bytes travels alone
    assert [i for r in runs for i in r] == list(range(len(sizes)))
    # bucket_bytes smaller than every tensor: one tensor per bucket, none lost
    assert plan_buckets(sizes, 1) == [range(i, i + 1) for i in range(len(sizes))]
    # everything fits: one bucket
    assert plan_buckets(sizes, 1 << 20) == [range(0, 5)]
    assert plan_buckets([], 10) == []
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(sizes, 0)


def test_packing_per_planned_bucket_delivers_every_tensor_exactly():
    named = _tensors()
    sizes = [t.numel() * t.element_size() for _, t in named]
    got = {}
    for run in plan_buckets(sizes, 2 * ALIGN):
        part = [named[i] for i in run]
        layout = layout_bucket([(n, t.shape, t.dtype) for n, t in part])
        assert layout.nbytes <= 2 * ALIGN or len(part) == 1
        got.update((n, t.clone()) for n, t in unpack_bucket(pack_bucket([t for _, t in part], layout), layout))
    assert set(got) == {n for n, _ in named}
    assert all(torch.equal(got[n], t) for n, t in named)


# ----------------------------------------------------------------------------------------------------------------
# Megatron -> engine under torchrun
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """The Qwen2s, untied and tied (launches.sync_models), checked to need vocab padding at TP=2."""
    dirs = sync_models(tmp_path_factory)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(dirs[0]).vocab_size
    assert padded_vocab_size(vocab, 2) != vocab, "the vocab must need padding so the trim is exercised"
    return dirs


def _sync_rows(out: str) -> list[dict]:
    """The weight-sync rows of a shared launch's output (the convert checks' rows carry no `engine`)."""
    return [r for r in rank_results(out) if "engine" in r]


def _check(results, checks, engine_ranks, archs=2):
    for check in checks:
        rows = [r for r in results if r["check"] == check]
        assert len(rows) == archs * len(engine_ranks), (check, rows)
        assert {r["rank"] for r in rows} == set(engine_ranks), (check, rows)
        assert all(r["ok"] for r in rows), (check, rows)


def test_sync_world_of_one(tiny_models, tmp_path_factory):
    _check(_sync_rows(launch(tmp_path_factory, 1)), ["names", "exact", "logprobs", "resync", "bf16"], [0])


@pytest.mark.slow
def test_sync_tp2_pp2_into_both_engines(tiny_models, tmp_path_factory):
    """Megatron TP=2 x PP=2 (4 processes, one launch) into two kinds of engine:
    - a `transformers` state dict on ranks 0 and 2 (one per stage; 1 and 3 pass engine=None and only relay), tied
      and untied: names, exact tensors, log-probs, a second sync, bf16;
    - a vLLM engine (fp32, CPU) on every rank, untied: its log-probs of its own greedy tokens equal Megatron's
      (<= 1e-4) after the sync, were not before it, and follow a second sync."""
    pytest.importorskip("vllm")
    results = _sync_rows(launch(tmp_path_factory, 4))
    state_dict = [r for r in results if r["engine"] == "state_dict"]
    _check(state_dict, ["names", "exact", "logprobs", "resync", "bf16"], [0, 2])
    assert max(r["diff"] for r in state_dict if r["check"] in ("logprobs", "resync")) <= 1e-4
    _check([r for r in results if r["engine"] == "vllm"], ["logprobs", "resync"], [0, 1, 2, 3], archs=1)


@pytest.mark.slow
def test_sync_uneven_pipeline_split(tiny_models, tmp_path_factory):
    """4 layers at PP=2 split 1 + 3 (num_layers_in_first_pipeline_stage=1): an even-split offset formula would put
    stage 1's first layer at index 2; the sync reads layer_number and the engine matches Megatron."""
    results = _sync_rows(launch(tmp_path_factory, 2))
    _check(results, ["names", "logprobs", "resync"], [0])
    layers = [r["layer_numbers"] for r in results if r["check"] == "layers"]
    assert layers == [[1], [1]], layers  # rank 0 = stage 0 holds only layer 1 (global index 0)


@pytest.fixture(scope="module")
def transport_results():
    """Both layouts' checks from one launch (weight_sync_transport_script.py runs TP=2, then PP=2)."""
    return rank_results(run_torchrun(SCRIPT.with_name("weight_sync_transport_script.py"), 2, "--layouts", "2x1",
                                     "1x2", timeout=600))


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_shm_transport_delivers_what_the_collectives_deliver(transport_results, tp, pp):
    """2 processes on one host, CPU: transport="shm" (and "auto", which picks it) hands the engine the very tensors
    transport="collective" does, on a second sync too (the shared buffers are reused), stats say which transport
    ran, no buffer file outlives the init, and without /dev/shm "auto" falls back to the collectives."""
    results = [r for r in transport_results if (r["tp"], r["pp"]) == (tp, pp)]
    for check in ("equal", "transport", "unlinked", "fallback"):
        rows = [r for r in results if r["check"] == check]
        assert len(rows) == 2 and {r["rank"] for r in rows} == {0, 1} and all(r["ok"] for r in rows), (check, rows)
