# torchrun --nproc_per_node 2 tests/rollout/expert_tp_sync_script.py --hf-dir HF
"""An MoE model at TP=2 with expert-TP 1 (parallel.expert_tp's default: whole experts on every TP rank, attention
split over TP) on real processes: loaded from the HF checkpoint, its log-probs equal transformers' own, and the
weight sync hands the engine every tensor of the checkpoint bit for bit (the experts go over the expert groups, not
stacked by a TP all-gather). Prints one `RESULT {...}` line per check per rank."""
import argparse
import json

import torch

from tests.rollout.weight_sync_script import megatron_logprobs

TOL = 1e-4


class RecordingEngine:
    """Keeps what the sync hands over under its names (transformers' MoE fuses the experts of a layer into one
    tensor, so a transformers model cannot take the checkpoint's per-expert names that vLLM's loaders read)."""

    def __init__(self):
        self.received: dict[str, torch.Tensor] = {}

    def load_weights(self, weights):
        for name, t in weights:
            if name in self.received:
                raise AssertionError(f"{name} handed over twice")
            self.received[name] = t.clone()

    def finish_weight_sync(self):
        pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf-dir", required=True)
    a = ap.parse_args()

    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from transformers import AutoModelForCausalLM

    from megatron_searchr1.megatron.initialize import initialize_megatron
    from megatron_searchr1.models.convert import SafetensorsReader, bind_mapping, load_hf_config, load_hf_weights
    from megatron_searchr1.models.gpt import build_gpt_model, model_settings
    from megatron_searchr1.rollout.weight_sync import sync_weights

    initialize_megatron(tp=2, sequence_parallel=True, seed=3, expert_tp=1)
    rank = dist.get_rank()
    hf_config = load_hf_config(a.hf_dir)
    settings = model_settings(hf_config, tp=2, pp=1, params_dtype=torch.float32, use_te=False,
                              sequence_parallel=True)
    model = build_gpt_model(hf_config, **settings).eval()
    reader = SafetensorsReader(a.hf_dir)
    mapping = bind_mapping(hf_config, model)
    load_hf_weights(model, reader, mapping)
    fc1 = dict(model.named_parameters())["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"]
    print("RESULT " + json.dumps(dict(rank=rank, check="expert_shape", ok=tuple(fc1.shape) == (
        2 * hf_config.moe_intermediate_size, hf_config.hidden_size), shape=list(fc1.shape),
        expert_tp=mpu.get_expert_tensor_parallel_world_size())), flush=True)

    torch.manual_seed(0)
    ids = torch.randint(0, hf_config.vocab_size, (2, 10))
    ours = megatron_logprobs(model, ids)
    hf = AutoModelForCausalLM.from_pretrained(a.hf_dir, dtype=torch.float32, experts_implementation="eager").eval()
    with torch.no_grad():
        logits = hf(ids).logits.float()
    ref = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    diff = float((ours - ref).abs().max())
    print("RESULT " + json.dumps(dict(rank=rank, check="logprobs", ok=diff <= TOL, diff=diff)), flush=True)

    engine = RecordingEngine()
    sync_weights(model, engine, mapping)
    want = set(reader.names())
    bad = sorted(n for n in want if n not in engine.received or not torch.equal(engine.received[n], reader.get(n)))
    extra = sorted(set(engine.received) - want)
    print("RESULT " + json.dumps(dict(rank=rank, check="exact", ok=not bad and not extra, bad=bad[:5],
                                      extra=extra[:5], n=len(engine.received))), flush=True)


if __name__ == "__main__":
    main()
