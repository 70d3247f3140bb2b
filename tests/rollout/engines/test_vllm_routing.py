"""Routing capture bookkeeping (rollout/engines/vllm_routing.py) without vLLM: forwards of several requests are filed
under prefix hashes and stitched per trajectory across a prefix-cache hit, a KV session's later turn and its
observation tokens; a token no forward computed is -1."""
import numpy as np
import pytest
import torch

from megatron_searchr1.rollout.engines.vllm_routing import RoutingRecorder, attach


def ids_of(prefix):
    """The (layers=2, topk=2) ids a fake router gives the last token of `prefix` (a function of the whole prefix)."""
    h = sum((i + 1) * t for i, t in enumerate(prefix))
    return [[h % 7, (h + 1) % 7], [(h * 3) % 7, (h * 3 + 2) % 7]]


class FakeForward:
    """A model-runner forward: requests' token rows, their scheduled spans; each MoE layer reports its ids."""

    def __init__(self, recorder):
        self.rec = recorder
        self.rows = {}

    def run(self, spans):
        """spans: [(req_id, tokens so far, first position, count)] in batch order."""
        bounds, positions, rows, req_ids = [0], [], [], []
        for rid, tokens, p0, n in spans:
            req_ids.append(rid)
            rows.append(tokens)
            bounds.append(bounds[-1] + n)
            positions += list(range(p0, p0 + n))
        per_token = [ids_of(toks[: p + 1]) for toks, (_, _, p0, n) in zip(rows, spans) for p in range(p0, p0 + n)]
        arr = torch.tensor(per_token, dtype=torch.int32)  # (N, L, K)
        for layer in (3, 1):  # reported in any order, filed in layer order
            self.rec.capture(layer, arr[:, (1, 3).index(layer)])
        return self.rec.record(req_ids, bounds, torch.tensor(positions), lambda i, end: rows[i][:end])


def test_stitched_over_prefix_cache_sessions_and_observations():
    rec = RoutingRecorder([3, 1], topk=2)
    fwd = FakeForward(rec)
    prompt = [11, 12, 13, 14, 15, 16]
    # A computes the whole prompt; B (same prompt) hits the prefix cache for 4 tokens and computes the rest
    a = prompt + [21]
    b = prompt + [31]
    fwd.run([("A", a, 0, 6), ("B", b, 4, 2)])
    # decode steps: each request computes its sampled token
    a += [22]
    b += [32]
    fwd.run([("A", a, 6, 1), ("B", b, 6, 1)])
    # A's session continues: its last sampled token (22, not yet computed) and an observation [40, 41]
    a += [40, 41, 23]
    assert fwd.run([("A", a, 7, 3)]) == 3
    got = rec.lookup(a)
    assert got.shape == (len(a), 2, 2) and got.dtype == np.int16
    for p in range(len(a) - 1):  # every token but the last sampled one was computed by some forward
        assert got[p].tolist() == ids_of(a[: p + 1]), p
    assert (got[-1] == -1).all()
    gb = rec.lookup(b)
    assert [gb[p].tolist() for p in range(len(b) - 1)] == [ids_of(b[: p + 1]) for p in range(len(b) - 1)]
    # another trajectory that leaves the shared prefix at position 3 has no ids from there on
    other = rec.lookup(prompt[:3] + [99, 15, 16])
    assert (other[:3] >= 0).all() and (other[3:] == -1).all()
    rec.reset()
    assert (rec.lookup(a) == -1).all()


def test_a_layer_that_did_not_report_is_an_error():
    rec = RoutingRecorder([0, 1], topk=1)
    rec.capture(0, torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"MoE layers \[1\] did not report"):
        rec.record(["r"], [0, 2], torch.tensor([0, 1]), lambda i, end: [5, 6][:end])


def test_attach_sets_each_trajectory_its_whole_sequence():
    from megatron_searchr1.rollout.loop import Trajectory

    class Engine:
        def routed_experts(self, seqs):
            self.seqs = seqs
            return [torch.full((len(s), 1, 1), len(s), dtype=torch.int16) for s in seqs]

    t1, t2 = Trajectory(prompt_ids=[1, 2]), Trajectory(prompt_ids=[3])
    t1.extend([4, 5, 6], 1)
    eng = Engine()
    assert attach(eng, [t1, t2]) == (0, 4)  # t1: positions 0..3 reach its last sampled token; t2 samples none
    assert eng.seqs == [[1, 2, 4, 5, 6], [3]]
    assert t1.routed_experts.shape == (5, 1, 1) and t2.routed_experts.flatten().tolist() == [1]

    class Gappy(Engine):  # no ids at position 1 (counted: it reaches the sampled tokens) and 4 (the last: not)
        def routed_experts(self, seqs):
            out = super().routed_experts(seqs)
            out[0][[1, 4]] = -1
            return out

    assert attach(Gappy(), [t1]) == (1, 4)


def test_the_seams_the_capture_binds_to_are_the_gpu_runners_too():
    """install() wraps `_model_forward` and reads `query_start_loc` / `input_batch`: the CPU runner inherits all of
    them from the GPU runner (so the capture runs unchanged on CUDA's V1 runner), and vLLM's routers report their
    logical ids through `capture_fn` before the EPLB remap."""
    pytest.importorskip("vllm")
    import inspect

    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert issubclass(CPUModelRunner, GPUModelRunner) and "_model_forward" not in vars(CPUModelRunner)
    src = inspect.getsource(GPUModelRunner)
    assert "self._model_forward(" in src and "self.query_start_loc" in src and "positions=positions" in src
    select = inspect.getsource(BaseRouter._select_experts)
    assert hasattr(BaseRouter, "set_capture_fn")
    assert select.index("self.capture_fn(topk_ids)") < select.index("self._apply_eplb_mapping(topk_ids)")
