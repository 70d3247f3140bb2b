"""The experts vLLM routed each token to, recorded during the rollout, for the trainer to replay (MoE models).

    engine = VLLMEngine(hf_dir, routing_capture=True)
    outs = engine.generate(prompts, params, sessions=keys)             # turns, observations, more turns ...
    routing = engine.routed_experts([prompt + response, ...])           # [(n_i, moe_layers, topk) int16], -1: unseen

Why: the trainer's router may pick other experts than the engine's for the same token (other kernels, bf16 on one
side), so the trainer's log-prob of a sampled token is that of another network. Replaying the engine's choice in the
trainer's forward (megatron/routing_replay.py) removes that part of the engine / trainer gap; slime, verl and SkyRL do
the same. vLLM 0.32's own `enable_return_routed_experts` needs Model Runner V2, which the CPU backend does not run,
so the capture here is our own, on the same seam vLLM's capturer binds to: each MoE layer's router
(`MoERunner.router`, a `BaseRouter`) calls `capture_fn(topk_ids)` with its logical expert ids, before any EPLB
remapping.

What a recorded id belongs to. One forward of the model runner holds the scheduled tokens of many requests, flattened
in `input_batch.req_ids` order with `query_start_loc` bounds and their positions; this module wraps the runner's
`_model_forward` and, after each forward, files every token's (layers, topk) ids under the hash of its whole prefix
(token ids 0..p). A token's routing depends on its prefix only (causal attention), so this key is right for every
request with that prefix: a prompt shared by a GRPO group's samples and served from the prefix cache, a KV session's
earlier turns, a retrieved `<information>` block (it passes the router like any prompt token). `routed_experts(seqs)`
walks each trajectory's prefix hashes and stitches its tokens' ids from whichever forward computed them. A token the
engine never computed is -1 (the trajectory's last sampled token: nothing comes after it, so its routing changes no
log-prob; the trainer routes it itself). Records are dropped at every weight sync (`reset`: the prefix cache is
reset there too, and ids of old weights describe another network) and when the engine closes.

On the CUDA runner the seam is the same (`GPUModelRunner._model_forward`, `query_start_loc`, `input_batch`) as long
as vLLM runs Model Runner V1 (VLLM_USE_V2_MODEL_RUNNER=0); CUDA graphs pad the flattened batch, which the
`query_start_loc` bounds skip, and `capture` should then keep the ids on the device and copy once per forward.
Model Runner V2 has vLLM's own capturer (`enable_return_routed_experts`), not wired here. Pure Python bookkeeping
per token: fine for the CPU engine and for rollouts of a few thousand tokens per sample.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

ROOT = 0x5EED
"""The hash of the empty prefix."""


def prefix_hashes(tokens: Sequence[int], start: int = ROOT) -> list[int]:
    """h_p = hash(h_{p-1}, token_p): one key per position, equal for equal prefixes (ints hash the same in every
    process, PYTHONHASHSEED or not).

    >>> a, b = prefix_hashes([5, 6, 7]), prefix_hashes([5, 6, 8])
    >>> a[:2] == b[:2], a[2] == b[2]
    (True, False)
    """
    out, h = [], start
    for t in tokens:
        h = hash((h, int(t)))
        out.append(h)
    return out


class RoutingRecorder:
    """The worker-side record: (layers, topk) int16 expert ids per prefix hash, filled after every forward."""

    def __init__(self, layer_ids: Sequence[int], topk: int):
        self.layer_ids = sorted(layer_ids)
        """vLLM's layer index of each MoE layer, in order: column l of a record is layer layer_ids[l]."""
        self.topk = topk
        self.by_prefix: dict[int, np.ndarray] = {}
        self.step: dict[int, torch.Tensor] = {}
        """This forward's ids per layer id (N, topk)."""
        self.chains: dict[str, tuple[int, int]] = {}
        """Per running request: (next position, hash of the prefix before it), so a decode step hashes one token."""

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        self.step[layer_id] = topk_ids.detach().to("cpu", torch.int16, copy=True)

    def record(self, req_ids: Sequence[str], bounds: Sequence[int], positions: torch.Tensor, token_rows) -> int:
        """File the ids of one forward: request i's tokens are rows bounds[i]:bounds[i+1] of the flattened batch, at
        `positions`; `token_rows(i, end)` are request i's token ids 0..end-1. Returns the tokens filed."""
        missing = [l for l in self.layer_ids if l not in self.step]
        if missing:
            raise RuntimeError(f"routing capture: MoE layers {missing} did not report their experts this forward")
        ids = torch.stack([self.step[l] for l in self.layer_ids], dim=1).numpy()  # (N, L, K)
        pos = positions.detach().cpu().reshape(-1)
        filed = 0
        for i, rid in enumerate(req_ids):
            s, e = int(bounds[i]), int(bounds[i + 1])
            if e <= s:
                continue
            p0 = int(pos[s])
            chain = self.chains.get(rid)
            h = chain[1] if chain is not None and chain[0] == p0 else (prefix_hashes(token_rows(i, p0)) or [ROOT])[-1]
            for j, hj in enumerate(prefix_hashes(token_rows(i, p0 + e - s)[p0:], start=h)):
                self.by_prefix[hj] = ids[s + j]
                h = hj
            self.chains[rid] = (p0 + e - s, h)
            filed += e - s
        self.step.clear()
        return filed

    def lookup(self, tokens: Sequence[int]) -> np.ndarray:
        """(len(tokens), L, K) int16: the recorded ids of each position, -1 where the engine computed none."""
        out = np.full((len(tokens), len(self.layer_ids), self.topk), -1, dtype=np.int16)
        for p, h in enumerate(prefix_hashes(tokens)):
            got = self.by_prefix.get(h)
            if got is not None:
                out[p] = got
        return out

    def reset(self) -> None:
        self.by_prefix.clear()
        self.chains.clear()
        self.step.clear()


def needed_positions(prompt_len: int, loss_mask: Sequence[int]) -> int:
    """How many leading positions of a trajectory reach the log-prob of one of its sampled tokens: those before its
    last sampled token (causal attention: later tokens, the last sampled one included, change no such log-prob; the
    engine never computes them when the trajectory ends with them, e.g. an observation cut by the length budget).

    >>> needed_positions(3, [1, 1, 0, 0]), needed_positions(3, [0, 0])
    (4, 0)
    """
    last = max((i for i, m in enumerate(loss_mask) if m), default=None)
    return 0 if last is None else prompt_len + last


def attach(engine, trajs) -> tuple[int, int]:
    """Give each finished trajectory its tokens' expert ids (prompt + response, `Trajectory.routed_experts`), from
    `engine.routed_experts`; call it before the engine's next weight sync drops the records. Returns (needed
    positions without engine ids, needed positions) over the trajectories (`needed_positions`): 0 missing when the
    capture saw everything that matters."""
    trajs, missing, total = list(trajs), 0, 0
    if trajs:
        for t, ids in zip(trajs, engine.routed_experts([list(t.prompt_ids) + list(t.response_ids) for t in trajs])):
            t.routed_experts = ids
            n = needed_positions(len(t.prompt_ids), t.loss_mask)
            missing += int((ids[:n].flatten(1) < 0).all(dim=1).sum())
            total += n
    return missing, total


# -- inside the vLLM worker (collective_rpc) ---------------------------------------------------------------------
def install(worker) -> list[int]:
    """Bind the recorder to every MoE layer's router and wrap the runner's forward; returns the MoE layer ids."""
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    runner = worker.model_runner
    if getattr(runner, "_routing_recorder", None) is not None:
        return runner._routing_recorder.layer_ids
    layers = [m for m in runner.model.modules() if isinstance(m, MoERunner)]
    if not layers:
        raise ValueError("routing capture: the engine's model has no MoE layer (a dense model has nothing to replay)")
    bad = [type(m.router).__name__ for m in layers if not isinstance(m.router, BaseRouter)]
    if bad:
        raise ValueError(f"routing capture: vLLM routers {sorted(set(bad))} take no capture callback")
    recorder = RoutingRecorder([m.layer_id for m in layers], layers[0].router.top_k)
    for m in layers:
        lid = m.layer_id
        m.router.set_capture_fn(lambda ids, lid=lid: recorder.capture(lid, ids))
    forward = runner._model_forward

    def recorded_forward(*args, **kwargs):
        recorder.step.clear()
        out = forward(*args, **kwargs)
        batch = runner.input_batch
        n = batch.num_reqs
        positions = kwargs["positions"] if "positions" in kwargs else args[1]
        recorder.record(list(batch.req_ids[:n]), runner.query_start_loc.cpu[: n + 1].tolist(), positions,
                        lambda i, end: batch.token_ids_cpu[i, :end].tolist())
        return out

    runner._model_forward = recorded_forward
    runner._routing_recorder = recorder
    return recorder.layer_ids


def fetch(worker, seqs: list[list[int]]) -> list[np.ndarray]:
    """The stitched ids of each token sequence (RoutingRecorder.lookup)."""
    recorder = worker.model_runner._routing_recorder
    return [recorder.lookup(s) for s in seqs]


def reset(worker) -> int:
    """Drop every record (after a weight sync); returns how many there were."""
    recorder: Optional[RoutingRecorder] = getattr(worker.model_runner, "_routing_recorder", None)
    if recorder is None:
        return 0
    n = len(recorder.by_prefix)
    recorder.reset()
    return n
