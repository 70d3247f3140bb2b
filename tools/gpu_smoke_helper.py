# python tools/gpu_smoke_helper.py phase NAME --log FILE [--gpu] [--timeout S] -- CMD ...   (tools/gpu_smoke.sh runs it)
"""The pieces of tools/gpu_smoke.sh that are easier in Python than in bash.

  phase    run one phase's command (its output to a log file), watch the GPU's used memory meanwhile, and print
           `PHASE name: pass|fail (peak GPU memory X GiB, N s)`; a failure also prints the log's last lines;
  serve    write the synthetic world and serve retrieval over it until SIGTERM: the real server over a BM25 index
           when bm25s, PyStemmer, fastapi and uvicorn import, else a word-overlap server on the standard library
           (the smoke check tests the trainer's GPU path, not retrieval quality; the GPU machine lacks those
           packages unless their wheels come along). Either one speaks Search-R1's POST /retrieve;
  prepare  the gold SFT trajectories (through the running server) and the random tiny model;
  compare  two Hugging Face directories hold the same tensors (the conversion round trip);
  steps    a run's metrics.jsonl has N steps whose loss is finite and whose gradient norm is finite and > 0 (an
           exit code of 0 alone would also pass a run whose update silently did nothing), optionally whose
           engine/trainer log-prob gap is at most --max-gap;
  same     two runs' metrics agree at one step (a resumed run against the run it resumed from);
  init     (under torchrun) device memory free before Megatron's start-up, after it, and after the first
           collective on each of its process groups: what the communicators cost;
  width    (under torchrun) one training step of a real model's width (Qwen2.5-7B's by default, 2 layers), one
           sequence of N tokens, entropy on: peak allocated / reserved memory beside the planner's figures.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 1024 ** 3
WORLD_ARGS = ["--template", "short", "--seed", "0", "--n-train", "200", "--n-validation", "20", "--n-test", "20"]
TINY_MODEL = ["--hidden-size", "128", "--intermediate-size", "256", "--num-layers", "2", "--num-heads", "4",
              "--num-kv-heads", "2", "--vocab-size", "1000", "--tie-embeddings"]  # head_dim 32, as the tests' model


# ------------------------------------------------------------------------------------------------ phase
def _gpu_used_bytes():
    """A function returning GPU 0's used memory in bytes (NVML, else nvidia-smi), or None when neither works."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        return lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used
    except Exception:  # noqa: BLE001 - no NVML: try the command line tool
        pass

    def smi():
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=10).stdout
        return int(out.split()[0]) * 1024 ** 2

    try:
        smi()
        return smi
    except Exception:  # noqa: BLE001
        return None


def run_phase(name: str, cmd: list[str], log: str, gpu: bool, timeout: float, summary: str = "") -> int:
    """Run `cmd` in its own process group, output to `log`; kill the group at `timeout`; print the PHASE line (and
    append it, with a failure's last log lines, to `summary` when given: a file that outlives a killed run)."""
    read = _gpu_used_bytes() if gpu else None
    peak = [read() if read else 0]
    done = threading.Event()

    def watch():  # device-wide used memory: the phase's processes and the CUDA contexts they hold
        while not done.wait(0.2):
            try:
                peak[0] = max(peak[0], read())
            except Exception:  # noqa: BLE001 - a failed sample is skipped
                pass

    watcher = threading.Thread(target=watch, daemon=True) if read else None
    if watcher:
        watcher.start()
    t0 = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the phase's own group: torchrun and its workers
            proc.wait()
            rc = 124
            out.write(f"\n[gpu_smoke] killed after {timeout:.0f}s\n")
    done.set()
    if watcher:
        watcher.join()
    memory = f"{peak[0] / GIB:.2f} GiB" if read else "n/a"
    text = ""
    if rc != 0:
        with open(log, errors="replace") as f:
            tail = f.readlines()[-30:]
        text = f"--- {name} failed (exit {rc}); last lines of {log}:\n{''.join(tail)}---\n"
    text += f"PHASE {name}: {'pass' if rc == 0 else 'fail'} (peak GPU memory {memory}, {time.time() - t0:.0f} s)\n"
    print(text, end="", flush=True)
    if summary:
        with open(summary, "a") as f:
            f.write(text)
    return rc


# ------------------------------------------------------------------------------------------------ serve
def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


class OverlapIndex:
    """Documents ranked by the summed IDF of the query words they contain: enough to find the synthetic world's
    passages by the names in a question."""

    def __init__(self, docs: list[dict]):
        self.docs = docs
        self.postings: dict[str, list[int]] = defaultdict(list)
        for i, d in enumerate(docs):
            for w in set(_words(d["contents"])):
                self.postings[w].append(i)
        self.idf = {w: math.log(1 + len(docs) / len(ids)) for w, ids in self.postings.items()}

    def search(self, query: str, topk: int) -> list[tuple[int, float]]:
        scores: Counter = Counter()
        for w in set(_words(query)):
            for i in self.postings.get(w, ()):
                scores[i] += self.idf[w]
        return sorted(scores.items(), key=lambda x: (-x[1], x[0]))[:topk]


def _overlap_server(corpus_path: str) -> tuple[str, callable]:
    with open(corpus_path, encoding="utf-8") as f:
        index = OverlapIndex([json.loads(line) for line in f if line.strip()])

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
            topk, scores = int(body.get("topk", 3)), bool(body.get("return_scores", True))
            result = [[{"document": index.docs[i], "score": s} if scores else index.docs[i]
                       for i, s in index.search(q, topk)] for q in body.get("queries", [])]
            data = json.dumps({"result": result}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):  # quiet: one line a request would bury the log
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{httpd.server_address[1]}", httpd.shutdown


def _real_stack_imports() -> bool:
    try:
        import bm25s  # noqa: F401
        import fastapi  # noqa: F401
        import Stemmer  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        return False
    return True


def serve(work: str, url_file: str) -> int:
    world = os.path.join(work, "world")
    subprocess.run([sys.executable, "-m", "megatron_searchr1.data.make_world", "--out-dir", world, *WORLD_ARGS],
                   check=True)
    corpus = os.path.join(world, "corpus.jsonl")
    if _real_stack_imports():
        from megatron_searchr1.search.retrievers import index_corpus
        from megatron_searchr1.search.server import BackgroundServer

        server = BackgroundServer(index_corpus(corpus, os.path.join(world, "index_bm25"), kind="bm25"))
        url, stop, kind = server.url, server.stop, "BM25 (megatron_searchr1.search.server)"
    else:
        url, stop = _overlap_server(corpus)
        kind = "word overlap (standard library; bm25s/PyStemmer/fastapi/uvicorn do not import)"
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stopped.set())
    signal.signal(signal.SIGINT, lambda *a: stopped.set())
    with open(url_file + ".tmp", "w") as f:
        f.write(url)
    os.replace(url_file + ".tmp", url_file)  # whole, so the script never reads half a URL
    print(f"retriever: {kind} at {url}", flush=True)
    stopped.wait()
    stop()
    return 0


# ------------------------------------------------------------------------------------------------ prepare
def prepare(work: str, url: str) -> int:
    """Gold trajectories through the server (the SFT data) and a tiny model whose tokenizer knows the world."""
    world = os.path.join(work, "world")
    subprocess.run([sys.executable, "-m", "megatron_searchr1.data.make_world", "--out-dir", world, *WORLD_ARGS,
                    "--oracle-url", url], check=True)
    from megatron_searchr1.demo import world_text

    text = os.path.join(work, "world_text.txt")
    world_text(world, text)
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "make_tiny_model.py"), "--output-dir",
                    os.path.join(work, "tiny_model"), "--overwrite", "--text", text, *TINY_MODEL], check=True)
    return 0


# ------------------------------------------------------------------------------------------------ compare
def compare(a: str, b: str) -> int:
    """0 when both HF dirs hold the same tensor names, shapes and values (the round trip is exact)."""
    import glob

    from safetensors.torch import load_file

    def tensors(d):
        out = {}
        for path in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
            out.update(load_file(path))
        return out

    ta, tb = tensors(a), tensors(b)
    problems = [f"only in {a}: {sorted(set(ta) - set(tb))}"] if set(ta) - set(tb) else []
    problems += [f"only in {b}: {sorted(set(tb) - set(ta))}"] if set(tb) - set(ta) else []
    for name in sorted(set(ta) & set(tb)):
        x, y = ta[name], tb[name]
        if x.shape != y.shape or x.dtype != y.dtype:
            problems.append(f"{name}: {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}")
        elif not x.equal(y):
            problems.append(f"{name}: max |diff| {(x.float() - y.float()).abs().max().item():.3g}")
    for p in problems:
        print(f"round trip differs: {p}")
    print(f"compared {len(ta)} tensors: {'identical' if not problems else f'{len(problems)} differ'}")
    return 1 if problems else 0


# ------------------------------------------------------------------------------------------------ steps
GAP = "train/logprob_gap_engine"
"""The mean |engine - trainer| log-prob of a step's generated tokens (trainer/rl.py)."""


def check_steps(metrics: str, steps: int, prefix: str, max_gap: float | None = None) -> int:
    """0 when `metrics` has `steps` rows with a finite `{prefix}/loss` and a finite, positive `{prefix}/grad_norm`
    (and, with `max_gap`, a finite engine/trainer log-prob gap of at most that)."""
    with open(metrics) as f:
        rows = [r for r in map(json.loads, filter(str.strip, f)) if f"{prefix}/grad_norm" in r]
    loss, norm = f"{prefix}/loss", f"{prefix}/grad_norm"
    bad = [r["step"] for r in rows if not (math.isfinite(r[loss]) and math.isfinite(r[norm]) and r[norm] > 0)]
    if max_gap is not None:
        print("engine/trainer log-prob gap per step: " + ", ".join(f"{r.get(GAP)}" for r in rows))
        bad += [r["step"] for r in rows if not (math.isfinite(r.get(GAP, math.nan)) and r[GAP] <= max_gap)]
    print(f"{len(rows)} steps in {metrics}: " + ", ".join(
        f"step {r['step']} loss {r[f'{prefix}/loss']:.4g} grad_norm {r[f'{prefix}/grad_norm']:.3g}" for r in rows))
    if len(rows) != steps or bad:
        gap = "" if max_gap is None else f" and a log-prob gap <= {max_gap:g}"
        print(f"expected {steps} steps with a finite loss and a finite grad norm > 0{gap}; steps that are not: "
              f"{sorted(set(bad))}")
        return 1
    return 0


# ------------------------------------------------------------------------------------------------ same
def same_step(a: str, b: str, step: int, keys: list[str], tol: float) -> int:
    """0 when the rows of `step` in two metrics.jsonl files agree on every key in `keys` within a relative `tol`."""
    def row(path):
        with open(path) as f:
            rows = [r for r in map(json.loads, filter(str.strip, f)) if r.get("step") == step and keys[0] in r]
        return rows[-1] if rows else None

    ra, rb = row(a), row(b)
    if ra is None or rb is None:
        print(f"step {step} with {keys[0]} is missing from {a if ra is None else b}")
        return 1
    worst = 0.0
    for k in keys:
        x, y = float(ra[k]), float(rb[k])
        worst = max(worst, abs(x - y) / max(abs(x), abs(y), 1e-12))
        print(f"step {step} {k}: {x!r} vs {y!r}")
    print(f"largest relative difference {worst:.3g} (allowed {tol:g})")
    return 0 if worst <= tol else 1


# ------------------------------------------------------------------------------------------------ init, width
def _free_bytes():
    import torch

    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None


def _fmt(n) -> str:
    return "n/a" if n is None else f"{n / GIB:.2f} GiB"


def init_memory() -> int:
    """Device memory free before initialize_megatron, after it, and after one all_reduce on each of Megatron's
    groups. NCCL connects a group lazily, at its first collective (megatron/initialize.py binds no device), so the
    third figure is what a training step's communicators cost, the second what start-up alone costs."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megatron_searchr1.collectives import collective_device
    from megatron_searchr1.megatron.initialize import destroy_megatron, initialize_megatron

    before = _free_bytes()
    initialize_megatron(tp=1, pp=1)
    after_init = _free_bytes()
    getters = ("get_data_parallel_group", "get_tensor_model_parallel_group", "get_pipeline_model_parallel_group",
               "get_model_parallel_group", "get_expert_model_parallel_group", "get_expert_data_parallel_group")
    touched = 0
    for name in getters:
        group = getattr(mpu, name, lambda **_: None)()
        if group is not None:
            dist.all_reduce(torch.ones(1, device=collective_device()), group=group)
            touched += 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    after_groups = _free_bytes()
    costs = ("" if before is None else
             f" (start-up {_fmt(before - after_init)}, first collectives {_fmt(after_init - after_groups)})")
    print(f"free before {_fmt(before)}, after initialize_megatron {_fmt(after_init)}, after the first collective on "
          f"{touched} groups {_fmt(after_groups)}{costs}")
    destroy_megatron()
    return 0 if touched else 1


def width_step(hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, layers: int, tokens: int) -> int:
    """One update of a Qwen2 model of this width on one sequence of `tokens` tokens (SFT loss, entropy computed as
    the RL update does at entropy_coeff 0), bf16 on a GPU; peak memory beside the planner's figures for it."""
    import torch
    from transformers import Qwen2Config

    from megatron_searchr1.megatron.batching import TrainSequence, make_micro_batches
    from megatron_searchr1.megatron.initialize import destroy_megatron, initialize_megatron
    from megatron_searchr1.megatron.optimizer import build_optimizer
    from megatron_searchr1.models.families import read_dims
    from megatron_searchr1.models.gpt import model_settings
    from megatron_searchr1.plan import activation_bytes_per_token_layer, count_params, head_bytes_per_token
    from megatron_searchr1.trainer.losses import masked_nll_loss
    from megatron_searchr1.trainer.roles import Policy, build_actor

    gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if gpu else torch.float32
    hf = Qwen2Config(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                     intermediate_size=ffn, vocab_size=vocab, num_hidden_layers=layers, max_position_embeddings=32768,
                     tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"], torch_dtype="bfloat16")
    initialize_megatron(tp=1, pp=1)
    model = build_actor(hf, **model_settings(hf, tp=1, pp=1, params_dtype=dtype))
    policy = Policy(model, *build_optimizer(model, lr=1e-6, clip_grad=1.0), mapping=None, hf_config=hf)
    g = torch.Generator().manual_seed(0)
    seq = TrainSequence(prompt_ids=[1], response_ids=torch.randint(0, vocab, (tokens - 1,), generator=g).tolist(),
                        loss_mask=torch.ones(tokens - 1))
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    m = policy.update(make_micro_batches([seq], tokens), masked_nll_loss, with_entropy=True, entropy_grad=False)
    peak = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()) if gpu else (None, None)
    dims, a_bytes = read_dims(hf), 2 if gpu else 4
    counts = count_params(dims, tp=1, pp=1)
    n = counts.stages[0].actor
    state = n * (a_bytes + 4 + (12 if gpu else 8))  # weights, fp32 grads, Adam (+ fp32 master weights in bf16)
    act = activation_bytes_per_token_layer(dims, 1, sequence_parallel=False, recompute="none", a_bytes=a_bytes)
    head = head_bytes_per_token(dims, 1, entropy=True)
    print(f"step done: loss {m['loss']:.4g}, grad_norm {m['grad_norm']:.3g}; peak allocated {_fmt(peak[0])}, "
          f"reserved {_fmt(peak[1])}")
    print(f"planner: weights + grads + Adam {_fmt(state)}, activations {_fmt(act * tokens)} per layer x {layers}, "
          f"log-prob head {_fmt(head * tokens)}; sum {_fmt(state + act * tokens * layers + head * tokens)}")
    destroy_megatron()
    ok = math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    ph = sub.add_parser("phase")
    ph.add_argument("name")
    ph.add_argument("--log", required=True)
    ph.add_argument("--gpu", action="store_true", help="watch GPU 0's used memory")
    ph.add_argument("--timeout", type=float, default=600)
    ph.add_argument("--summary", default="", help="append the PHASE line to this file too")
    sv = sub.add_parser("serve")
    sv.add_argument("--work-dir", required=True)
    sv.add_argument("--url-file", required=True)
    pr = sub.add_parser("prepare")
    pr.add_argument("--work-dir", required=True)
    pr.add_argument("--url", required=True)
    cp = sub.add_parser("compare")
    cp.add_argument("a")
    cp.add_argument("b")
    st = sub.add_parser("steps")
    st.add_argument("metrics")
    st.add_argument("--steps", type=int, required=True)
    st.add_argument("--prefix", required=True, help="sft or actor")
    st.add_argument("--max-gap", type=float, default=None, help=f"largest {GAP} allowed")
    sm = sub.add_parser("same")
    sm.add_argument("a")
    sm.add_argument("b")
    sm.add_argument("--step", type=int, required=True)
    sm.add_argument("--keys", required=True, help="comma-separated metric names")
    sm.add_argument("--tol", type=float, default=0.0, help="largest relative difference allowed")
    sub.add_parser("init")
    wd = sub.add_parser("width")
    wd.add_argument("--hidden", type=int, default=3584)
    wd.add_argument("--heads", type=int, default=28)
    wd.add_argument("--kv-heads", type=int, default=4)
    wd.add_argument("--ffn", type=int, default=18944)
    wd.add_argument("--vocab", type=int, default=152064)
    wd.add_argument("--layers", type=int, default=2)
    wd.add_argument("--tokens", type=int, default=12288)
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv[argv.index("--") + 1:] if "--" in argv else []  # the phase's command, after "--"
    args = p.parse_args(argv[:len(argv) - len(cmd) - (1 if "--" in argv else 0)])
    if args.cmd == "phase":
        if not cmd:
            p.error("phase needs its command after --")
        return run_phase(args.name, cmd, args.log, args.gpu, args.timeout, args.summary)
    if args.cmd == "serve":
        return serve(args.work_dir, args.url_file)
    if args.cmd == "prepare":
        return prepare(args.work_dir, args.url)
    if args.cmd == "steps":
        return check_steps(args.metrics, args.steps, args.prefix, args.max_gap)
    if args.cmd == "same":
        return same_step(args.a, args.b, args.step, args.keys.split(","), args.tol)
    if args.cmd == "init":
        return init_memory()
    if args.cmd == "width":
        return width_step(args.hidden, args.heads, args.kv_heads, args.ffn, args.vocab, args.layers, args.tokens)
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
