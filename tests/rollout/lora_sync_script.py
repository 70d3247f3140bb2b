# torchrun --nproc_per_node 2 tests/rollout/lora_sync_script.py --hf-dir HF --tp 2
"""The weight sync of a LoRA actor (test_lora_sync.py's worker): a Megatron model at TP x 1 from the HF dir, LoRA on
every projection with random nonzero adapters, synced into a `transformers` engine on every rank (the sync into
vLLM runs end to end in tests/trainer/test_lora_rl.py). Prints one `RESULT {json}` line per check per rank:

- `names`: the engine receives exactly the HF model's tensor names, no adapter tensor, in the planned buckets;
- `exact`: each received tensor is the merged export's (base + scale * B A) bit for bit;
- `logprobs`: the engine's log-probs equal the Megatron model's with its adapters on (<= 1e-4), and differ from the
  base's (the merge mattered);
- `base`: every base parameter is bit-identical after the syncs (the merge is a new tensor, never in place);
- `resync`: after the adapters change, a second sync makes the engine follow them.
"""
import argparse
import json

import torch

from tests.rollout.weight_sync_script import StateDictEngine, megatron_logprobs

TOL = 1e-4


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf-dir", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--bucket-bytes", type=int, default=16 << 10, help="small: many buckets")
    a = ap.parse_args()

    import torch.distributed as dist
    from transformers import AutoConfig

    from megatron_searchr1.megatron.initialize import destroy_megatron, initialize_megatron
    from megatron_searchr1.models.convert import SafetensorsReader, bind_mapping, load_hf_weights
    from megatron_searchr1.models.gpt import build_gpt_model
    from megatron_searchr1.models.lora import (
        LoraSettings, apply_lora, disable_adapters, is_lora_param, load_adapter_state,
    )
    from megatron_searchr1.models.lora_export import merged_hf_tensors
    from megatron_searchr1.rollout.weight_sync import sync_weights
    from tests.models.test_lora import random_adapter_state

    initialize_megatron(tp=a.tp, pp=1)
    rank = dist.get_rank()

    def report(check, **kw):
        print("RESULT " + json.dumps(dict(rank=rank, check=check, **kw)), flush=True)

    hf_config = AutoConfig.from_pretrained(a.hf_dir)
    model = build_gpt_model(hf_config, use_te=False)
    load_hf_weights(model, SafetensorsReader(a.hf_dir), bind_mapping(hf_config, model))
    apply_lora(model, LoraSettings(rank=4, alpha=8, targets=("all",)))
    load_adapter_state(model, random_adapter_state(model, seed=0, scale=0.2))
    model.eval()
    mapping = bind_mapping(hf_config, model)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not is_lora_param(n)}
    g = torch.Generator().manual_seed(0)

    engine = StateDictEngine(hf_config, seed=100 + rank)
    ids = torch.randint(0, hf_config.vocab_size, (3, 12), generator=g)

    def engine_vs_megatron():
        lp = megatron_logprobs(model, ids)
        with disable_adapters(model):
            base_lp = megatron_logprobs(model, ids)
        return (engine.logprobs(ids) - lp).abs().max().item(), (lp - base_lp).abs().max().item()

    stats = sync_weights(model, engine, mapping, bucket_bytes=a.bucket_bytes)
    names = sorted(engine.received)
    expected = sorted(n for n in engine.state if not (hf_config.tie_word_embeddings and n == "lm_head.weight"))
    report("names", ok=names == expected and stats.buckets > 1 and engine.calls == stats.buckets,
           buckets=stats.buckets, extra=sorted(set(names) - set(expected))[:5])
    merged = merged_hf_tensors(model, hf_config)
    bad = [n for n in expected if not torch.equal(engine.received[n], merged[n])]
    report("exact", ok=not bad and set(merged) == set(expected), bad=bad[:5])
    diff, merge_effect = engine_vs_megatron()
    report("logprobs", diff=diff, merge_effect=merge_effect, ok=diff <= TOL and merge_effect > 1e-3)

    load_adapter_state(model, random_adapter_state(model, seed=1, scale=0.2))
    sync_weights(model, engine, mapping, bucket_bytes=a.bucket_bytes)
    diff2, _ = engine_vs_megatron()
    report("resync", diff=diff2, ok=diff2 <= TOL)
    now = dict(model.named_parameters())
    report("base", ok=all(torch.equal(now[n].detach(), t) for n, t in base.items()) and len(base) > 0)
    dist.barrier()
    destroy_megatron()


if __name__ == "__main__":
    main()
