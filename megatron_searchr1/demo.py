"""The CPU demo, one command: a tiny model learns to search a fictional world, and RL measurably helps.

    bash examples/cpu_demo.sh                                  # = python -m megatron_searchr1.demo --size full
    bash examples/cpu_demo.sh --seed 1 --work-dir runs/cpu_demo_1      # another world (the warm-up's move with it)
    python -m megatron_searchr1.demo --size ci --work-dir /tmp/demo     # the reduced run CI executes
    python -m megatron_searchr1.demo --make-base examples/demo_base     # rebuild the shipped base (~40 min)

Stages (each skipped when its output exists, so an interrupted demo continues; --fresh starts over):
  1. world      the RL world (seed --seed): a synthetic world (fictional entities: no model can know the answers)
                and its BM25 index; GRPO trains on its train questions, every evaluation asks its validation/test
                questions. The warm-up's data are trajectories (written with the real retriever by a lazy
                demonstrator that often answers a guess instead of searching again: `Size.sft_stop_early`) of
                other worlds (`world_seeds`), so RL and evaluation only meet entities the warm-up never saw; one
                more world's single-hop trajectories are the warm-up's validation. The worlds build in parallel;
  2. model      the model the warm-up starts from: the shipped base (`BASE_DIR`: a tiny Qwen2 and tokenizer that
                already read search results, trained by `--make-base` on worlds no --seed uses), as Search-R1
                starts from a pretrained model; or, with `--base scratch`, a BPE tokenizer trained on the worlds'
                text and a random tiny Qwen2 (models/tiny.py), whose warm-up needs ~3,000 steps to read;
  3. sft        the supervised warm-up on Megatron (torchrun, 2 processes, data-parallel: megatron_searchr1/sft.py)
                on this seed's worlds, validated every `Size.sft_val_freq` steps and stopped once it reads
                (`Size.sft_stop_at`);
  4. server     the retrieval server over the RL world's BM25 index, started here and stopped at the end;
  5. baseline   the warm-up model answering without search (rollout.max_turns=0) on the same questions;
  6. grpo       GRPO on Megatron (torchrun, 2 processes, TP=2) with vLLM rollouts fed by the weight sync,
                validation before and after (megatron_searchr1/train.py), and the HF export.
Each stage prints one line with its expected time as it starts. At the end: EM per split and hop count before/after
RL and without search, mean searches, three validation trajectories turn by turn, where the TensorBoard logs and
the pictures (the warm-up's loss, RL's training reward and validation EM by step) are, and the exported model's
path (also report.json). `--make-base DIR` runs stages 1-3 from scratch on the base's own worlds (`base_seeds`)
and writes the warm-up's HF export and base.json to DIR.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from megatron_searchr1.cli import ArgumentParser, UsageError, run_main


@dataclass(frozen=True)
class Size:
    world: tuple[str, ...]
    """make_synthetic_world.py arguments, but the seed (`seed`, the demo's --seed)."""
    seed: int
    """The RL world's seed (the demo's --seed overrides it); the SFT worlds' and the validation world's seeds
    follow from it (`world_seeds`)."""
    sft_steps: int
    """The warm-up's optimizer steps from the shipped base (`BASE_DIR`): the cap when `sft_stop_at` is set."""
    sft_batch: int
    """SFT examples per step."""
    grpo_steps: int
    """GRPO steps after the warm-up."""
    grpo_batch: int
    """Prompts per GRPO step (each sampled `n` times)."""
    n: int
    """Samples per prompt (GRPO group size)."""
    val_samples: int
    """Questions per split for each evaluation."""
    grpo_test_freq: int = 0
    """Validate every this many GRPO steps as well (0: before and after only)."""
    sft_worlds: int = 1
    """How many worlds (same sizes as the RL world, other seeds) write the SFT data from the base (from scratch:
    `scratch_sft_worlds`). Several worlds: more distinct names, so the warm-up learns to copy and read names
    rather than memorise a few thousand trajectories over many epochs. None is the RL world: RL on questions the
    warm-up had memorised re-samples memorised answers, while held-out questions need reading
    (examples/cpu_demo_sizes.md)."""
    sft_val: int = 0
    """Single-hop gold trajectories of one more world (`world_seeds`) that the warm-up validates on (0: none): its
    exact share (trainer/sft.py `validate`) says whether the model reads the answer from the retrieved passages."""
    sft_val_freq: int = 100
    """Validate the warm-up every this many steps."""
    sft_stop_at: Optional[float] = None
    """Stop the warm-up once its validation exact share reaches this (trainer.stop_at_val_exact), `sft_steps`
    being the cap: when the answer-reading skill appears varies from seed to seed, and RL needs it."""
    sft_loss_on_passages: bool = True
    """Put the warm-up's loss on every token, the retrieved passages and the prompt included
    (data.train_on_prompt), not only on what the model writes. A model trained from scratch learns to copy a name
    from the passages' own repetitions (a title, then the same name in the text) long before it learns to copy
    one into a query or an answer, so the answer-reading skill appears sooner (examples/cpu_demo.md). GRPO's loss
    stays on the model's own tokens, as Search-R1's does."""
    sft_lr: float = 3e-4
    """The warm-up's learning rate from the base (constant after a short warm-up: examples/sft_tiny_cpu.yaml). The
    base already reads; at the from-scratch rate (1e-3) its first hundred steps on new worlds undo part of that."""
    scratch_sft_steps: int = 3000
    """The warm-up's cap from a random model (`--base scratch`, and `--make-base`, which builds the base this way)."""
    scratch_sft_lr: float = 1e-3
    """The warm-up's learning rate from a random model."""
    scratch_sft_worlds: int = 4
    """SFT worlds from a random model: reading from scratch takes ~3,000 steps of 16, over ~22,000 examples."""
    scratch_val_freq: int = 100
    """Validate a warm-up from a random model every this many steps."""
    model_layers: int = 4
    """Decoder layers of the tiny model."""
    eta_s: tuple[tuple[str, float], ...] = ()
    """Expected seconds per stage on a free 2-core machine (measured: examples/cpu_demo.md), printed as each stage
    starts; SFT's is per step, GRPO's per step including its validations."""
    grpo_lr: float = 3e-5
    """GRPO's learning rate. From the base the multi-hop gain comes within 8-16 steps at 1e-4, 5e-5 or 3e-5 alike,
    but single-hop EM slipped at one seed of three at the faster rates (seed 2: -0.029 at 1e-4, -0.013 at 5e-5) and
    held at every seed at 3e-5 (examples/cpu_demo.md)."""
    sft_stop_early: float = 0.0
    """The SFT worlds' lazy demonstrator (make_world --stop-early): at each point where a multi-hop chain needs
    another search, its trajectory answers a guess instead with this probability. Above 0.5 the warm-up's greedy
    policy gives up after the first search on multi-hop questions, and RL has to learn from the reward that
    searching again pays; on perfect chains little is left for RL to learn (examples/cpu_demo_sizes.md)."""


SIZES = {
    # every stage runs for real at toy length (CI).
    # GRPO at 1e-4: at 5e-5 its 8-12 steps end before the policy learns to search again (measured: 0.32 -> 0.34).
    "ci": Size(world=(), seed=0, sft_steps=40, sft_batch=16, grpo_steps=12, grpo_batch=8, n=8, val_samples=50,
               sft_worlds=1, grpo_test_freq=6, grpo_lr=1e-4, sft_stop_early=0.6, sft_val=16, sft_val_freq=20,
               scratch_sft_steps=40, scratch_sft_worlds=1, scratch_val_freq=20,
               eta_s=(("world", 5), ("model", 10), ("sft", 0.8), ("no_search", 20), ("grpo", 7))),
    # The README's run (examples/cpu_demo.md): a diverse world so the warm-up learns to copy unseen names into
    # queries; as short as the effect allows (the runs that chose these lengths: examples/cpu_demo_sizes.md).
    "full": Size(world=("--n-people", "8000", "--n-companies", "2500", "--n-cities", "1500",
                        "--n-products", "2500", "--n-universities", "800", "--n-distractors", "3000",
                        "--n-train", "6000", "--n-validation", "300", "--n-test", "300"),
                 seed=3, sft_steps=400, sft_batch=16, grpo_steps=24, grpo_batch=8, n=8, val_samples=300,
                 sft_worlds=2, grpo_test_freq=8, sft_stop_early=0.6, sft_val=64, sft_val_freq=50,
                 sft_stop_at=0.6, eta_s=(("world", 25), ("model", 15), ("sft", 0.5), ("no_search", 25),
                                         ("grpo", 7.0))),
}
MODEL_ARGS = dict(hidden_size=128, intermediate_size=384, num_heads=4, num_kv_heads=2, tie_embeddings=True,
                  vocab_size=2000)
SFT_SEED_OFFSET = 100_000
"""The SFT worlds' seeds are seed + 100000 + i and the SFT validation world's seed + 200000: for any --seed below
100000 neither is ever an RL world, so the warm-up never sees the questions RL trains and is evaluated on."""
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
BASE_DIR = os.path.join(EXAMPLES, "demo_base")
"""The shipped base: a tiny Qwen2 and its tokenizer that already read search results (`--make-base` built it; its
base.json says how). The demo's warm-up starts from it, as Search-R1 starts from a pretrained model: reading
retrieved passages takes a random model ~3,000 warm-up steps (~30 min on 2 cores) and appears at a step that
varies from draw to draw, while what RL teaches, searching again on multi-hop questions, needs a model that reads."""
BASE_SEED = 300_000
"""The base's SFT worlds are BASE_SEED + i and its validation world BASE_SEED + 1000: above every seed a --seed run
uses (RL < 100000, SFT < 200004, validation < 300000), so no run's RL questions were in the base's training."""
BASE_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def world_seeds(seed: int, n_sft: int) -> tuple[list[int], int]:
    """The SFT worlds' seeds and the SFT validation world's, for the RL world's `seed`.

    >>> world_seeds(3, 2)
    ([100003, 100004], 200003)
    """
    return [seed + SFT_SEED_OFFSET + i for i in range(n_sft)], seed + 2 * SFT_SEED_OFFSET


def base_seeds(n_sft: int) -> tuple[list[int], int]:
    """The base's SFT worlds' seeds and its validation world's (`--make-base`).

    >>> base_seeds(2)
    ([300000, 300001], 301000)
    """
    return [BASE_SEED + i for i in range(n_sft)], BASE_SEED + 1000


def check_base(path: str) -> None:
    """Raise UsageError unless `path` holds a base model (what --make-base writes)."""
    missing = [f for f in BASE_FILES if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise UsageError(f"--base {path}: no {', '.join(missing)} there; pass a directory --make-base wrote, or "
                         "'scratch' for a random model")


def _log(msg: str) -> None:
    print(f"[cpu_demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _run(cmd: list[str], log_path: str, env: Optional[dict] = None, quiet: bool = False) -> None:
    """Run a stage's command, its output teed to a log file (`quiet`: to the log file only); a failure shows the
    log's tail and stops the demo."""
    _log(("" if quiet else " ".join(cmd) + "   ") + f"(log: {log_path})")
    full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **(env or {})}
    bar_open = False  # a progress bar redraws one terminal line ("\r"); anything else starts a new line
    with open(log_path, "w", buffering=1) as log:  # line-buffered: the log can be followed while it runs
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env)
        for line in proc.stdout:  # universal newlines: tqdm's "\r" redraws arrive as lines too
            log.write(line)
            if quiet or not _worth_showing(line):
                continue
            is_bar = "/step" in line and "|" in line
            sys.stdout.write(("\r" + line.rstrip("\n")) if is_bar else (("\n" if bar_open else "") + line))
            bar_open = is_bar
            sys.stdout.flush()
        rc = proc.wait()
        if bar_open:
            sys.stdout.write("\n")
    if rc != 0:
        with open(log_path) as f:
            tail = "".join(f.readlines()[-40:])
        raise RuntimeError(f"stage failed (exit {rc}): {' '.join(cmd)}\n--- last lines of {log_path} ---\n{tail}")


def _worth_showing(line: str) -> bool:
    """Progress bars, tables and our own messages, RL's per-step line at its first, every tenth and last step
    (the log file keeps every one); not the libraries' INFO/warning noise.

    >>> [_worth_showing(f"step {k}/50 reward=0.1") for k in (1, 2, 10, 49, 50)]
    [True, False, True, False, True]
    """
    noise = ("INFO", "WARNING", "warnings.warn", "UserWarning", "W1", "I1", "[W", "return func", "*****",
             "Setting OMP_NUM_THREADS", "Triton is installed")
    if any(n in line for n in noise):
        return False
    step = re.match(r"step (\d+)/(\d+) ", line)
    return step is None or int(step[1]) in (1, int(step[2])) or int(step[1]) % 10 == 0


def _torchrun(module: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", module,
            *args]


def _sft_dataset_dir(worlds: list[str], out_dir: str) -> tuple[str, list[str]]:
    """A dataset_info.json naming each world's gold trajectories (the world's own entry, its file path rebased);
    returns the directory and the dataset names, in the worlds' order."""
    os.makedirs(out_dir, exist_ok=True)
    info = {}
    for w in worlds:
        with open(os.path.join(w, "sft", "dataset_info.json")) as f:
            entry = json.load(f)["synthetic_sft_train"]
        entry["file_name"] = os.path.relpath(os.path.join(w, "sft", entry["file_name"]), out_dir)
        info[f"gold_{os.path.basename(w)}"] = entry
    with open(os.path.join(out_dir, "dataset_info.json"), "w") as f:
        json.dump(info, f, indent=2)
    return out_dir, list(info)


def world_text(world_dir: Optional[str], out_path: str, sft_worlds: Sequence[str] = ()) -> None:
    """The tokenizer's training text: every passage and question of the RL world (none: every passage of the SFT
    worlds, as `--make-base` has no RL world), and the gold trajectories of the SFT worlds."""
    import pyarrow.parquet as pq

    with open(out_path, "w", encoding="utf-8") as out:
        for corpus_world in ([world_dir] if world_dir else sft_worlds):
            with open(os.path.join(corpus_world, "corpus.jsonl"), encoding="utf-8") as f:
                for line in f:
                    out.write(json.loads(line)["contents"] + "\n")
        for split in ("train", "validation", "test") if world_dir else ():
            for row in pq.read_table(os.path.join(world_dir, f"{split}.parquet")).to_pylist():
                out.write(row["prompt"][0]["content"] + "\n")
        for w in sft_worlds:
            with open(os.path.join(w, "sft", "train.jsonl"), encoding="utf-8") as f:
                for line in f:
                    for m in json.loads(line)["messages"]:
                        out.write(m["content"] + "\n")


def _read_reports(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _make_worlds(worlds: list[tuple[str, tuple]], work: str, parallel: int = 2) -> None:
    """Build the worlds that are not there yet, `parallel` at a time (each make_world is one process; its
    index build and gold trajectories are single-threaded), each logging to <work>/<name>.log."""
    from concurrent.futures import ThreadPoolExecutor

    todo = [(name, args) for name, args in worlds
            if not os.path.isfile(os.path.join(work, name, "sft", "dataset_info.json"))]

    def build(item):
        name, args = item
        _run([sys.executable, "-m", "megatron_searchr1.data.make_world", "--out-dir", os.path.join(work, name),
              "--template", "short", "--oracle", "bm25", *args], os.path.join(work, f"{name}.log"), quiet=True)
        _log(f"  {name} done")

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        list(pool.map(build, todo))


def _stage(no: int, name: str, what: str, eta_s: Optional[float], of: int = 6) -> None:
    eta = f" (about {eta_s / 60:.1f} min on a free 2-core machine)" if eta_s else ""
    _log(f"stage {no}/{of} {name}: {what}{eta}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="full", choices=sorted(SIZES), help="full: the measured run; ci: a short one")
    p.add_argument("--seed", type=int, default=None,
                   help="the RL world's seed (full: 3, ci: 0); the warm-up's worlds move with it")
    p.add_argument("--work-dir", default=None, help="where every stage writes (default: runs/cpu_demo, with "
                                                    "--make-base runs/cpu_demo_base)")
    p.add_argument("--fresh", action="store_true", help="delete the work dir first instead of continuing")
    p.add_argument("--base", default=None, metavar="DIR|scratch",
                   help="where the warm-up starts: a base model directory (default: the shipped examples/demo_base, "
                        "a tiny Qwen2 and tokenizer that already read search results, built by --make-base on worlds "
                        "no --seed uses) or 'scratch': a tokenizer trained on this seed's worlds and a random model, "
                        "whose warm-up needs ~3,000 steps (~30 min) to read")
    p.add_argument("--make-base", default=None, metavar="DIR",
                   help="instead of the demo, build a base into DIR: the warm-up from scratch on the base's own "
                        f"worlds (seeds {BASE_SEED}+), its HF export and base.json (~40 min at --size full)")
    p.add_argument("--sft-steps", type=int, default=None, help="override the size's SFT steps (the cap)")
    p.add_argument("--grpo-steps", type=int, default=None, help="override the size's GRPO steps")
    p.add_argument("--rl", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for the GRPO stage, after the demo's own (repeatable), e.g. "
                        "--rl algo.llds.coef=0.1 --rl algo.ppo_mini_batch_size=4; a work dir whose GRPO stage ran "
                        "skips it, so use a new --work-dir (the earlier stages can be copied over)")
    a = p.parse_args(argv)
    for flag in ("sft_steps", "grpo_steps"):
        if getattr(a, flag) is not None and getattr(a, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1")
    if a.seed is not None and not 0 <= a.seed < SFT_SEED_OFFSET:
        raise UsageError(f"--seed must be in [0, {SFT_SEED_OFFSET}), got {a.seed}")
    if a.make_base:
        extra = [f for f, v in (("--seed", a.seed), ("--base", a.base), ("--grpo-steps", a.grpo_steps),
                                ("--rl", a.rl)) if v]
        if extra:
            raise UsageError(f"--make-base trains on the base's own worlds and runs no RL: drop {', '.join(extra)}")
    base = None if a.make_base or a.base == "scratch" else os.path.abspath(a.base or BASE_DIR)
    if base:
        check_base(base)
    size = SIZES[a.size]
    size = Size(**{**size.__dict__,
                   **({"sft_steps": a.sft_steps, "scratch_sft_steps": a.sft_steps} if a.sft_steps else {}),
                   **({"grpo_steps": a.grpo_steps} if a.grpo_steps else {}),
                   **({"seed": a.seed} if a.seed is not None else {})})
    check_rl_overrides(size, a.rl)
    work = os.path.abspath(a.work_dir or ("runs/cpu_demo_base" if a.make_base else "runs/cpu_demo"))
    if a.fresh and os.path.isdir(work):
        shutil.rmtree(work)
    os.makedirs(work, exist_ok=True)
    _check_same_run(work, size.seed if not a.make_base else None, base, bool(a.make_base))
    t0 = time.time()
    timings: dict[str, float] = {}
    eta = dict(size.eta_s)
    stages = 3 if a.make_base else 6
    # the warm-up's plan: from the base (a short fine-tune) or from a random model (--base scratch, --make-base)
    n_sft, steps, lr, val_freq = (
        (size.sft_worlds, size.sft_steps, size.sft_lr, size.sft_val_freq) if base else
        (size.scratch_sft_worlds, size.scratch_sft_steps, size.scratch_sft_lr, size.scratch_val_freq))

    # 1. worlds + indexes + gold trajectories
    world = None if a.make_base else os.path.join(work, "world")
    start = time.time()
    sft_seeds, val_seed = base_seeds(n_sft) if a.make_base else world_seeds(size.seed, n_sft)
    worlds = [] if a.make_base else [("world", ("--seed", str(size.seed), *size.world))]
    worlds += [(f"world_sft_{seed}", ("--seed", str(seed), *size.world, "--stop-early", str(size.sft_stop_early)))
               for seed in sft_seeds]
    if size.sft_val:  # single-hop questions only, as many as the validation asks for, and a world that small
        worlds.append((f"world_sftval_{val_seed}", ("--seed", str(val_seed), *size.world, "--hop-fractions", "1,0,0",
                                                    "--n-train", str(size.sft_val), "--n-validation", "1",
                                                    "--n-test", "1")))
    rl_world = "" if a.make_base else f"RL world seed {size.seed}; "
    _stage(1, "world", f"{len(worlds)} synthetic worlds ({rl_world}warm-up worlds {', '.join(map(str, sft_seeds))}"
                       + (f"; warm-up validation {val_seed}" if size.sft_val else "")
                       + "), BM25 indexes, gold trajectories", eta.get("world"), stages)
    _make_worlds(worlds, work)
    sft_worlds = [os.path.join(work, f"world_sft_{seed}") for seed in sft_seeds]
    val_worlds = [os.path.join(work, f"world_sftval_{val_seed}")] if size.sft_val else []
    sft_data, names = _sft_dataset_dir(sft_worlds + val_worlds, os.path.join(work, "sft_data"))
    sft_names, val_names = names[:len(sft_worlds)], names[len(sft_worlds):]
    timings["world"] = time.time() - start

    # 2. the model the warm-up starts from: the shipped base, or a tokenizer + a random tiny model
    model = os.path.join(work, "tiny_model")
    start = time.time()
    if base:
        _stage(2, "model", f"the base model from {base}{_base_summary(base)}", None, stages)
    else:
        _stage(2, "model", f"a BPE tokenizer and a random {size.model_layers}-layer Qwen2", eta.get("model"), stages)
    if not os.path.isfile(os.path.join(model, "model.safetensors")):
        if base:
            shutil.copytree(base, model, dirs_exist_ok=True)
        else:
            from megatron_searchr1.models.tiny import TinyModelConfig, make_tiny_model

            text = os.path.join(work, "world_text.txt")
            world_text(world, text, sft_worlds)
            make_tiny_model(TinyModelConfig(output_dir=model, text_files=[text], num_layers=size.model_layers,
                                            **MODEL_ARGS))
    timings["model"] = time.time() - start

    # 3. SFT warm-up
    sft_dir = os.path.join(work, "sft")
    start = time.time()
    stop = (f", stopping early once it reproduces {size.sft_stop_at:.0%} of {size.sft_val} held-out single-hop "
            "trajectories" if size.sft_stop_at else "")
    _stage(3, "sft", f"the warm-up from {'the base' if base else 'the random model'}, at most {steps} steps of "
                     f"{size.sft_batch}{stop}", eta.get("sft", 0) * steps or None, stages)
    if not os.path.isfile(os.path.join(sft_dir, "hf", "model.safetensors")):
        val_args = ([f"data.val_datasets=[{','.join(val_names)}]", f"trainer.val_freq={val_freq}"]
                    if val_names else [])
        if size.sft_stop_at:
            val_args.append(f"trainer.stop_at_val_exact={size.sft_stop_at}")
        _run(_torchrun("megatron_searchr1.sft", [
            os.path.join(EXAMPLES, "sft_tiny_cpu.yaml"), f"model.path={model}",
            f"data.dataset_dir={sft_data}", f"data.datasets=[{','.join(sft_names)}]",
            f"trainer.output_dir={sft_dir}", f"optim.lr={lr}", "logging.plot=true",
            f"trainer.total_steps={steps}", f"data.batch_size={size.sft_batch}",
            f"data.train_on_prompt={str(size.sft_loss_on_passages).lower()}", *val_args]),
            os.path.join(work, "sft.log"))
    timings["sft"] = time.time() - start
    if a.make_base:
        write_base(sft_dir, os.path.abspath(a.make_base), size=a.size, sft_seeds=sft_seeds, val_seed=val_seed,
                   seconds=time.time() - t0, steps=steps)
        return 0

    # 4. the retrieval server, for the rest of the demo
    from megatron_searchr1.search.launch import ServerProcess

    _stage(4, "server", "the retrieval server over the RL world's BM25 index", None)
    with ServerProcess(["--index-dir", os.path.join(world, "index_bm25"), "--torch-threads", "1"]) as server:
        _log(f"retrieval server up at {server.url}")
        common = [f"model.path={model}", f"retrieval.url={server.url}"]
        val = [f"data.val_files=[{world}/validation.parquet,{world}/test.parquet]",
               f"data.val_max_samples={size.val_samples}"]

        # 5. no-search baseline: the warm-up model must answer in its first turn
        no_search_dir = os.path.join(work, "no_search")
        start = time.time()
        _stage(5, "no_search", "the warm-up model answering without search", eta.get("no_search"))
        if not os.path.isfile(os.path.join(no_search_dir, "val_report.jsonl")):
            _run(_torchrun("megatron_searchr1.train", [
                os.path.join(EXAMPLES, "grpo_tiny_cpu.yaml"), *common, *val, f"model.megatron_ckpt={sft_dir}",
                "trainer.val_only=true", "rollout.max_turns=0", f"trainer.output_dir={no_search_dir}",
                f"data.train_files=[{world}/train.parquet]"]), os.path.join(work, "no_search.log"))
        timings["no_search"] = time.time() - start

        # 6. GRPO with validation before and after, then the HF export
        grpo_dir = os.path.join(work, "grpo")
        start = time.time()
        _stage(6, "grpo", f"{size.grpo_steps} GRPO steps of {size.grpo_batch} prompts x {size.n} samples, "
                          "validation before, during and after", eta.get("grpo", 0) * size.grpo_steps or None)
        if not os.path.isfile(os.path.join(grpo_dir, "hf", "model.safetensors")):
            _run(_torchrun("megatron_searchr1.train", [
                os.path.join(EXAMPLES, "grpo_tiny_cpu.yaml"), *common, *val, f"model.megatron_ckpt={sft_dir}",
                f"data.train_files=[{world}/train.parquet]", f"trainer.output_dir={grpo_dir}",
                *grpo_sizes(size), f"trainer.test_freq={size.grpo_test_freq}", "logging.plot=true", *a.rl]),
                os.path.join(work, "grpo.log"))
        timings["grpo"] = time.time() - start

    report = summarize(work, timings, time.time() - t0, seed=size.seed, base=base or "scratch")
    print(render(report), flush=True)
    return 0


def _base_summary(base: str) -> str:
    """What base.json says of a base, for the model stage's line."""
    path = os.path.join(base, "base.json")
    if not os.path.isfile(path):
        return ""
    with open(path) as f:
        info = json.load(f)
    return (f" ({info['steps']} warm-up steps on worlds {info['sft_worlds'][0]}-{info['sft_worlds'][-1]}; "
            f"reproduced {info['val_exact']:.0%} of world {info['val_world']}'s single-hop trajectories)")


def write_base(sft_dir: str, out: str, size: str, sft_seeds: list[int], val_seed: int, seconds: float,
               steps: int) -> None:
    """Copy the warm-up's HF export and its loss picture into `out` with base.json: the worlds it read, its last
    validation and the command that rebuilds it."""
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(os.path.join(sft_dir, "hf")):
        shutil.copy2(os.path.join(sft_dir, "hf", name), os.path.join(out, name))
    if os.path.isfile(os.path.join(sft_dir, "training_loss.png")):  # how the base learned to read, to look at
        shutil.copy2(os.path.join(sft_dir, "training_loss.png"), os.path.join(out, "training_loss.png"))
    done = _sft_steps(sft_dir)
    info = {"built_by": f"python -m megatron_searchr1.demo --size {size} --make-base <DIR> --sft-steps {steps}",
            "sft_worlds": sft_seeds, "val_world": val_seed, "steps": done["steps"],
            "val_exact": done.get("val_exact"), "seconds": round(seconds)}
    with open(os.path.join(out, "base.json"), "w") as f:
        json.dump(info, f, indent=2)
        f.write("\n")
    _log(f"base written to {out}{_base_summary(out)}")


def grpo_sizes(size: Size) -> list[str]:
    """The GRPO stage's size overrides: its command and the --rl check use the same ones."""
    return [f"trainer.total_steps={size.grpo_steps}", f"optim.lr={size.grpo_lr}",
            f"data.train_batch_size={size.grpo_batch}",
            f"algo.ppo_mini_batch_size={size.grpo_batch}", f"rollout.n={size.n}"]


def check_rl_overrides(size: Size, overrides: Sequence[str]) -> None:
    """Raise UsageError unless the GRPO stage's config with `overrides` (the --rl flags) is valid: checked before
    any stage runs, not minutes later inside torchrun (the config layer imports no torch)."""
    if not overrides:
        return
    from megatron_searchr1.config import ConfigError, load_config

    try:
        load_config(os.path.join(EXAMPLES, "grpo_tiny_cpu.yaml"), [*grpo_sizes(size), *overrides]
                    ).validate(world_size=2, check_files=False)
    except (ConfigError, ValueError) as e:
        raise UsageError(f"--rl: {e}") from None


def _check_same_run(work: str, seed: Optional[int], base: Optional[str], make_base: bool) -> None:
    """A work dir belongs to one seed and one base: continuing it under others would mix two runs' stages."""
    path = os.path.join(work, "seed.json")
    run = {"seed": seed, "base": base or ("make-base" if make_base else "scratch")}
    if os.path.isfile(path):
        with open(path) as f:
            had = json.load(f)
        if (had.get("base") == "make-base") != make_base:  # a base build and a demo run never share a work dir
            what = "a --make-base build" if make_base else "a demo run"
            raise UsageError(f"{work} holds {'a demo run' if make_base else 'a --make-base build'}, not {what}: "
                             "--fresh to start over, or another --work-dir")
        if had["seed"] != seed:
            raise UsageError(f"{work} holds a run of seed {had['seed']}: pass --seed {had['seed']} to continue it, "
                             "--fresh to start over, or another --work-dir")
        if had.get("base", run["base"]) != run["base"]:
            again = "--make-base" if had["base"] == "make-base" else f"--base {had['base']}"
            raise UsageError(f"{work} holds a run from base {had['base']}: pass {again} to continue it, --fresh to "
                             "start over, or another --work-dir")
    else:
        with open(path, "w") as f:
            json.dump(run, f)


def _cells(table: dict) -> dict:
    return {k: {"n": v["n"], "em": v["em"], "searches": v["searches"]} for k, v in table.items()}


def summarize(work: str, timings: dict, total: float, seed: Optional[int] = None,
              base: Optional[str] = None) -> dict:
    """Before/after/no-search EM per split and hop count, sample trajectories, paths; written to report.json."""
    grpo = _read_reports(os.path.join(work, "grpo", "val_report.jsonl"))
    no_search = _read_reports(os.path.join(work, "no_search", "val_report.jsonl"))
    samples = _read_reports(os.path.join(work, "grpo", "val_trajectories.jsonl"))
    last_step = grpo[-1]["step"]
    pictures = [os.path.join(work, d, f) for d, f in (("sft", "training_loss.png"), ("grpo", "training_reward.png"),
                                                       ("grpo", "validation_em.png"))]
    report = {
        "seed": seed, "base": base, "sft_steps": _sft_steps(os.path.join(work, "sft")),
        "pictures": [p for p in pictures if os.path.isfile(p)],
        "no_search": _cells(no_search[-1]["table"]), "before_rl": _cells(grpo[0]["table"]),
        "after_rl": _cells(grpo[-1]["table"]), "rl_steps": last_step,
        "em_by_rl_step": [[r["step"], r["table"]["all"]["em"]] for r in grpo],
        "samples": [s for s in samples if s["step"] == last_step][:3],
        "tensorboard": [os.path.join(work, d, "tensorboard") for d in ("sft", "grpo")],
        "hf_model": os.path.join(work, "grpo", "hf"), "timings_s": timings, "total_s": total, "work_dir": work,
    }
    with open(os.path.join(work, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    return report


def _sft_steps(sft_dir: str) -> dict:
    """The warm-up's last step, and its last validation (a stopped-early run: the one that stopped it)."""
    from megatron_searchr1.plots import read_metrics

    m = read_metrics(sft_dir)
    out = {"steps": m["sft/loss"][-1][0] if m.get("sft/loss") else None}
    if m.get("val/exact"):
        out["val_exact"] = m["val/exact"][-1][1]
    return out


def render(report: dict) -> str:
    rows = [k for k in report["after_rl"] if k.startswith("split:")] + sorted(
        k for k in report["after_rl"] if k.startswith("synthetic"))
    sft = report.get("sft_steps", {})
    start = report.get("base")
    start = "" if not start else (" from scratch" if start == "scratch" else f" from {os.path.basename(start)}")
    read = f" (held-out single-hop trajectories reproduced: {sft['val_exact']:.3f})" if "val_exact" in sft else ""
    warm = f"{sft['steps']} warm-up steps{start}{read}, " if sft.get("steps") else ""
    lines = ["", f"CPU demo, world seed {report.get('seed')}: exact match (EM) and mean searches, after {warm}"
                 f"before and after {report['rl_steps']} GRPO steps",
             f"{'questions':<22}{'n':>5}{'no search':>11}{'SFT':>8}{'SFT+RL':>8}{'searches':>10}"]
    for k in rows:
        b, s, r = (report[x].get(k, {}) for x in ("no_search", "before_rl", "after_rl"))
        lines.append(f"{k.replace('split:', ''):<22}{r.get('n', 0):>5}{b.get('em', 0):>11.3f}{s.get('em', 0):>8.3f}"
                     f"{r.get('em', 0):>8.3f}{s.get('searches', 0):>5.2f}->{r.get('searches', 0):.2f}")
    if len(report["em_by_rl_step"]) > 2:
        lines.append("EM (all questions) by GRPO step: "
                     + ", ".join(f"{step}: {em:.3f}" for step, em in report["em_by_rl_step"]))
    for i, sample in enumerate(report["samples"], 1):
        lines += ["", f"--- validation trajectory {i}: {sample['question']} (gold: {', '.join(sample['target'])}; "
                      f"reward {sample['score']:.0f}, {sample['finish']})"]
        lines += [f"  [{kind}] {text.strip()}" for kind, text in sample["turns"]]
    lines += ["", f"TensorBoard: tensorboard --logdir {report['work_dir']}   ({', '.join(report['tensorboard'])})",
              "Pictures: " + (", ".join(report.get("pictures", [])) or "none"),
              f"Exported model (transformers / vLLM): {report['hf_model']}",
              "Stage times: " + ", ".join(f"{k} {v:.0f}s" for k, v in report["timings_s"].items())
              + f"; total {report['total_s'] / 60:.1f} min"]
    return "\n".join(lines)


def cli() -> int:
    """Console-script entry: user mistakes become one `error:` line and exit code 2."""
    return run_main(main)


if __name__ == "__main__":
    sys.exit(cli())
