"""The CPU demo, one command: a tiny model learns to search a fictional world, and RL measurably helps.

    bash examples/cpu_demo.sh                                  # = python -m megatron_searchr1.demo --size full
    python -m megatron_searchr1.demo --size ci --work-dir /tmp/demo     # the reduced run CI executes

Stages (each skipped when its output exists, so an interrupted demo continues; --fresh starts over):
  1. world      the RL world: a synthetic world (fictional entities: no model can know the answers) and its BM25
                index; GRPO trains on its train questions, every evaluation asks its validation/test questions.
                The warm-up's data are trajectories (written with the real retriever by a lazy demonstrator that
                often answers a guess instead of searching again: `Size.sft_stop_early`) of other worlds
                (`Size.sft_world_seeds`), so RL and evaluation only meet entities the warm-up never saw;
  2. model      a BPE tokenizer trained on the worlds' text and a random tiny Qwen2 (models/tiny.py);
  3. server     the retrieval server over the BM25 index, started here and stopped at the end;
  4. sft        the supervised warm-up on Megatron (torchrun, 2 processes, data-parallel: megatron_searchr1/sft.py);
  5. baseline   the warm-up model answering without search (rollout.max_turns=0) on the same questions;
  6. grpo       GRPO on Megatron (torchrun, 2 processes, TP=2) with vLLM rollouts fed by the weight sync,
                validation before and after (megatron_searchr1/train.py), and the HF export.
At the end: EM per split and hop count before/after RL and without search, mean searches, three validation
trajectories turn by turn, where the TensorBoard logs are, and the exported model's path (also report.json).
"""
from __future__ import annotations

import json
import os
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
    """make_synthetic_world.py arguments."""
    sft_steps: int
    """SFT warm-up optimizer steps."""
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
    sft_world_seeds: tuple[int, ...] = ()
    """Seeds of the worlds (same sizes as the RL world) whose gold trajectories are the SFT data. Several worlds:
    more distinct names, so the warm-up learns to copy and read names rather than memorise a few thousand
    trajectories over many epochs. None is the RL world: RL on questions the warm-up had memorised re-samples
    memorised answers, while held-out questions need reading (examples/cpu_demo_sizes.md)."""
    sft_stop_early: float = 0.0
    """The SFT worlds' lazy demonstrator (make_world --stop-early): at each point where a multi-hop chain needs
    another search, its trajectory answers a guess instead with this probability. Above 0.5 the warm-up's greedy
    policy gives up after the first search on multi-hop questions, and RL has to learn from the reward that
    searching again pays; on perfect chains little is left for RL to learn (examples/cpu_demo_sizes.md)."""


SIZES = {
    # every stage runs for real at toy length (CI).
    "ci": Size(world=("--seed", "0"), sft_steps=40, sft_batch=16, grpo_steps=3, grpo_batch=4, n=4, val_samples=32,
               sft_world_seeds=(1,), grpo_test_freq=2, sft_stop_early=0.6),
    # The README's run (examples/cpu_demo.md): a diverse world so the warm-up learns to copy unseen names into
    # queries; as short as the effect allows (the runs that chose these lengths: examples/cpu_demo_sizes.md).
    "full": Size(world=("--seed", "3", "--n-people", "8000", "--n-companies", "2500", "--n-cities", "1500",
                        "--n-products", "2500", "--n-universities", "800", "--n-distractors", "3000",
                        "--n-train", "6000", "--n-validation", "300", "--n-test", "300"),
                 sft_steps=1500, sft_batch=16, grpo_steps=50, grpo_batch=8, n=8, val_samples=300,
                 sft_world_seeds=(4, 5, 6, 7), grpo_test_freq=25, sft_stop_early=0.6),
}
MODEL_ARGS = dict(hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2,
                  tie_embeddings=True, vocab_size=2000)


def _log(msg: str) -> None:
    print(f"[cpu_demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _run(cmd: list[str], log_path: str, env: Optional[dict] = None) -> None:
    """Run a stage's command, its output teed to a log file; a failure shows the log's tail and stops the demo."""
    _log(" ".join(cmd) + f"   (log: {log_path})")
    full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **(env or {})}
    bar_open = False  # a progress bar redraws one terminal line ("\r"); anything else starts a new line
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env)
        for line in proc.stdout:  # universal newlines: tqdm's "\r" redraws arrive as lines too
            log.write(line)
            if not _worth_showing(line):
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
    """Progress bars, tables and our own messages; not the libraries' INFO/warning noise."""
    noise = ("INFO", "WARNING", "warnings.warn", "UserWarning", "W1", "I1", "[W", "return func", "*****",
             "Setting OMP_NUM_THREADS")
    return not any(n in line for n in noise)


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


def world_text(world_dir: str, out_path: str, sft_worlds: Sequence[str] = ()) -> None:
    """The tokenizer's training text: every passage and question of the RL world, and the gold trajectories of
    the SFT worlds."""
    import pyarrow.parquet as pq

    with open(out_path, "w", encoding="utf-8") as out:
        with open(os.path.join(world_dir, "corpus.jsonl"), encoding="utf-8") as f:
            for line in f:
                out.write(json.loads(line)["contents"] + "\n")
        for split in ("train", "validation", "test"):
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="full", choices=sorted(SIZES), help="full: the measured run; ci: a short one")
    p.add_argument("--work-dir", default="runs/cpu_demo", help="where every stage writes")
    p.add_argument("--fresh", action="store_true", help="delete the work dir first instead of continuing")
    p.add_argument("--sft-steps", type=int, default=None, help="override the size's SFT steps")
    p.add_argument("--grpo-steps", type=int, default=None, help="override the size's GRPO steps")
    a = p.parse_args(argv)
    for flag in ("sft_steps", "grpo_steps"):
        if getattr(a, flag) is not None and getattr(a, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1")
    size = SIZES[a.size]
    size = Size(**{**size.__dict__, **({"sft_steps": a.sft_steps} if a.sft_steps else {}),
                   **({"grpo_steps": a.grpo_steps} if a.grpo_steps else {})})
    work = os.path.abspath(a.work_dir)
    if a.fresh and os.path.isdir(work):
        shutil.rmtree(work)
    os.makedirs(work, exist_ok=True)
    t0 = time.time()
    timings: dict[str, float] = {}
    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")

    # 1. world + index + gold trajectories
    world = os.path.join(work, "world")
    start = time.time()
    worlds = [("world", size.world)]  # the SFT worlds: the same sizes under another seed
    for seed in size.sft_world_seeds:
        args = list(size.world)
        args[args.index("--seed") + 1] = str(seed)
        worlds.append((f"world_sft_{seed}", (*args, "--stop-early", str(size.sft_stop_early))))
    for name, args in worlds:
        out = os.path.join(work, name)
        if not os.path.isfile(os.path.join(out, "sft", "dataset_info.json")):
            _run([sys.executable, "-m", "megatron_searchr1.data.make_world", "--out-dir", out, "--template", "short",
                  "--oracle", "bm25", *args], os.path.join(work, f"{name}.log"))
    sft_worlds = [os.path.join(work, name) for name, _ in worlds[1:]]
    sft_data, sft_names = _sft_dataset_dir(sft_worlds, os.path.join(work, "sft_data"))
    timings["world"] = time.time() - start

    # 2. tokenizer + tiny model
    model = os.path.join(work, "tiny_model")
    start = time.time()
    if not os.path.isfile(os.path.join(model, "model.safetensors")):
        from megatron_searchr1.models.tiny import TinyModelConfig, make_tiny_model

        text = os.path.join(work, "world_text.txt")
        world_text(world, text, sft_worlds)
        _log("training the tokenizer on the world's text and writing a random tiny Qwen2")
        make_tiny_model(TinyModelConfig(output_dir=model, text_files=[text], **MODEL_ARGS))
    timings["model"] = time.time() - start

    # 3. the retrieval server, for the whole demo
    from megatron_searchr1.search.launch import ServerProcess

    with ServerProcess(["--index-dir", os.path.join(world, "index_bm25"), "--torch-threads", "1"]) as server:
        _log(f"retrieval server up at {server.url}")
        common = [f"model.path={model}", f"retrieval.url={server.url}"]
        val = [f"data.val_files=[{world}/validation.parquet,{world}/test.parquet]",
               f"data.val_max_samples={size.val_samples}"]

        # 4. SFT warm-up
        sft_dir = os.path.join(work, "sft")
        start = time.time()
        if not os.path.isfile(os.path.join(sft_dir, "hf", "model.safetensors")):
            _run(_torchrun("megatron_searchr1.sft", [
                os.path.join(examples, "sft_tiny_cpu.yaml"), f"model.path={model}",
                f"data.dataset_dir={sft_data}", f"data.datasets=[{','.join(sft_names)}]",
                f"trainer.output_dir={sft_dir}",
                f"trainer.total_steps={size.sft_steps}", f"data.batch_size={size.sft_batch}"]),
                os.path.join(work, "sft.log"))
        timings["sft"] = time.time() - start

        # 5. no-search baseline: the warm-up model must answer in its first turn
        base_dir = os.path.join(work, "no_search")
        start = time.time()
        if not os.path.isfile(os.path.join(base_dir, "val_report.jsonl")):
            _run(_torchrun("megatron_searchr1.train", [
                os.path.join(examples, "grpo_tiny_cpu.yaml"), *common, *val, f"model.megatron_ckpt={sft_dir}",
                "trainer.val_only=true", "rollout.max_turns=0", f"trainer.output_dir={base_dir}",
                f"data.train_files=[{world}/train.parquet]"]), os.path.join(work, "no_search.log"))
        timings["no_search"] = time.time() - start

        # 6. GRPO with validation before and after, then the HF export
        grpo_dir = os.path.join(work, "grpo")
        start = time.time()
        if not os.path.isfile(os.path.join(grpo_dir, "hf", "model.safetensors")):
            _run(_torchrun("megatron_searchr1.train", [
                os.path.join(examples, "grpo_tiny_cpu.yaml"), *common, *val, f"model.megatron_ckpt={sft_dir}",
                f"data.train_files=[{world}/train.parquet]", f"trainer.output_dir={grpo_dir}",
                f"trainer.total_steps={size.grpo_steps}", f"data.train_batch_size={size.grpo_batch}",
                f"algo.ppo_mini_batch_size={size.grpo_batch}", f"rollout.n={size.n}",
                f"trainer.test_freq={size.grpo_test_freq}"]),
                os.path.join(work, "grpo.log"))
        timings["grpo"] = time.time() - start

    report = summarize(work, timings, time.time() - t0)
    print(render(report), flush=True)
    return 0


def _cells(table: dict) -> dict:
    return {k: {"n": v["n"], "em": v["em"], "searches": v["searches"]} for k, v in table.items()}


def summarize(work: str, timings: dict, total: float) -> dict:
    """Before/after/no-search EM per split and hop count, sample trajectories, paths; written to report.json."""
    grpo = _read_reports(os.path.join(work, "grpo", "val_report.jsonl"))
    base = _read_reports(os.path.join(work, "no_search", "val_report.jsonl"))
    samples = _read_reports(os.path.join(work, "grpo", "val_trajectories.jsonl"))
    last_step = grpo[-1]["step"]
    report = {
        "no_search": _cells(base[-1]["table"]), "before_rl": _cells(grpo[0]["table"]),
        "after_rl": _cells(grpo[-1]["table"]), "rl_steps": last_step,
        "em_by_rl_step": [[r["step"], r["table"]["all"]["em"]] for r in grpo],
        "samples": [s for s in samples if s["step"] == last_step][:3],
        "tensorboard": [os.path.join(work, d, "tensorboard") for d in ("sft", "grpo")],
        "hf_model": os.path.join(work, "grpo", "hf"), "timings_s": timings, "total_s": total, "work_dir": work,
    }
    with open(os.path.join(work, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    return report


def render(report: dict) -> str:
    rows = [k for k in report["after_rl"] if k.startswith("split:")] + sorted(
        k for k in report["after_rl"] if k.startswith("synthetic"))
    lines = ["", f"CPU demo: exact match (EM) and mean searches, before and after {report['rl_steps']} GRPO steps",
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
              f"Exported model (transformers / vLLM): {report['hf_model']}",
              "Stage times: " + ", ".join(f"{k} {v:.0f}s" for k, v in report["timings_s"].items())
              + f"; total {report['total_s'] / 60:.1f} min"]
    return "\n".join(lines)


def cli() -> int:
    """Console-script entry: user mistakes become one `error:` line and exit code 2."""
    return run_main(main)


if __name__ == "__main__":
    sys.exit(cli())
