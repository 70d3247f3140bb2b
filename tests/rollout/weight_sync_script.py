# torchrun --nproc_per_node 4 tests/rollout/weight_sync_script.py --hf-dirs HF1 HF2 --tp 2 --pp 2
"""Megatron (TP x PP) -> engine weight sync, checked on real processes. Prints one `RESULT {...}` line per check
per engine rank; the test reads them.

Per HF dir: build the Megatron stage, fill it from the HF checkpoint through the family mapping, and sync into a
receiving engine (a `transformers` model built from the config with OTHER random weights, whose load_weights copies
into its state dict) on the even ranks only (odd ranks pass engine=None and only relay). Checks on every engine:
- `exact`: every engine tensor equals the checkpoint's bit for bit (vocab padding trimmed, QKV/gate-up unmapped);
- `logprobs`: the engine's log-probs of fixed sequences equal the Megatron model's (fp32, <= 1e-4);
- `resync`: after a deterministic perturbation of every Megatron parameter, a second sync (the cached plan) makes
  the engine's log-probs the new model's, and they moved (> 1e-2) from the old ones;
- `bf16`: a sync with dtype=bf16 hands over bf16 tensors equal to the fp32 weights cast (cast at the source).
With `--first-stage-layers N` the model is built with an uneven pipeline split (num_layers_in_first_pipeline_stage)
from Megatron's own random init (no even-split loader is involved) and only `logprobs` and `resync` run.
`--engine vllm` runs the vLLM checks instead (see vllm_checks), `--engine both` runs both kinds in one launch.
"""
import argparse
import json

import torch

TOL = 1e-4


class StateDictEngine:
    """A receiving engine: a `transformers` causal LM whose load_weights copies into its state dict."""

    def __init__(self, hf_config, seed):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
        self.state = self.model.state_dict()
        self.received: dict[str, torch.Tensor] = {}
        self.calls = 0
        self.finished = 0

    def load_weights(self, weights):
        self.calls += 1
        for name, t in weights:
            self.received[name] = t.clone()  # the views are only valid during the call
            with torch.no_grad():
                self.state[name].copy_(t)

    def finish_weight_sync(self):
        self.finished += 1

    @torch.no_grad()
    def logprobs(self, ids):
        logits = self.model(ids).logits.float()
        return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]


def megatron_logprobs(model, ids):
    """(B, T-1) log-probs of the next tokens from the Megatron model, on every rank."""
    import torch.distributed as dist

    from megatron_searchr1.models.forward import forward_logits

    logits = forward_logits(model, ids)
    lp = None
    if logits is not None:
        lp = torch.log_softmax(logits.float()[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, lp)
    return next(x for x in found if x is not None)


@torch.no_grad()
def perturb(model):
    """Move every parameter by a fixed pattern that depends on its shape only: replicated tensors stay equal over
    TP ranks and a tied embedding's last-stage copy stays equal to the embedding."""
    for p in model.parameters():
        pattern = torch.sin(torch.arange(p.numel(), dtype=torch.float32) * 0.37 + p.numel())
        p.add_(0.05 * pattern.view(p.shape).to(p.dtype))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf-dirs", nargs="+", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models; vllm engine only)")
    ap.add_argument("--first-stage-layers", type=int, default=None)
    ap.add_argument("--bucket-bytes", type=int, default=16 << 10, help="small: many buckets, some single tensors")
    ap.add_argument("--engine", default="state_dict", choices=["state_dict", "vllm", "both"],
                    help="both: the state-dict checks on every --hf-dirs model, then the vLLM checks on the first one, "
                         "in the same processes (one launch)")
    a = ap.parse_args()

    from megatron_searchr1.megatron.initialize import destroy_megatron, initialize_megatron

    initialize_megatron(tp=a.tp, pp=a.pp, ep=a.ep)
    if a.engine in ("state_dict", "both"):
        state_dict_checks(a)
    if a.engine in ("vllm", "both"):
        vllm_checks(a, a.hf_dirs[:1] if a.engine == "both" else a.hf_dirs)
    destroy_megatron()


def state_dict_checks(a):
    """The checks above, into a receiving `transformers` engine on the even ranks (rows tagged engine=state_dict)."""
    import torch.distributed as dist
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from megatron_searchr1.models.convert import SafetensorsReader, bind_mapping, load_hf_weights
    from megatron_searchr1.models.gpt import build_gpt_model, transformer_config_from_hf
    from megatron_searchr1.rollout.weight_sync import WeightSync, sync_weights

    rank = dist.get_rank()
    feeds_engine = rank % 2 == 0 or dist.get_world_size() == 1

    def report(arch, check, **kw):
        if feeds_engine:
            row = dict(rank=rank, arch=arch, engine="state_dict", check=check, **kw)
            print("RESULT " + json.dumps(row), flush=True)

    for hf_dir in a.hf_dirs:
        hf_config = AutoConfig.from_pretrained(hf_dir)
        arch = hf_config.architectures[0] + ("-tied" if hf_config.tie_word_embeddings else "")
        uneven = a.first_stage_layers is not None
        if uneven:
            torch.manual_seed(1)  # Megatron's own init, the same on every TP rank of a stage (fp32, CPU)
            config = transformer_config_from_hf(hf_config, tp=a.tp, pp=a.pp,
                                                num_layers_in_first_pipeline_stage=a.first_stage_layers)
            model = build_gpt_model(hf_config, config=config)
            layers = [int(l.layer_number) for l in model.decoder.layers]
            report(arch, "layers", layer_numbers=layers, ok=True)
        else:
            model = build_gpt_model(hf_config)
            load_hf_weights(model, SafetensorsReader(hf_dir), bind_mapping(hf_config, model))
        model.eval()
        mapping = bind_mapping(hf_config, model)
        engine = StateDictEngine(hf_config, seed=100 + rank) if feeds_engine else None
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, hf_config.vocab_size, (3, 12), generator=g)

        stats = sync_weights(model, engine, mapping, bucket_bytes=a.bucket_bytes)
        if engine is not None:
            names = sorted(engine.received)
            expected = sorted(n for n in engine.state if not (hf_config.tie_word_embeddings and n == "lm_head.weight"))
            report(arch, "names", ok=names == expected and engine.finished == 1 and engine.calls == stats.buckets
                   and stats.bytes == sum(t.numel() * t.element_size() for t in engine.received.values()),
                   buckets=stats.buckets, nbytes=stats.bytes, missing=sorted(set(expected) - set(names)),
                   extra=sorted(set(names) - set(expected)))
            if not uneven:
                ckpt = load_file(f"{hf_dir}/model.safetensors")
                bad = [n for n in expected if not torch.equal(engine.state[n], ckpt[n])]
                report(arch, "exact", ok=not bad and len(expected) == len(ckpt), bad=bad[:5])
        ref = megatron_logprobs(model, ids)
        if engine is not None:
            diff = (engine.logprobs(ids) - ref).abs().max().item()
            report(arch, "logprobs", diff=diff, ok=diff <= TOL)

        perturb(model)
        new_ref = megatron_logprobs(model, ids)
        cached = model.__dict__["_searchr1_weight_syncs"]
        stats2 = sync_weights(model, engine, mapping, bucket_bytes=a.bucket_bytes)
        if engine is not None:
            got = engine.logprobs(ids)
            diff = (got - new_ref).abs().max().item()
            moved = (new_ref - ref).abs().max().item()
            report(arch, "resync", diff=diff, moved=moved, ok=diff <= TOL and moved > 1e-2
                   and len(cached) == 1 and engine.finished == 2, seconds=stats2.seconds)

        if not uneven:
            bf = StateDictEngine(hf_config, seed=7) if feeds_engine else None
            WeightSync(model, mapping, bucket_bytes=a.bucket_bytes, dtype=torch.bfloat16).sync(bf)
            fp = StateDictEngine(hf_config, seed=8) if feeds_engine else None
            WeightSync(model, mapping, bucket_bytes=1 << 30).sync(fp)  # one bucket per stage
            if bf is not None:
                dtypes = sorted({str(t.dtype) for t in bf.received.values()})
                bad = [n for n, t in bf.received.items() if not torch.equal(t, fp.received[n].to(torch.bfloat16))]
                report(arch, "bf16", ok=dtypes == ["torch.bfloat16"] and not bad and len(bf.received) > 0,
                       dtypes=dtypes, bad=bad[:5], buckets_one=fp.calls)
        dist.barrier()


def vllm_checks(a, hf_dirs):
    """Every rank runs its own vLLM engine (TP=1, fp32, external_launcher) fed by the sync from Megatron TP x PP.

    The engine greedily generates from fixed prompts; its log-probs of the generated tokens must equal the Megatron
    model's log-probs of the same sequences (`logprobs`); after a perturbation and a second sync they must equal the
    new model's, and the new model's differ from the old ones on the first sequences (`resync`).
    """
    import torch.distributed as dist
    from transformers import AutoConfig

    from megatron_searchr1.models.convert import SafetensorsReader, bind_mapping, load_hf_weights
    from megatron_searchr1.models.gpt import build_gpt_model
    from megatron_searchr1.rollout.engine import SamplingParams
    from megatron_searchr1.rollout.engines import make_engine
    from megatron_searchr1.rollout.weight_sync import sync_weights

    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    for hf_dir in hf_dirs:
        hf_config = AutoConfig.from_pretrained(hf_dir)
        arch = hf_config.architectures[0] + ("-tied" if hf_config.tie_word_embeddings else "")
        model = build_gpt_model(hf_config)
        load_hf_weights(model, SafetensorsReader(hf_dir), bind_mapping(hf_config, model))
        model.eval()
        mapping = bind_mapping(hf_config, model)
        # The engine starts from the checkpoint; perturb Megatron first so the first sync must change the engine.
        perturb(model)
        engine = make_engine("vllm", hf_dir, dtype="float32", kv_cache_gib=0.05, max_model_len=64, seed=0)
        prompts = torch.randint(0, hf_config.vocab_size, (3, 6), generator=g)
        params = SamplingParams(max_tokens=6, temperature=0.0)

        def engine_vs_megatron():
            outs = engine.generate([p.tolist() for p in prompts], params)
            seqs = torch.cat([prompts, torch.tensor([o.token_ids for o in outs])], dim=1)
            ref = megatron_logprobs(model, seqs)[:, prompts.shape[1] - 1:]  # log p(generated token i)
            got = torch.tensor([o.logprobs for o in outs])
            return seqs, ref, (got - ref).abs().max().item()

        before, _, stale = engine_vs_megatron()  # the engine still holds the checkpoint's weights
        sync_weights(model, engine, mapping, bucket_bytes=a.bucket_bytes)
        seqs, ref, diff = engine_vs_megatron()
        print("RESULT " + json.dumps(dict(rank=rank, arch=arch, engine="vllm", check="logprobs", diff=diff, stale=stale,
                                          ok=diff <= TOL and stale > 1e-2)), flush=True)
        old_lp = megatron_logprobs(model, seqs)
        perturb(model)
        moved = (megatron_logprobs(model, seqs) - old_lp).abs().max().item()
        sync_weights(model, engine, mapping, bucket_bytes=a.bucket_bytes)
        _, _, diff2 = engine_vs_megatron()
        print("RESULT " + json.dumps(dict(rank=rank, arch=arch, engine="vllm", check="resync", diff=diff2, moved=moved,
                                          ok=diff2 <= TOL and moved > 1e-2)), flush=True)
        engine.close()
        dist.barrier()


if __name__ == "__main__":
    main()
