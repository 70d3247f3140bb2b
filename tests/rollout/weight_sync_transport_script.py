# torchrun --nproc_per_node 2 tests/rollout/weight_sync_transport_script.py --layouts 2x1 1x2
"""The same-host shared-memory transport delivers exactly what the collectives deliver. Prints one `RESULT {...}`
line per check per rank; tests/rollout/test_weight_sync.py reads them.

At each layout (TP=2, then PP=2, in one launch of 2 processes): a random Qwen2-shaped Megatron model (vocab padded,
GQA, so QKV de-interleave, gate/up split and the vocab trim all run on shared-memory views) is synced with
transport="shm", "collective" and "auto" into copying engines on every rank, twice, the weights perturbed in between
(the second sync reuses the shared buffers). Checks per rank and layout:
- `equal`: every tensor the shm engine received equals the collective engine's bit for bit, in both syncs, and
  the second sync's differ from the first's (the buffers were rewritten, not stale);
- `transport`: stats say "shm", "collective" and "shm" (auto on the CPU), the byte counts match across transports;
- `unlinked`: no buffer file is left in /dev/shm once the WeightSyncs are built (the mappings hold the memory);
- `fallback`: with no usable shared-memory directory, "auto" falls back to the collectives and "shm" raises on
  every rank (the decision is the group's, so no rank is left waiting in a collective).
"""
import argparse
import glob
import json
import os

import torch


class CopyingEngine:
    """Keeps a copy of every tensor it receives (the views are only valid during load_weights)."""

    def __init__(self):
        self.received: dict[str, torch.Tensor] = {}

    def load_weights(self, weights):
        for name, t in weights:
            self.received[name] = t.clone()

    def finish_weight_sync(self):
        pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", nargs="+", default=["2x1"], help="TPxPP, each a world of TP*PP, one after another")
    a = ap.parse_args()
    from megatron.core import parallel_state as ps

    from megatron_searchr1.megatron.initialize import destroy_megatron, initialize_megatron

    for layout in a.layouts:
        tp, pp = map(int, layout.split("x"))
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        initialize_megatron(tp=tp, pp=pp)
        check_layout(tp, pp)
    destroy_megatron()


def check_layout(tp, pp):
    """The checks above at one TP x PP layout (Megatron initialised at it)."""
    import torch.distributed as dist
    from transformers import Qwen2Config

    from megatron_searchr1.models.convert import bind_mapping
    from megatron_searchr1.models.gpt import build_gpt_model
    from megatron_searchr1.rollout import weight_sync
    from megatron_searchr1.rollout.weight_sync import SHM_DIR, WeightSync

    cfg = Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=250, tie_word_embeddings=False,
                      architectures=["Qwen2ForCausalLM"])
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = build_gpt_model(cfg)
    mapping = bind_mapping(cfg, model)
    before = set(glob.glob(os.path.join(SHM_DIR, "searchr1-weight-sync-*")))
    # small buckets: several regions per buffer, and bucket offsets other than 0 get exercised
    syncs = {t: WeightSync(model, mapping, bucket_bytes=16 << 10, transport=t)
             for t in ("shm", "collective", "auto")}
    dist.barrier()  # every creator has unlinked its file (they do it after every rank mapped it)
    left = set(glob.glob(os.path.join(SHM_DIR, "searchr1-weight-sync-*"))) - before

    def report(check, ok, **kw):
        print("RESULT " + json.dumps(dict(rank=rank, tp=tp, pp=pp, check=check, ok=bool(ok), **kw)), flush=True)

    rounds = []
    for step in range(2):
        if step:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.sin(torch.arange(p.numel(), dtype=p.dtype).view(p.shape) + p.numel()))
        engines = {t: CopyingEngine() for t in syncs}
        stats = {t: s.sync(engines[t]) for t, s in syncs.items()}
        rounds.append((engines, stats))
    bad = []
    for engines, _ in rounds:
        ref = engines["collective"].received
        for t in ("shm", "auto"):
            got = engines[t].received
            if sorted(got) != sorted(ref):
                bad.append(f"{t}: names differ")
            bad += [f"{t}: {n}" for n in ref if n in got and not torch.equal(got[n], ref[n])]
    first, second = rounds[0][0]["shm"].received, rounds[1][0]["shm"].received
    stale = [n for n in first if torch.equal(first[n], second[n])]
    report("equal", not bad and not stale and len(first) > 0, bad=bad[:5], stale=stale[:5], tensors=len(first))
    stats = rounds[1][1]
    transports = {t: s.transport for t, s in stats.items()}
    counts = {(s.bytes, s.tensors, s.buckets, s.gathered_bytes, s.broadcast_bytes) for s in stats.values()}
    report("transport", transports == dict(shm="shm", collective="collective", auto="shm") and len(counts) == 1
           and stats["shm"].buckets > 2, transports=transports, buckets=stats["shm"].buckets)
    report("unlinked", not left, left=sorted(left))

    weight_sync.SHM_DIR = "/nonexistent-shm"
    auto = WeightSync(model, mapping, bucket_bytes=16 << 10).transport
    try:
        WeightSync(model, mapping, bucket_bytes=16 << 10, transport="shm")
        raised = ""
    except RuntimeError as e:
        raised = str(e)
    weight_sync.SHM_DIR = SHM_DIR
    dist.barrier()
    report("fallback", auto == "collective" and "no room" in raised, auto=auto, raised=raised)
    del syncs


if __name__ == "__main__":
    main()
