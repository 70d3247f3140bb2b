# Run: OMP_NUM_THREADS=1 python tools/benchmarks/bench_weight_sync.py
#      OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 tools/benchmarks/bench_weight_sync.py   (TP=2)
#      (options: --tp/--pp (default TP = world size), --bucket-mb 32, --dtype float32, --iters 5; --help)
"""Weight sync Megatron -> engine (rollout/weight_sync.py) in bytes/s, against a plain copy of the same bytes.

A random Qwen2-shaped Megatron model (~30M parameters by default) is synced into a copying engine (each HF tensor is
`copy_`-ed into a preallocated destination, as vLLM's load_weights does) on every rank; the baseline is one
`dst.copy_(src)` of as many bytes as the engine received, on the same rank; under torchrun also one bare
all-gather that leaves as many bytes on every rank (the transport floor: gloo over TCP on the CPU is far slower
than a memory copy, so there the sync/copy ratio measures the transport, and sync/all-gather our overhead). The two are interleaved iteration by
iteration so machine load hits both alike. Printed by rank 0: median seconds and GB/s of each and the ratio
sync / copy (target >= 0.5). Under torchrun the sync includes the TP all-gathers and PP broadcasts (gloo on the CPU).
"""
from __future__ import annotations

import os
import statistics
import time

from megatron_searchr1.cli import ArgumentParser, UsageError, above, at_least, run_main


class CopyingEngine:
    """Receives (hf_name, tensor) buckets and copies them into its own preallocated tensors."""

    def __init__(self):
        self.params: dict = {}  # hf name -> preallocated torch.Tensor

    def load_weights(self, weights):
        for name, t in weights:
            dst = self.params.get(name)
            if dst is None:  # first sync allocates (the warm-up iteration), later ones only copy
                dst = self.params[name] = t.new_empty(t.shape)  # (no torch.empty_like: torch is imported in main)
            dst.copy_(t)

    def finish_weight_sync(self):
        pass


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=at_least(1), default=None, help="tensor-parallel size (default: the world size / PP)")
    p.add_argument("--pp", type=at_least(1), default=1, help="pipeline-parallel size")
    p.add_argument("--hidden", type=at_least(1), default=512, help="model width")
    p.add_argument("--ffn", type=at_least(1), default=1408, help="MLP width")
    p.add_argument("--layers", type=at_least(1), default=4, help="transformer layers")
    p.add_argument("--heads", type=at_least(1), default=8, help="query heads")
    p.add_argument("--kv-heads", type=at_least(1), default=2, help="key/value heads")
    p.add_argument("--vocab", type=at_least(1), default=16000,
                   help="vocabulary (padded by Megatron; the sync trims it)")
    p.add_argument("--bucket-mb", type=above(0.0), default=32.0, help="sync bucket size in MiB")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="what the engine receives (the model is fp32; bfloat16 = cast at the source)")
    p.add_argument("--transport", default="auto", choices=["auto", "shm", "collective"],
                   help="how bytes move between ranks (auto: shared memory on one host's CPUs)")
    p.add_argument("--warmup", type=at_least(1), default=1,
                   help="untimed syncs (the first allocates the engine's tensors)")
    p.add_argument("--iters", type=at_least(1), default=5, help="timed iterations (median)")
    a = p.parse_args(argv)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if a.hidden % a.heads or a.heads % a.kv_heads:
        raise UsageError(f"--hidden {a.hidden} must be a multiple of --heads {a.heads}, and --heads of --kv-heads "
                         f"{a.kv_heads}")
    if world % a.pp or (a.tp or world // a.pp) * a.pp != world:
        raise UsageError(f"TP x PP must equal the world size {world}: got --tp {a.tp or world // a.pp} --pp {a.pp}")

    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config

    from megatron_searchr1.megatron.initialize import destroy_megatron, initialize_megatron
    from megatron_searchr1.models.convert import bind_mapping
    from megatron_searchr1.models.gpt import build_gpt_model
    from megatron_searchr1.rollout.weight_sync import WeightSync

    tp = a.tp or world // a.pp
    cfg = Qwen2Config(hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, vocab_size=a.vocab,
                      tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"])
    initialize_megatron(tp=tp, pp=a.pp)
    model = build_gpt_model(cfg)
    sync = WeightSync(model, bind_mapping(cfg, model), bucket_bytes=int(a.bucket_mb * 2 ** 20),
                      dtype=getattr(torch, a.dtype), transport=a.transport)
    engine = CopyingEngine()

    stats = sync.sync(engine)  # warm-up: the engine allocates its tensors
    src = torch.randn((stats.bytes + 3) // 4).view(torch.uint8)[: stats.bytes]
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: touch the destination pages
    for _ in range(a.warmup - 1):
        sync.sync(engine)
        dst.copy_(src)
    # The transport floor: one all-gather over the world in which every rank ends with as many bytes as the
    # engine receives (what the TP gathers + PP broadcasts must move at the least).
    piece = src[: stats.bytes // world]
    gathered = torch.empty(piece.numel() * world, dtype=torch.uint8)
    sync_s, copy_s, coll_s = [], [], []
    for _ in range(a.iters):
        dist.barrier()
        sync_s.append(sync.sync(engine).seconds)
        t = time.perf_counter()
        dst.copy_(src)
        copy_s.append(time.perf_counter() - t)
        if world > 1:
            dist.barrier()
            t = time.perf_counter()
            dist.all_gather_into_tensor(gathered, piece)
            coll_s.append(time.perf_counter() - t)
    # The slowest rank decides how long a sync takes.
    times = torch.tensor([statistics.median(x) if x else 0.0 for x in (sync_s, copy_s, coll_s)], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    s_sync, s_copy, s_coll = times.tolist()
    if dist.get_rank() == 0:
        gb = stats.bytes / 1e9
        print(f"world={world} TP={tp} PP={a.pp} dtype={a.dtype} bytes/rank={stats.bytes / 2**20:.1f} MiB "
              f"tensors={stats.tensors} buckets={stats.buckets} transport={stats.transport}")
        print(f"{'':12s}{'seconds':>10s}{'GB/s':>10s}")
        print(f"{'weight sync':12s}{s_sync:10.4f}{gb / s_sync:10.2f}")
        print(f"{'plain copy':12s}{s_copy:10.4f}{gb / s_copy:10.2f}")
        if world > 1:
            print(f"{'all-gather':12s}{s_coll:10.4f}{gb / s_coll:10.2f}   (the bare collective, same bytes per rank)")
        print(f"ratio sync/copy = {s_copy / s_sync:.2f} (target >= 0.5)"
              + (f"; sync/all-gather = {s_coll / s_sync:.2f}" if world > 1 else ""))
    destroy_megatron()
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
