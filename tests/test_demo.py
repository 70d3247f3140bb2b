"""The CPU demo end to end at its CI size: every stage runs for real (world, tokenizer + model, server, Megatron SFT
at DP=2, no-search baseline, GRPO at TP=2 on vLLM, validation, HF export) and leaves what the README promises."""
import json
import os
import subprocess
import sys

import pytest

from tests.dist_utils import REPO

# The CI-sized demo takes ~2 minutes on a free 2-core machine and ~4 on a loaded one; its subprocess gets this
# long, and pytest-timeout (CI passes --timeout=900 to every test) gets a few minutes more for the checks after it.
DEMO_LIMIT_S = 1800


def test_bad_arguments_are_one_error_line():
    proc = subprocess.run([sys.executable, "-m", "megatron_searchr1.demo", "--sft-steps", "0"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: --sft-steps must be >= 1"]
    proc = subprocess.run([sys.executable, "-m", "megatron_searchr1.demo", "--seed", "100000"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: --seed must be in [0, 100000), got 100000"]
    proc = subprocess.run([sys.executable, "-m", "megatron_searchr1.demo", "--make-base", "/tmp/b", "--seed", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --make-base trains on the base's own worlds and runs no RL: drop --seed"]


def test_a_base_that_is_not_one_is_refused_before_anything_runs(tmp_path):
    """--base DIR must hold what --make-base writes; a wrong path is one error line and no work dir."""
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    proc = subprocess.run([sys.executable, "-m", "megatron_searchr1.demo", "--base", str(tmp_path / "half"),
                           "--work-dir", str(tmp_path / "w")], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: --base {tmp_path / 'half'}: no model.safetensors, tokenizer.json, tokenizer_config.json there; pass "
        "a directory --make-base wrote, or 'scratch' for a random model"]
    assert not (tmp_path / "w").exists()


def test_rl_overrides_are_checked_before_any_stage(tmp_path):
    """--rl reaches the GRPO stage's config; a mistake in it is one error line before any stage runs (the demo's
    own sizes count: LLDS needs a second update per step, which the demo's one mini-batch per step does not give)."""
    from megatron_searchr1.cli import UsageError
    from megatron_searchr1.demo import SIZES, check_rl_overrides

    check_rl_overrides(SIZES["full"], ["algo.llds.coef=0.1", "algo.ppo_mini_batch_size=4"])  # valid: no raise
    with pytest.raises(UsageError, match="algo.llds acts from a step's second update on"):
        check_rl_overrides(SIZES["full"], ["algo.llds.coef=0.1"])
    proc = subprocess.run([sys.executable, "-m", "megatron_searchr1.demo", "--rl", "algo.lds.coef=0.1",
                           "--work-dir", str(tmp_path / "w")], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --rl: unknown field algo.lds (did you mean algo.llds?)")
    assert not (tmp_path / "w").exists()


def test_a_work_dir_keeps_its_seed(tmp_path):
    """Continuing a work dir under another --seed would mix two seeds' stages: one error line, nothing run."""
    (tmp_path / "seed.json").write_text('{"seed": 1}')
    proc = subprocess.run([sys.executable, "-m", "megatron_searchr1.demo", "--seed", "2", "--work-dir",
                           str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {tmp_path} holds a run of seed 1: pass --seed 1 to continue it, --fresh to start over, or another "
        "--work-dir"]
    assert sorted(os.listdir(tmp_path)) == ["seed.json"]
    (tmp_path / "seed.json").write_text('{"seed": 3, "base": "scratch"}')  # nor under another base
    proc = subprocess.run([sys.executable, "-m", "megatron_searchr1.demo", "--work-dir", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {tmp_path} holds a run from base scratch: pass --base scratch to continue it, --fresh to start over, "
        "or another --work-dir"]
    assert sorted(os.listdir(tmp_path)) == ["seed.json"]
    proc = subprocess.run([sys.executable, "-m", "megatron_searchr1.demo", "--make-base", str(tmp_path / "b"),
                           "--work-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2  # nor is a demo's work dir a base build's
    assert proc.stderr.strip().splitlines() == [
        f"error: {tmp_path} holds a demo run, not a --make-base build: --fresh to start over, or another --work-dir"]
    assert sorted(os.listdir(tmp_path)) == ["seed.json"]


def test_world_seeds_keep_the_warm_up_off_every_rl_world():
    from megatron_searchr1.demo import SFT_SEED_OFFSET, base_seeds, world_seeds

    used = set()
    for seed in (0, 3, SFT_SEED_OFFSET - 1):
        sft, val = world_seeds(seed, 4)
        assert len(set(sft) | {val}) == 5 and min(sft + [val]) >= SFT_SEED_OFFSET  # never an RL world's seed
        used |= set(sft) | {val, seed}
    base_sft, base_val = base_seeds(4)
    # the shipped base trained on worlds no --seed run uses for anything: above the largest seed any run can use
    assert min(base_sft + [base_val]) > max(SFT_SEED_OFFSET - 1 + 2 * SFT_SEED_OFFSET, *used)
    assert len(set(base_sft) | {base_val}) == 5


def test_the_shipped_base_is_what_the_demo_builds():
    """examples/demo_base is a base --make-base wrote: the demo's model shape and tokenizer, trained on the base's
    own worlds (base.json), and it read at least the share of held-out trajectories the warm-up stops at."""
    from transformers import AutoConfig, AutoTokenizer

    from megatron_searchr1.demo import BASE_DIR, MODEL_ARGS, SIZES, base_seeds, check_base

    check_base(BASE_DIR)
    with open(os.path.join(BASE_DIR, "base.json")) as f:
        info = json.load(f)
    full = SIZES["full"]
    assert (info["sft_worlds"], info["val_world"]) == tuple(base_seeds(full.scratch_sft_worlds))
    assert info["val_exact"] >= full.sft_stop_at  # it reads as well as the warm-up asks before RL
    cfg = AutoConfig.from_pretrained(BASE_DIR)
    tok = AutoTokenizer.from_pretrained(BASE_DIR)
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == (
        "qwen2", MODEL_ARGS["hidden_size"], full.model_layers, MODEL_ARGS["intermediate_size"])
    assert MODEL_ARGS["vocab_size"] <= cfg.vocab_size == len(tok)  # the BPE entries, then the tags
    for tag in ("<search>", "</search>", "<information>", "</information>", "<answer>", "</answer>"):
        assert len(tok(tag, add_special_tokens=False)["input_ids"]) == 1, tag  # the tags are whole tokens


@pytest.mark.slow
@pytest.mark.timeout(DEMO_LIMIT_S + 300)  # a mark overrides the command line's --timeout for this test
def test_ci_sized_demo_runs_every_stage(tmp_path):
    from megatron_searchr1.demo import BASE_DIR, SIZES

    pytest.importorskip("vllm")
    work = tmp_path / "demo"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-m", "megatron_searchr1.demo", "--size", "ci", "--work-dir", str(work)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=DEMO_LIMIT_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "exact match (EM)" in proc.stdout and "Exported model" in proc.stdout

    report = json.loads((work / "report.json").read_text())
    for phase in ("no_search", "before_rl", "after_rl"):
        assert report[phase]["split:validation"]["n"] > 0 and report[phase]["split:test"]["n"] > 0
    ci = SIZES["ci"]
    assert report["rl_steps"] == ci.grpo_steps and len(report["samples"]) == 3
    assert report["base"] == BASE_DIR  # the warm-up started from the shipped base
    assert report["seed"] == 0 and report["sft_steps"]["steps"] == ci.sft_steps and "val_exact" in report["sft_steps"]
    assert [os.path.basename(p) for p in report["pictures"]] == [
        "training_loss.png", "training_reward.png", "validation_em.png"]
    assert all(os.path.getsize(p) > 1000 and p in proc.stdout for p in report["pictures"])  # named in the printout
    assert all(f"stage {i}/6 " in proc.stdout for i in range(1, 7))
    test_steps = list(range(0, ci.grpo_steps, ci.grpo_test_freq)) + [ci.grpo_steps]
    assert [step for step, _ in report["em_by_rl_step"]] == test_steps  # before, every test_freq steps, after
    assert "EM (all questions) by GRPO step: 0: " in proc.stdout

    # RL raised held-out EM on its own world: the warm-up reads single-hop answers and searches once; GRPO teaches
    # it to search again on multi-hop questions (what the full-size runs in the README show, here in 8 steps)
    before, after = report["before_rl"], report["after_rl"]
    assert before["synthetic_1hop"]["em"] >= 0.5, before  # the warm-up reads
    assert after["all"]["em"] >= before["all"]["em"] + 0.05, (before["all"], after["all"])
    multi = ("synthetic_2hop", "synthetic_3hop")
    assert sum(after[k]["em"] for k in multi) > sum(before[k]["em"] for k in multi)
    assert all(after[k]["searches"] > before[k]["searches"] for k in multi)

    from megatron_searchr1.metrics import read_scalars

    grpo = read_scalars(str(work / "grpo" / "tensorboard"))
    assert len(grpo["reward/mean"]) == ci.grpo_steps and "val/all/em" in grpo
    sft = read_scalars(str(work / "sft" / "tensorboard"))
    assert sft["sft/loss"][0][1] < 2.0  # from the base's weights: a random model starts near ln(vocab) ~ 7.6
    assert [step for step, _ in sft["val/loss"]] == [20, 40]  # validated every sft_val_freq steps and at the end

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(report["hf_model"])
    tok = AutoTokenizer.from_pretrained(report["hf_model"])
    out = model(**tok("<search> who", return_tensors="pt"))
    assert out.logits.shape[-1] == len(tok)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_make_base_writes_a_base_the_demo_takes(tmp_path):
    """--make-base end to end at the CI size: the base's own worlds, a tokenizer and random model, the warm-up from
    scratch (torchrun, DP=2), then the HF export and base.json in the directory --base takes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_searchr1.demo import SIZES, base_seeds, check_base

    out = tmp_path / "base"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-m", "megatron_searchr1.demo", "--size", "ci", "--make-base", str(out),
                           "--work-dir", str(tmp_path / "w")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert all(f"stage {i}/3 " in proc.stdout for i in (1, 2, 3)) and "stage 4/" not in proc.stdout
    check_base(str(out))
    info = json.loads((out / "base.json").read_text())
    sft, val = base_seeds(SIZES["ci"].scratch_sft_worlds)
    assert (info["sft_worlds"], info["val_world"], info["steps"]) == (sft, val, SIZES["ci"].scratch_sft_steps)
    assert sorted(p.name for p in (tmp_path / "w").iterdir() if p.is_dir() and p.name.startswith("world")) == sorted(
        [f"world_sft_{s}" for s in sft] + [f"world_sftval_{val}"])  # no RL world: the base never meets one
    assert "--make-base" in info["built_by"] and 0 <= info["val_exact"] <= 1
    assert (out / "training_loss.png").stat().st_size > 1000  # how the base learned, next to it
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model(**tok("<search> who", return_tensors="pt")).logits.shape[-1] == len(tok)


def test_per_test_timeout_outlasts_the_demos_own_limit():
    """pytest-timeout's limit for the demo test must exceed the limit the test gives its subprocess, else a slow
    machine sees a pytest-timeout kill (no output) instead of the demo's own log tail. The subprocess limit is read
    from the test's own `subprocess.run(..., timeout=...)` call, so editing either number alone is caught."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(test_ci_sized_demo_runs_every_stage)))
    limits = [kw.value for node in ast.walk(tree) if isinstance(node, ast.Call)
              and ast.unparse(node.func) == "subprocess.run" for kw in node.keywords if kw.arg == "timeout"]
    assert len(limits) == 1, "the CI demo test must launch the demo with exactly one subprocess.run(timeout=...)"
    subprocess_limit = eval(compile(ast.Expression(limits[0]), "<timeout>", "eval"), globals())
    marks = [m for m in getattr(test_ci_sized_demo_runs_every_stage, "pytestmark", []) if m.name == "timeout"]
    assert marks, "the CI demo test needs a @pytest.mark.timeout"
    assert marks[0].args[0] > subprocess_limit


def _demo(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "megatron_searchr1.demo", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_a_work_dir_that_is_a_file_is_one_error_line(tmp_path):
    """--work-dir (or --make-base) naming a file, or a path below one, is refused before anything runs (it was a
    FileExistsError / NotADirectoryError traceback)."""
    (tmp_path / "f").write_text("x")
    for flag, path, line in (
            ("--work-dir", tmp_path / "f", f"error: --work-dir {tmp_path / 'f'} is a file, not a directory: choose "
                                           "another --work-dir (a directory, made if missing)"),
            ("--work-dir", tmp_path / "f" / "w", f"error: --work-dir {tmp_path / 'f' / 'w'}: {tmp_path / 'f'} is a "
                                                 "file, not a directory: choose another --work-dir"),
            ("--make-base", tmp_path / "f" / "b", f"error: --make-base {tmp_path / 'f' / 'b'}: {tmp_path / 'f'} is a "
                                                  "file, not a directory: choose another --make-base")):
        extra = ["--work-dir", str(tmp_path / "w")] if flag == "--make-base" else []
        proc = _demo(flag, str(path), *extra)
        assert (proc.returncode, proc.stderr.strip().splitlines()) == (2, [line]), proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["f"]


def test_rl_files_are_checked_as_train_checks_them_before_any_stage(tmp_path):
    """A data file an --rl override names is checked before the worlds and the warm-up run (it failed in GRPO's
    torchrun, minutes later); the fields the demo sets from its own stages are refused with what to pass instead."""
    proc = _demo("--rl", f"data.val_files=[{tmp_path / 'missing.parquet'}]", "--work-dir", str(tmp_path / "w"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: --rl: data.val_files: {tmp_path / 'missing.parquet'} does not exist"]
    (tmp_path / "bad.parquet").write_text("not parquet")
    proc = _demo("--rl", f"data.train_files=[{tmp_path / 'bad.parquet'}]", "--work-dir", str(tmp_path / "w"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith(f"error: --rl: data.train_files: {tmp_path / 'bad.parquet'} is not a readable "
                                  "parquet file")
    proc = _demo("--rl", "model.path=/elsewhere", "--work-dir", str(tmp_path / "w"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --rl model.path: the demo sets it for the GRPO stage (the warm-up's model: pass --base DIR for "
        "another start)"]
    assert not (tmp_path / "w").exists()


def test_a_failing_stage_is_its_log_tail_and_one_error_line(tmp_path):
    """A stage whose command fails stops the demo: the log's last lines (indented, the stage's), then one `error:`
    line naming the stage, its exit code, its reason and its log; the demo's exit code is the stage's, and no
    traceback of the demo's own. Forced here by files where the first stage writes its worlds' directories."""
    from megatron_searchr1.demo import SIZES, world_seeds

    work = tmp_path / "w"
    work.mkdir()
    sft, val = world_seeds(SIZES["ci"].seed, SIZES["ci"].sft_worlds)
    for name in ["world", *(f"world_sft_{s}" for s in sft), f"world_sftval_{val}"]:
        (work / name).write_text("a file where a world's directory goes")
    proc = _demo("--size", "ci", "--work-dir", str(work), timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert errors == [f"error: stage world failed (exit 1): FileExistsError: [Errno 17] File exists: "
                      f"'{work / 'world'}'; its log: {work / 'world.log'}"], proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == errors[0]  # the last line a user sees
    log_tail = (work / "world.log").read_text().splitlines()[-3:]
    assert all(f"  | {line}" in proc.stderr.splitlines() for line in log_tail)
    assert not any(line.startswith("Traceback") for line in (proc.stdout + proc.stderr).splitlines())
    assert "stage 2/6" not in proc.stdout  # nothing after the failed stage ran


def test_a_stage_reason_and_exit_code(tmp_path, capsys):
    """The reason is the stage's own `error:` line (a rank's, under torchrun's traceback) or its last exception; a
    stage killed by a signal N makes the demo exit 128+N, as a shell reports it."""
    from megatron_searchr1.demo import StageFailed

    log = tmp_path / "grpo.log"
    log.write_text("step 1/12\n[rank0]: error: data.val_files: x.parquet has no rows\n"
                   "Traceback (most recent call last):\n"
                   "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n")
    assert StageFailed("grpo", 1, str(log)).report() == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == f"error: stage grpo failed (exit 1): data.val_files: x.parquet has no rows; its log: {log}"
    assert err[:-1] == [f"--- the last lines of {log} ---"] + [f"  | {line}" for line in log.read_text().splitlines()]
    assert StageFailed("grpo", -9, str(log)).report() == 137
    assert StageFailed("grpo", 2, str(tmp_path / "none.log")).report() == 2  # a log that is not there: the line only


def _plan_commands(tmp_path, monkeypatch, *flags):
    """Every stage's command of a demo run with `flags`, recorded instead of launched (each stage's outputs faked
    where the next reads them), and the plan: what each stage is given, in seconds."""
    from contextlib import contextmanager

    from megatron_searchr1 import demo

    plan = demo.parse_args(["--work-dir", str(tmp_path / "w"), *flags])
    demo.prepare_work_dir(plan)
    cmds = {}

    def fake_run(stage, cmd, log_path, env=None, quiet=False):
        cmds.setdefault(stage, []).append(cmd)
        if stage == "world":  # what the next stage reads of a world: its SFT data's entry
            out = cmd[cmd.index("--out-dir") + 1]
            os.makedirs(os.path.join(out, "sft"), exist_ok=True)
            with open(os.path.join(out, "sft", "dataset_info.json"), "w") as f:
                json.dump({"synthetic_sft_train": {"file_name": "train.jsonl", "formatting": "sharegpt"}}, f)

    @contextmanager
    def fake_server(p):
        yield "http://127.0.0.1:1"

    monkeypatch.setattr(demo, "_run", fake_run)
    data = demo.stage_worlds(plan)
    model = demo.stage_model(plan)  # for real: the base copied (and its tokenizer given the protocol's template)
    sft_dir = demo.stage_sft(plan, model, data)
    with fake_server(plan) as url:
        demo.stage_no_search(plan, model, sft_dir, url)
        demo.stage_grpo(plan, model, sft_dir, url)
    return plan, model, cmds


def test_the_tool_calls_demo_gives_every_stage_the_protocol(tmp_path, monkeypatch):
    """--protocol tool_calls: the worlds are written in the protocol (prompts and LLaMA-Factory tool data), the
    base's tokenizer gets the tool-calling chat template (and the rollout's protocol accepts it: tools rendered, the
    tool message a clean token delta), the warm-up has room for the longer trajectories, and both RL stages roll
    out in the protocol with the search tool; Search-R1's commands (the default) carry none of it."""
    from transformers import AutoTokenizer

    from megatron_searchr1.config.tools import tool_specs
    from megatron_searchr1.demo_sizes import TOOL_TEMPLATE
    from megatron_searchr1.rollout.protocols import ProtocolSpec, build_protocol

    plan, model, tc = _plan_commands(tmp_path / "tc", monkeypatch, "--protocol", "tool_calls", "--seed", "1")
    _, r1_model, r1 = _plan_commands(tmp_path / "r1", monkeypatch, "--seed", "1")
    assert plan.protocol == "tool_calls" and sorted(tc) == sorted(r1) == ["grpo", "no_search", "sft", "world"]
    assert len(tc["world"]) == 4 and all(c[-2:] == ["--protocol", "tool_calls"] for c in tc["world"])
    same = sorted([o.replace("/tc/", "/r1/") for o in c[:-2]] for c in tc["world"])
    assert same == sorted(r1["world"]) and not any("--protocol" in c for c in r1["world"])
    tool = ["rollout.protocol=tool_calls", "rollout.tool_parser=hermes", "rollout.tools=[search]"]
    for stage in ("no_search", "grpo"):
        (a,), (b,) = tc[stage], r1[stage]
        assert all(o in a for o in tool) and not any(o.startswith("rollout.protocol") for o in b)
        b = [o.replace("/r1/", "/tc/") for o in b]
        extra = [o for o in a if o not in b]
        assert [o for o in a if o not in extra] == b  # the rest is Search-R1's command
        assert all(o.startswith(("rollout.", "data.max_prompt_length=")) for o in extra), extra
    (a,), (b,) = tc["sft"], r1["sft"]
    assert [o for o in a if o not in b and "/tc/" not in o] == ["data.max_length=2048"]

    with open(TOOL_TEMPLATE) as f:
        assert open(os.path.join(model, "chat_template.jinja")).read() == f.read()
    assert not os.path.exists(os.path.join(r1_model, "chat_template.jinja")) or \
        "tool" not in open(os.path.join(r1_model, "chat_template.jinja")).read()  # Search-R1's base as shipped
    tok = AutoTokenizer.from_pretrained(model)
    proto = build_protocol(ProtocolSpec("tool_calls", tools=tool_specs(["search"])), tok)
    prompt = proto.render_prompt([{"role": "user", "content": "Question: who?"}])
    assert '"name": "search"' in prompt and prompt.endswith("<|im_start|>assistant\n")
    assert proto.delta(1, "</tool_call>") == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n",
                                              "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    call = proto.parser.render_call("search", {"query": "the CEO of Quorvin Labs"})
    ids = tok.encode(call, add_special_tokens=False)
    assert tok.decode(ids) == call  # the BPE spells the JSON call exactly, no unknown pieces
    assert proto.parser.parse(tok.decode(ids))[1][0].arguments == {"query": "the CEO of Quorvin Labs"}


def test_a_bad_protocol_is_one_error_line(tmp_path):
    proc = _demo("--protocol", "tools", "--work-dir", str(tmp_path / "w"))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: argument --protocol: invalid choice: 'tools'"), lines
    assert not (tmp_path / "w").exists()
    (tmp_path / "w").mkdir()  # a Search-R1 run's work dir is not continued in the other protocol
    (tmp_path / "w" / "seed.json").write_text(json.dumps({"seed": 3, "base": os.path.abspath(
        os.path.join(REPO, "examples", "demo_base"))}))
    proc = _demo("--protocol", "tool_calls", "--work-dir", str(tmp_path / "w"))
    assert (proc.returncode, proc.stderr.strip().splitlines()) == (2, [
        f"error: {tmp_path / 'w'} holds a run in the search_r1 protocol: pass --protocol search_r1 to continue it, "
        "--fresh to start over, or another --work-dir"])
