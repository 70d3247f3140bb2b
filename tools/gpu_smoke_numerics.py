# torchrun --standalone --nproc_per_node 1 tools/gpu_smoke_numerics.py --work-dir DIR    (tools/gpu_smoke.sh runs it)
"""The smoke check's numerics, asserted: three tiny models built here, each through the trainer's own pieces on this
device (bf16 on a GPU, fp32 on the CPU), each check a failure when it does not hold:

  qwen2_padded   a Qwen2 whose embedding is padded past its tokenizer, the padded output rows the most likely ones
                 (megatron_searchr1/preflight.py pad_vocabulary: an unmasked sampler picks nothing else);
  qwen3          Qwen3's q/k RMSNorm inside attention;
  qwen3_moe      a Qwen3-MoE (4 experts, top-2) at EP = 1.

Per model: the actor (Megatron, distributed optimizer) syncs its weights into the hf reference engine
(rollout/weight_sync.py, the trainer's sync; vLLM does not reach the GPU machine; the MoE model's engine keeps the
checkpoint's weights, since transformers fuses the experts and takes no per-expert names), the engine samples 16
tokens per prompt (never a padded id); Megatron's log-probs of them against the engine's (max |diff| <= --tol, default 0.1 in
bf16, 1e-3 in fp32); one update with the sampled tokens as targets: loss finite, gradient norm finite and > 0;
then the generation offload (megatron/offload.py: parameters, gradients, Adam state and fp32 masters to host
memory and back, as around a rollout): every parameter and optimizer state tensor bit-exact afterwards, and on a GPU
the device memory it freed at least 90 % of the bytes it says it moved. One line per model, `NUMERICS name: ok` or
`NUMERICS name: FAILED (...)`; exit 0 when all are ok, else 1.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from types import SimpleNamespace

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # run as a file under torchrun: the package from this checkout

MODELS = {"qwen2_padded": dict(arch="qwen2"), "qwen3": dict(arch="qwen3"),
          "qwen3_moe": dict(arch="qwen3_moe", num_experts=4, experts_per_token=2)}


def make_model(work: str, name: str) -> str:
    from megatron_searchr1.models.tiny import TinyModelConfig, make_tiny_model
    from megatron_searchr1.preflight import pad_vocabulary

    path = make_tiny_model(TinyModelConfig(output_dir=os.path.join(work, name), vocab_size=500, init_std=0.05,
                                           seed=1, **MODELS[name]))
    if name.endswith("_padded"):
        pad_vocabulary(path)
    return path


def _state_tensors(actor, opt) -> dict[str, torch.Tensor]:
    """Copies of every parameter and optimizer state tensor (Adam's moments, fp32 master weights)."""
    from megatron_searchr1.models.forward import unwrap

    out = {f"param {n}": p.detach().clone() for n, p in unwrap(actor).named_parameters()}
    for k, o in enumerate(getattr(opt, "chained_optimizers", [opt])):
        for i, state in enumerate(o.optimizer.state.values()):
            for key, t in state.items():
                if torch.is_tensor(t) and t.dim() > 0:
                    out[f"opt{k} state{i} {key}"] = t.detach().clone()
        for i, group in enumerate(o.optimizer.param_groups):
            for j, p in enumerate(group["params"]):
                out[f"opt{k} group{i} main{j}"] = p.detach().clone()
    return out


def check_model(name: str, path: str, tol: float) -> list[str]:
    """The checks of one model (module doc); returns what failed."""
    from transformers import AutoTokenizer

    from megatron_searchr1.megatron.batching import TrainSequence, make_micro_batches
    from megatron_searchr1.megatron.offload import GenerationOffload
    from megatron_searchr1.megatron.optimizer import build_optimizer
    from megatron_searchr1.models.convert import bind_mapping, load_hf_config
    from megatron_searchr1.models.families import read_dims
    from megatron_searchr1.models.forward import unwrap
    from megatron_searchr1.models.gpt import model_settings
    from megatron_searchr1.rollout import weight_sync
    from megatron_searchr1.rollout.engine import SamplingParams
    from megatron_searchr1.rollout.engines.hf_engine import HFEngine
    from megatron_searchr1.trainer.losses import masked_nll_loss
    from megatron_searchr1.trainer.roles import Policy, build_actor
    from megatron_searchr1.trainer.sources import weights_loader

    gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if gpu else torch.float32
    hf, tok = load_hf_config(path), AutoTokenizer.from_pretrained(path)
    actor = build_actor(hf, **model_settings(hf, tp=1, pp=1, params_dtype=dtype), load_weights=weights_loader(hf, path),
                        use_distributed_optimizer=True, tokenizer_vocab_size=len(tok))
    opt, sched = build_optimizer(actor, lr=1e-4, clip_grad=1.0)
    policy = Policy(actor, opt, sched, mapping=bind_mapping(hf, unwrap(actor)), hf_config=hf)
    engine = HFEngine(path, dtype=dtype, device="cuda" if gpu else "cpu")
    failed, facts = [], []
    if read_dims(hf).moe is not None:
        # transformers fuses a layer's experts into one tensor: the hf engine takes no per-expert names (vLLM does).
        # It loaded the same checkpoint, so the comparison below still holds; the sync is the other models' check.
        facts.append("engine loaded from the checkpoint")
    else:
        weight_sync.sync_weights(actor, engine, policy.mapping, dtype=dtype)  # the engine gets the actor's weights
        facts.append("engine synced from Megatron")
    prompts = [tok(p)["input_ids"] for p in ("The capital of france is", "<search> the moon </search>")]
    gens = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=1.0, seed=0))
    ids = [t for g in gens for t in g.token_ids]
    if len(ids) != 32 or max(ids) >= len(tok):
        failed.append(f"{len(ids)} tokens, {sum(t >= len(tok) for t in ids)} padded ids")
    seqs = [TrainSequence(prompt_ids=p, response_ids=g.token_ids, loss_mask=torch.ones(len(g.token_ids)))
            for p, g in zip(prompts, gens)]
    ours = policy.log_probs(seqs, 4096, temperature=1.0)
    gap = max((torch.tensor(g.logprobs) - lp).abs().max().item() for g, lp in zip(gens, ours))
    facts.append(f"log-prob gap {gap:.2e}")
    if not gap <= tol:
        failed.append(f"engine/trainer log-prob gap {gap:.3g} > {tol:g}")
    m = policy.update(make_micro_batches(seqs, 4096), masked_nll_loss, with_entropy=True, entropy_grad=False)
    facts.append(f"loss {m['loss']:.4g}, grad_norm {m['grad_norm']:.3g}")
    if not (math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0):
        failed.append(f"update: loss {m['loss']}, grad_norm {m['grad_norm']}")
    before = _state_tensors(actor, opt)
    offload = GenerationOffload(SimpleNamespace(param_offload=True, grad_offload=True, optimizer_offload=True,
                                                ref_offload=False), actor=actor, actor_opt=opt)
    allocated = torch.cuda.memory_allocated() if gpu else 0
    offload.before_wake()
    offload.after_sync()
    freed = allocated - torch.cuda.memory_allocated() if gpu else None
    moved = sum(offload.reload().values())
    after = _state_tensors(actor, opt)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    facts.append(f"offload {moved / 2**20:.1f} MiB" + (f" (device freed {freed / 2**20:.1f} MiB)" if gpu else "")
                 + f", {len(before)} tensors compared")
    if changed or moved == 0 or len(before) != len(after):
        failed.append(f"offload round trip: {len(changed)} tensors changed ({changed[:3]}), {moved} bytes moved")
    if gpu and freed < 0.9 * moved:
        failed.append(f"offload freed {freed} device bytes of {moved} moved")
    engine.close()
    print(f"NUMERICS {name}: {'ok' if not failed else 'FAILED (' + '; '.join(failed) + ')'} ({'; '.join(facts)})",
          flush=True)
    return failed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", required=True, help="where the models are written")
    p.add_argument("--tol", type=float, default=None, help="largest log-prob gap (default 0.1 in bf16, 1e-3 in fp32)")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ", ".join(MODELS))
    args = p.parse_args()
    from megatron_searchr1.megatron.initialize import destroy_megatron, initialize_megatron

    tol = args.tol or (0.1 if torch.cuda.is_available() else 1e-3)
    initialize_megatron(tp=1, pp=1)
    bad = []
    for name in args.models.split(","):
        try:
            if check_model(name, make_model(args.work_dir, name), tol):
                bad.append(name)
        except Exception as e:  # noqa: BLE001 - one model's crash is its line; the others still run
            print(f"NUMERICS {name}: FAILED ({type(e).__name__}: {e})", flush=True)
            bad.append(name)
    destroy_megatron()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
