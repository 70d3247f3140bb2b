"""The CPU demo, one command: a tiny model learns to search a fictional world, and RL measurably helps.

    bash examples/cpu_demo.sh                                  # = python -m megatron_searchr1.demo --size full
    bash examples/cpu_demo.sh --seed 1 --work-dir runs/cpu_demo_1      # another world (the warm-up's move with it)
    python -m megatron_searchr1.demo --size ci --work-dir /tmp/demo     # the reduced run CI executes
    python -m megatron_searchr1.demo --make-base examples/demo_base     # rebuild the shipped base (~40 min)
    bash examples/cpu_demo.sh --protocol tool_calls --seed 1 --work-dir runs/cpu_demo_tc_1   # JSON tool calls

`--protocol` (default search_r1, Search-R1's tags) says how the policy calls the search engine in every stage:
tool_calls writes the worlds' prompts and gold trajectories in the tool-calling format (LLaMA-Factory tool data),
gives the model's tokenizer a chat template with tool calling (`demo_sizes.TOOL_TEMPLATE`, Qwen2.5's layout), and
rolls out with rollout.protocol=tool_calls and the `search` tool (`demo_sizes.protocol_overrides`); the base is the
same, the warm-up teaches it the format.

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

Every flag is checked before any stage runs (the `--rl` overrides as `train` checks its config, the files they name
included): a mistake is one `error:` line and exit code 2. A stage that fails stops the demo with its log's last
lines and one `error:` line naming the stage, its exit code (the demo's own) and its log.
The sizes, seeds and the shipped base: demo_sizes.py; the final table: demo_report.py.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

from megatron_searchr1.cli import ArgumentParser, UsageError, run_main, stderr_line
from megatron_searchr1.demo_report import base_summary, render, sft_result, summarize
from megatron_searchr1.demo_sizes import (
    BASE_DIR, BASE_SEED, EXAMPLES, MODEL_ARGS, PROTOCOLS, SFT_SEED_OFFSET, SIZES, TOOL_TEMPLATE, Size, base_seeds,
    check_base, protocol_overrides, sft_protocol_overrides, world_seeds,
)

GRPO_YAML = os.path.join(EXAMPLES, "grpo_tiny_cpu.yaml")
DEMO_OWNED = {
    "model.path": "the warm-up's model: pass --base DIR for another start",
    "model.megatron_ckpt": "the warm-up's checkpoint: pass --base DIR for another start",
    "trainer.output_dir": "<work dir>/grpo: pass --work-dir",
    "retrieval.url": "the demo's own retrieval server over the RL world's index",
    "rollout.protocol": "pass --protocol (the worlds' data and the warm-up follow it)",
}
"""GRPO-stage fields the demo sets from its own stages; an --rl override of one is refused (what it would break)."""


@dataclass
class Plan:
    """One demo run, resolved from the flags once; each stage reads what it needs from it."""
    size_name: str
    """--size: a SIZES key."""
    size: Size
    """The run's size, with --seed / --sft-steps / --grpo-steps applied."""
    work: str
    """The work dir every stage writes into (absolute)."""
    fresh: bool
    """--fresh: empty the work dir before the first stage."""
    base: Optional[str]
    """The base model directory the warm-up starts from; None: a random model (--base scratch, --make-base)."""
    make_base: Optional[str]
    """--make-base DIR: build a base there (stages 1-3 on the base's own worlds) instead of running the demo."""
    rl: list[str]
    """--rl overrides for the GRPO stage, after the demo's own."""
    sft_seeds: list[int]
    """The warm-up's worlds' seeds (`world_seeds`, or `base_seeds` for --make-base)."""
    val_seed: int
    """The warm-up's validation world's seed."""
    sft_steps: int
    """The warm-up's step cap: from the base `size.sft_steps`, from a random model `size.scratch_sft_steps`."""
    sft_lr: float
    """The warm-up's learning rate (from the base or from a random model)."""
    sft_val_freq: int
    """Validate the warm-up every this many steps."""
    protocol: str = "search_r1"
    """--protocol: how the policy calls the search engine, in every stage's data, warm-up and rollouts: search_r1
    (Search-R1's tags) or tool_calls (the tokenizer's chat template with tool calling, `TOOL_TEMPLATE`)."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds per stage, for the report."""
    started: float = field(default_factory=time.time)

    @property
    def stages(self) -> int:
        return 3 if self.make_base else 6

    @property
    def world(self) -> Optional[str]:
        """The RL world's directory (none for --make-base: a base never meets an RL world)."""
        return None if self.make_base else self.path("world")

    @property
    def sft_worlds(self) -> list[str]:
        return [self.path(f"world_sft_{seed}") for seed in self.sft_seeds]

    @property
    def val_worlds(self) -> list[str]:
        return [self.path(f"world_sftval_{self.val_seed}")] if self.size.sft_val else []

    def path(self, *parts: str) -> str:
        return os.path.join(self.work, *parts)

    def eta(self, stage: str, times: float = 1.0) -> Optional[float]:
        """The stage's expected seconds (`Size.eta_s`, per step where `times` is the steps), None if unknown."""
        return dict(self.size.eta_s).get(stage, 0.0) * times or None

    @contextmanager
    def stage(self, no: int, name: str, what: str, eta_s: Optional[float] = None) -> Iterator[None]:
        """Announce stage `no` with its expected time, and time it."""
        eta = f" (about {eta_s / 60:.1f} min on a free 2-core machine)" if eta_s else ""
        _log(f"stage {no}/{self.stages} {name}: {what}{eta}")
        start = time.time()
        yield
        self.timings[name] = time.time() - start


def main(argv: Optional[Sequence[str]] = None) -> int:
    plan = parse_args(argv)  # every flag checked, --rl as `train` checks its config: nothing has run yet
    prepare_work_dir(plan)
    try:
        run(plan)
    except StageFailed as failed:  # its log's last lines and one error line, not a traceback of the demo's own
        return failed.report()
    return 0


def run(plan: Plan) -> None:
    """The stages in order; each is skipped when its output exists, so an interrupted demo continues."""
    warm_up_data = stage_worlds(plan)
    model = stage_model(plan)
    sft_dir = stage_sft(plan, model, warm_up_data)
    if plan.make_base:
        write_base(sft_dir, os.path.abspath(plan.make_base), size=plan.size_name, sft_seeds=plan.sft_seeds,
                   val_seed=plan.val_seed, seconds=time.time() - plan.started, steps=plan.sft_steps,
                   protocol=plan.protocol)
        return
    with stage_server(plan) as url:
        stage_no_search(plan, model, sft_dir, url)
        stage_grpo(plan, model, sft_dir, url)
    report = summarize(plan.work, plan.timings, time.time() - plan.started, seed=plan.size.seed,
                       base=plan.base or "scratch", protocol=plan.protocol)
    print(render(report), flush=True)


# ---------------------------------------------------------------------------------------------------------------
# The stages
# ---------------------------------------------------------------------------------------------------------------
def stage_worlds(plan: Plan) -> tuple[str, list[str], list[str]]:
    """1. The RL world, the warm-up's worlds and its validation world (two at a time), with their BM25 indexes and
    gold trajectories; returns the warm-up's dataset dir and its training and validation dataset names."""
    size = plan.size
    worlds = [] if plan.make_base else [("world", ("--seed", str(size.seed), *size.world))]
    worlds += [(f"world_sft_{seed}", ("--seed", str(seed), *size.world, "--stop-early", str(size.sft_stop_early)))
               for seed in plan.sft_seeds]
    if size.sft_val:  # single-hop questions only, as many as the validation asks for, and a world that small
        worlds.append((f"world_sftval_{plan.val_seed}", ("--seed", str(plan.val_seed), *size.world, "--hop-fractions",
                                                         "1,0,0", "--n-train", str(size.sft_val), "--n-validation",
                                                         "1", "--n-test", "1")))
    rl_world = "" if plan.make_base else f"RL world seed {size.seed}; "
    what = (f"{len(worlds)} synthetic worlds ({rl_world}warm-up worlds {', '.join(map(str, plan.sft_seeds))}"
            + (f"; warm-up validation {plan.val_seed}" if size.sft_val else "") + "), BM25 indexes, gold trajectories")
    if plan.protocol != "search_r1":  # the prompts and the gold trajectories in the protocol's format
        worlds = [(name, (*args, "--protocol", plan.protocol)) for name, args in worlds]
        what += f" in the {plan.protocol} protocol"
    with plan.stage(1, "world", what, plan.eta("world")):
        _make_worlds(worlds, plan.work)
        sft_data, names = _sft_dataset_dir(plan.sft_worlds + plan.val_worlds, plan.path("sft_data"))
    n = len(plan.sft_worlds)
    return sft_data, names[:n], names[n:]


def stage_model(plan: Plan) -> str:
    """2. The model the warm-up starts from: the base, copied; or a BPE tokenizer trained on the worlds' text and a
    random tiny Qwen2. Returns its directory."""
    model = plan.path("tiny_model")
    if plan.base:
        what, eta = f"the base model from {plan.base}{base_summary(plan.base)}", None
    else:
        what, eta = f"a BPE tokenizer and a random {plan.size.model_layers}-layer Qwen2", plan.eta("model")
    if plan.protocol == "tool_calls":
        what += f", its tokenizer given the chat template with tool calling {os.path.relpath(TOOL_TEMPLATE)}"
    with plan.stage(2, "model", what, eta):
        if not os.path.isfile(os.path.join(model, "model.safetensors")):
            if plan.base:
                shutil.copytree(plan.base, model, dirs_exist_ok=True)
            else:
                from megatron_searchr1.models.tiny import TinyModelConfig, make_tiny_model

                text = plan.path("world_text.txt")
                world_text(plan.world, text, plan.sft_worlds)
                make_tiny_model(TinyModelConfig(output_dir=model, text_files=[text],
                                                num_layers=plan.size.model_layers, **MODEL_ARGS))
        if plan.protocol == "tool_calls":
            set_chat_template(model, TOOL_TEMPLATE)
    return model


def set_chat_template(model: str, template: str) -> None:
    """Give the tokenizer in `model` the chat template in file `template` (chat_template.jinja, which transformers
    reads; a `chat_template` in tokenizer_config.json would take precedence, so it is dropped). The vocabulary stays
    as it is: the tool-calling text is plain text to a byte-level BPE."""
    cfg_path = os.path.join(model, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if cfg.pop("chat_template", None) is not None:
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2)
    shutil.copyfile(template, os.path.join(model, "chat_template.jinja"))


def stage_sft(plan: Plan, model: str, warm_up_data: tuple[str, list[str], list[str]]) -> str:
    """3. The supervised warm-up on Megatron (torchrun, DP=2), validated on the held-out single-hop trajectories and
    stopped once it reads them (`Size.sft_stop_at`); returns its output dir (checkpoint and HF export)."""
    size, sft_dir = plan.size, plan.path("sft")
    sft_data, sft_names, val_names = warm_up_data
    stop = (f", stopping early once it reproduces {size.sft_stop_at:.0%} of {size.sft_val} held-out single-hop "
            "trajectories" if size.sft_stop_at else "")
    what = (f"the warm-up from {'the base' if plan.base else 'the random model'}, at most {plan.sft_steps} steps of "
            f"{size.sft_batch}{stop}")
    with plan.stage(3, "sft", what, plan.eta("sft", plan.sft_steps)):
        if os.path.isfile(os.path.join(sft_dir, "hf", "model.safetensors")):
            return sft_dir
        val_args = ([f"data.val_datasets=[{','.join(val_names)}]", f"trainer.val_freq={plan.sft_val_freq}"]
                    if val_names else [])
        if size.sft_stop_at:
            val_args.append(f"trainer.stop_at_val_exact={size.sft_stop_at}")
        _run("sft", _torchrun("megatron_searchr1.sft", [
            os.path.join(EXAMPLES, "sft_tiny_cpu.yaml"), f"model.path={model}",
            f"data.dataset_dir={sft_data}", f"data.datasets=[{','.join(sft_names)}]",
            f"trainer.output_dir={sft_dir}", f"optim.lr={plan.sft_lr}", "logging.plot=true",
            f"trainer.total_steps={plan.sft_steps}", f"data.batch_size={size.sft_batch}",
            *sft_protocol_overrides(plan.protocol),
            f"data.train_on_prompt={str(size.sft_loss_on_passages).lower()}", *val_args]), plan.path("sft.log"))
    return sft_dir


@contextmanager
def stage_server(plan: Plan) -> Iterator[str]:
    """4. The retrieval server over the RL world's BM25 index, for the stages after it; yields its URL and stops it
    when they are done (or fail)."""
    from megatron_searchr1.search.launch import ServerProcess

    with plan.stage(4, "server", "the retrieval server over the RL world's BM25 index"):
        server = ServerProcess(["--index-dir", os.path.join(plan.world, "index_bm25"), "--torch-threads", "1"])
        try:
            server.start()
        except RuntimeError as e:  # its output is in the message: kept as the stage's log
            log = plan.path("server.log")
            with open(log, "w") as f:
                f.write(f"{e}\n")
            raise StageFailed("server", server.proc.returncode if server.proc else 1, log) from None
        _log(f"retrieval server up at {server.url}")
    try:
        yield server.url
    finally:
        server.stop()


def stage_no_search(plan: Plan, model: str, sft_dir: str, url: str) -> None:
    """5. The warm-up model answering without search (rollout.max_turns=0) on the questions RL is evaluated on."""
    out = plan.path("no_search")
    with plan.stage(5, "no_search", "the warm-up model answering without search", plan.eta("no_search")):
        if os.path.isfile(os.path.join(out, "val_report.jsonl")):
            return
        _run("no_search", _torchrun("megatron_searchr1.train", [
            GRPO_YAML, *_rl_common(plan, model, sft_dir, url), "trainer.val_only=true", "rollout.max_turns=0",
            f"trainer.output_dir={out}"]), plan.path("no_search.log"))


def stage_grpo(plan: Plan, model: str, sft_dir: str, url: str) -> None:
    """6. GRPO on Megatron (torchrun, TP=2) with vLLM rollouts, validated before, every `grpo_test_freq` steps and
    after, then the HF export; the --rl overrides come last."""
    size, out = plan.size, plan.path("grpo")
    what = f"{size.grpo_steps} GRPO steps of {size.grpo_batch} prompts x {size.n} samples, validation before, " \
           "during and after"
    with plan.stage(6, "grpo", what, plan.eta("grpo", size.grpo_steps)):
        if os.path.isfile(os.path.join(out, "hf", "model.safetensors")):
            return
        _run("grpo", _torchrun("megatron_searchr1.train", [
            GRPO_YAML, *_rl_common(plan, model, sft_dir, url), f"trainer.output_dir={out}", *grpo_sizes(size),
            f"trainer.test_freq={size.grpo_test_freq}", "logging.plot=true", *plan.rl]), plan.path("grpo.log"))


def _rl_common(plan: Plan, model: str, sft_dir: str, url: str) -> list[str]:
    """What the no-search and GRPO stages share: the warm-up's model, the server, the RL world's questions."""
    world = plan.world
    return [f"model.path={model}", f"retrieval.url={url}", f"model.megatron_ckpt={sft_dir}",
            f"data.train_files=[{world}/train.parquet]",
            f"data.val_files=[{world}/validation.parquet,{world}/test.parquet]",
            f"data.val_max_samples={plan.size.val_samples}", *protocol_overrides(plan.protocol)]


def grpo_sizes(size: Size) -> list[str]:
    """The GRPO stage's size overrides: its command and the --rl check use the same ones."""
    return [f"trainer.total_steps={size.grpo_steps}", f"optim.lr={size.grpo_lr}",
            f"data.train_batch_size={size.grpo_batch}",
            f"algo.ppo_mini_batch_size={size.grpo_batch}", f"rollout.n={size.n}"]


def write_base(sft_dir: str, out: str, size: str, sft_seeds: list[int], val_seed: int, seconds: float,
               steps: int, protocol: str = "search_r1") -> None:
    """Copy the warm-up's HF export and its loss picture into `out` with base.json: the worlds it read, its last
    validation and the command that rebuilds it."""
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(os.path.join(sft_dir, "hf")):
        shutil.copy2(os.path.join(sft_dir, "hf", name), os.path.join(out, name))
    if os.path.isfile(os.path.join(sft_dir, "training_loss.png")):  # how the base learned to read, to look at
        shutil.copy2(os.path.join(sft_dir, "training_loss.png"), os.path.join(out, "training_loss.png"))
    done = sft_result(sft_dir)
    flag = "" if protocol == "search_r1" else f" --protocol {protocol}"
    info = {"built_by": f"python -m megatron_searchr1.demo --size {size} --make-base <DIR> --sft-steps {steps}{flag}",
            **({} if protocol == "search_r1" else {"protocol": protocol}), "sft_worlds": sft_seeds, "val_world": val_seed, "steps": done["steps"],
            "val_exact": done.get("val_exact"), "seconds": round(seconds)}
    with open(os.path.join(out, "base.json"), "w") as f:
        json.dump(info, f, indent=2)
        f.write("\n")
    _log(f"base written to {out}{base_summary(out)}")


# ---------------------------------------------------------------------------------------------------------------
# Running a stage's command; a failed one
# ---------------------------------------------------------------------------------------------------------------
class StageFailed(Exception):
    """A stage's command exited non-zero; `report()` says so in one error line after its log's last lines."""

    TAIL = 30

    def __init__(self, stage: str, code: int, log: str):
        super().__init__(f"stage {stage} failed (exit {code}); its log: {log}")
        self.stage, self.code, self.log = stage, code, log

    def report(self) -> int:
        """Print the log's last lines (indented: they are the stage's, not the demo's) and one `error:` line with
        the stage's reason (its own last `error:` line, else the last exception it printed); returns the demo's exit
        code (the stage's, 128+N for a signal N)."""
        try:
            with open(self.log, errors="replace") as f:
                lines = [line.rstrip("\n") for line in f]
        except OSError:
            lines = []
        if lines:
            sys.stderr.write(f"--- the last lines of {self.log} ---\n"
                             + "".join(f"  | {line}\n" for line in lines[-self.TAIL:]))
        reason = stage_reason(lines)
        stderr_line(f"error: stage {self.stage} failed (exit {self.code}){': ' + reason if reason else ''}; its log: "
                    f"{self.log}")
        return self.code if self.code > 0 else 128 - self.code if self.code < 0 else 1


def stage_reason(lines: list[str]) -> str:
    """Why a stage failed, from its log: its own last `error:` line (our commands' one-line mistakes, a rank's
    prefix dropped), else the last exception line, torchrun's own wrapper excepted.

    >>> stage_reason(["[rank0]: error: data.val_files: x.parquet does not exist", "ChildFailedError: ..."])
    'data.val_files: x.parquet does not exist'
    >>> stage_reason(["Traceback (most recent call last):", "FileExistsError: [Errno 17] File exists: 'w'"])
    "FileExistsError: [Errno 17] File exists: 'w'"
    """
    own = [m[1] for line in lines if (m := re.match(r"^(?:\[[^\]]*\]:?\s*)?error: (.*)", line.strip()))]
    if own:
        return own[-1].strip()
    raised = [line.strip() for line in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b.*:", line.strip())
              and "ChildFailedError" not in line]
    return raised[-1] if raised else ""


def _log(msg: str) -> None:
    print(f"[cpu_demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _run(stage: str, cmd: list[str], log_path: str, env: Optional[dict] = None, quiet: bool = False) -> None:
    """Run a stage's command, its output teed to a log file (`quiet`: to the log file only); a non-zero exit raises
    StageFailed."""
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
        raise StageFailed(stage, rc, log_path)


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


def _make_worlds(worlds: list[tuple[str, tuple]], work: str, parallel: int = 2) -> None:
    """Build the worlds that are not there yet, `parallel` at a time (each make_world is one process; its
    index build and gold trajectories are single-threaded), each logging to <work>/<name>.log."""
    from concurrent.futures import ThreadPoolExecutor

    todo = [(name, args) for name, args in worlds
            if not os.path.isfile(os.path.join(work, name, "sft", "dataset_info.json"))]

    def build(item):
        name, args = item
        _run("world", [sys.executable, "-m", "megatron_searchr1.data.make_world", "--out-dir",
                       os.path.join(work, name), "--template", "short", "--oracle", "bm25", *args],
             os.path.join(work, f"{name}.log"), quiet=True)
        _log(f"  {name} done")

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        futures = [pool.submit(build, item) for item in todo]
        try:
            for future in futures:
                future.result()
        except StageFailed:  # the demo stops: the worlds not started yet never start (a running one finishes)
            for future in futures:
                future.cancel()
            raise


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


# ---------------------------------------------------------------------------------------------------------------
# The command line: every check before any stage runs
# ---------------------------------------------------------------------------------------------------------------
def parse_args(argv: Optional[Sequence[str]]) -> Plan:
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
    p.add_argument("--protocol", default="search_r1", choices=PROTOCOLS,
                   help="how the policy calls the search engine, in the worlds' data, the warm-up and the rollouts: "
                        "Search-R1's tags, or tool calls in the tokenizer's chat template (the base's tokenizer is "
                        "given examples/demo_base_tool_calls.jinja; examples/tool_calls.md)")
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
        check_dir_target(a.make_base, "--make-base")
    base = None if a.make_base or a.base == "scratch" else os.path.abspath(a.base or BASE_DIR)
    if base:
        check_base(base)
    size = SIZES[a.size]
    size = Size(**{**size.__dict__,
                   **({"sft_steps": a.sft_steps, "scratch_sft_steps": a.sft_steps} if a.sft_steps else {}),
                   **({"grpo_steps": a.grpo_steps} if a.grpo_steps else {}),
                   **({"seed": a.seed} if a.seed is not None else {})})
    check_rl_overrides(size, a.rl, a.protocol)
    work = a.work_dir or ("runs/cpu_demo_base" if a.make_base else "runs/cpu_demo")
    check_dir_target(work, "--work-dir")
    # the warm-up's plan: from the base (a short fine-tune) or from a random model (--base scratch, --make-base)
    n_sft, steps, lr, val_freq = (
        (size.sft_worlds, size.sft_steps, size.sft_lr, size.sft_val_freq) if base else
        (size.scratch_sft_worlds, size.scratch_sft_steps, size.scratch_sft_lr, size.scratch_val_freq))
    sft_seeds, val_seed = base_seeds(n_sft) if a.make_base else world_seeds(size.seed, n_sft)
    return Plan(size_name=a.size, size=size, work=os.path.abspath(work), fresh=a.fresh, base=base,
                make_base=a.make_base, rl=list(a.rl), sft_seeds=sft_seeds, val_seed=val_seed, sft_steps=steps,
                sft_lr=lr, sft_val_freq=val_freq, protocol=a.protocol)


def check_dir_target(path: str, flag: str) -> None:
    """Raise UsageError unless `path` is a directory or can be made one: neither it nor a directory above it is a
    file, and the nearest one that exists is writable."""
    target = probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        if probe == target:
            raise UsageError(f"{flag} {path} is a file, not a directory: choose another {flag} (a directory, made "
                             "if missing)")
        raise UsageError(f"{flag} {path}: {probe} is a file, not a directory: choose another {flag}")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: {probe} is not writable: choose another {flag}")


def check_rl_overrides(size: Size, overrides: Sequence[str], protocol: str = "search_r1") -> None:
    """Raise UsageError unless the GRPO stage's config with `overrides` (the --rl flags) is valid, as `train` checks
    its own: the fields and their rules (the config layer imports no torch), and the data files the overrides name
    (the demo's own are written by its stages, so they are not there yet). Checked before any stage runs, not
    minutes later inside torchrun."""
    if not overrides:
        return
    from megatron_searchr1.config import ConfigError, load_config
    from megatron_searchr1.data.rl_data import DataError, check_schema

    keys = [o.split("=", 1)[0].strip() for o in overrides]
    for key in keys:
        if key in DEMO_OWNED:
            raise UsageError(f"--rl {key}: the demo sets it for the GRPO stage ({DEMO_OWNED[key]})")
    try:
        cfg = load_config(GRPO_YAML, [*grpo_sizes(size), *protocol_overrides(protocol), *overrides])
        cfg.validate(world_size=2, check_files=False)
    except (ConfigError, ValueError) as e:
        raise UsageError(f"--rl: {e}") from None
    try:  # what train's check_data reads: each file there, parquet, with Search-R1's columns, rows, a reward
        for key in ("data.train_files", "data.val_files"):
            if key in keys:
                check_schema(list(getattr(cfg.data, key.split(".")[1])), key)
    except DataError as e:
        raise UsageError(f"--rl: {e}") from None


def prepare_work_dir(plan: Plan) -> None:
    """--fresh empties the work dir; a work dir keeps one seed and one base (seed.json)."""
    if plan.fresh and os.path.isdir(plan.work):
        shutil.rmtree(plan.work)
    os.makedirs(plan.work, exist_ok=True)
    _check_same_run(plan.work, None if plan.make_base else plan.size.seed, plan.base, bool(plan.make_base),
                    plan.protocol)


def _check_same_run(work: str, seed: Optional[int], base: Optional[str], make_base: bool,
                    protocol: str = "search_r1") -> None:
    """A work dir belongs to one seed, one base and one protocol: continuing it under others would mix two runs'
    stages (a seed.json without a protocol is Search-R1's, written before there were two)."""
    path = os.path.join(work, "seed.json")
    run = {"seed": seed, "base": base or ("make-base" if make_base else "scratch")}
    if protocol != "search_r1":
        run["protocol"] = protocol
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
        if had.get("protocol", "search_r1") != protocol:
            raise UsageError(f"{work} holds a run in the {had.get('protocol', 'search_r1')} protocol: pass --protocol "
                             f"{had.get('protocol', 'search_r1')} to continue it, --fresh to start over, or another "
                             "--work-dir")
    else:
        with open(path, "w") as f:
            json.dump(run, f)


def cli() -> int:
    """Console-script entry: user mistakes become one `error:` line and exit code 2."""
    return run_main(main)


if __name__ == "__main__":
    sys.exit(cli())
