"""Routing replay's pure parts (megatron/routing_replay.py) and its collation (batching.py): the engine's ids reach
each router in the order Megatron routes ([s, b] flattened, a TP rank's sequence chunk under sequence parallelism),
replace the router's own top-k through megatron-core's own routing function, and -1 leaves a token to the router."""
import pytest
import torch

from megatron_searchr1.megatron.batching import TrainSequence, collate_routed, make_micro_batches
from megatron_searchr1.megatron.routing_replay import _Replay, merge_topk, moe_layer_indices, replay_targets


def test_targets_follow_megatrons_token_order_and_sequence_parallel_chunks():
    # routed[b, t, l, k] = 100 * b + 10 * t + l (k = 1): row-major (b, T) becomes s-major per layer column
    b, T, L = 2, 4, 3
    routed = (100 * torch.arange(b).view(b, 1, 1, 1) + 10 * torch.arange(T).view(1, T, 1, 1)
              + torch.arange(L).view(1, 1, L, 1))
    whole = replay_targets(routed, [2, 0])
    assert whole[0].flatten().tolist() == [2, 102, 12, 112, 22, 122, 32, 132]   # column 2, (s0 b0), (s0 b1), ...
    assert whole[1].flatten().tolist() == [0, 100, 10, 110, 20, 120, 30, 130]
    rank1 = replay_targets(routed, [1], tp_rank=1, tp_size=2, sequence_parallel=True)[0]
    assert rank1.flatten().tolist() == [21, 121, 31, 131]                        # positions 2..3 of both rows
    assert replay_targets(routed, [1], tp_rank=1, tp_size=2)[0].shape == (8, 1)  # TP without SP: every token
    with pytest.raises(ValueError, match="do not split over 3"):
        replay_targets(routed, [0], tp_size=3, sequence_parallel=True)


def test_merge_keeps_own_where_unrecorded_and_refuses_another_shape():
    scores = torch.tensor([[0.1, 0.9, 0.5, 0.0], [0.3, 0.2, 0.7, 0.6]])
    own = torch.tensor([[1, 2], [2, 3]])
    values, ids = merge_topk(scores, own, torch.tensor([[3, 0], [-1, -1]]))
    assert ids.tolist() == [[3, 0], [2, 3]] and torch.allclose(values, torch.tensor([[0.0, 0.1], [0.7, 0.6]]))
    with pytest.raises(ValueError, match="do not match the router's top-k"):
        merge_topk(scores, own, torch.tensor([[3], [0]]))


@pytest.mark.parametrize("pre_softmax", [False, True])
def test_megatrons_routing_takes_the_replayed_experts(pre_softmax):
    """megatron-core's own top-k routing (the function TopKRouter.routing calls) with a replay slot: the routing map
    holds the replayed experts, the gate weights are the router's own scores there (softmax over the chosen logits
    when the top-k is renormalised, Qwen3-MoE's norm_topk_prob), and a token without ids keeps its own top-k."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    torch.manual_seed(0)
    logits = torch.randn(3, 6)
    replay = _Replay(column=0)
    replay.target = torch.tensor([[5, 0], [1, 2], [-1, -1]])
    probs, routing_map = topk_routing_with_score_function(logits, 2, use_pre_softmax=pre_softmax,
                                                          router_replay=replay)
    own = logits.topk(2, dim=1).indices
    want = [[0, 5], [1, 2], sorted(own[2].tolist())]
    assert [routing_map[i].nonzero().flatten().tolist() for i in range(3)] == want
    assert replay.chosen[:2].tolist() == [[5, 0], [1, 2]]
    if pre_softmax:
        expect = torch.softmax(logits, -1)[0, [5, 0]]
    else:
        expect = torch.softmax(logits[0, [5, 0]], -1)
    assert probs[0, [5, 0]].tolist() == pytest.approx(expect.tolist())
    replay.target = None  # no ids: the router's own choice
    _, again = topk_routing_with_score_function(logits, 2, use_pre_softmax=pre_softmax, router_replay=replay)
    assert [again[i].nonzero().flatten().tolist() for i in range(3)] == [sorted(o) for o in own.tolist()]


def test_moe_layer_columns():
    assert moe_layer_indices(4, [0, 1, 1, 1]) == [1, 2, 3] and moe_layer_indices(6, 3) == [0, 3]


def test_micro_batches_carry_routed_ids_padded_with_minus_one():
    r1 = torch.arange(5 * 2 * 1, dtype=torch.int16).view(5, 2, 1)
    r2 = torch.full((3, 2, 1), 7, dtype=torch.int16)
    seqs = [TrainSequence(prompt_ids=[1, 2], response_ids=[3, 4, 5], loss_mask=torch.ones(3), routed_experts=r1),
            TrainSequence(prompt_ids=[1], response_ids=[3, 4], loss_mask=torch.ones(2), routed_experts=r2)]
    mb = make_micro_batches(seqs, 100)[0]
    assert mb.indices == [0, 1] and mb.routed_experts.shape == (2, 5, 2, 1)
    assert torch.equal(mb.routed_experts[0], r1) and torch.equal(mb.routed_experts[1, :3], r2)
    assert (mb.routed_experts[1, 3:] == -1).all()
    padded = mb.padded_to(4)  # sequence parallelism pads the columns: the ids follow, -1
    assert padded.input_ids.shape[1] == padded.routed_experts.shape[1] == 8
    assert (padded.routed_experts[:, 5:] == -1).all()
    assert "routed_experts" not in mb.fields  # not a per-response-token field
    with pytest.raises(ValueError, match="has 4 positions but the sequence has 5 tokens"):
        make_micro_batches([TrainSequence(prompt_ids=[1, 2], response_ids=[3, 4, 5], loss_mask=torch.ones(3),
                                          routed_experts=r1[:4])], 100)
    with pytest.raises(ValueError, match="set on some sequences of a micro-batch and not on others"):
        collate_routed([r1, None], 5)
    assert collate_routed([None, None], 5) is None
