"""tools/gpu_smoke.sh and its helper: the whole script end to end as a CPU dry run (how we know it works before a
GPU is lent), and the helper's pieces: the PHASE line, the fallback retriever, the step and round-trip checks."""
import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile

import pytest
import torch

from tests.dist_utils import REPO

_spec = importlib.util.spec_from_file_location("gpu_smoke_helper", REPO / "tools" / "gpu_smoke_helper.py")
helper = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(helper)

PHASE_LINE = re.compile(r"^PHASE (\w+): (pass|fail) \(peak GPU memory (n/a|\d+\.\d\d GiB), (\d+) s\)$", re.MULTILINE)


def _probe_wheel(dest) -> str:
    """A minimal pure-Python wheel of a package nobody has installed (`smoke_probe`)."""
    name = "smoke_probe-0.1-py3-none-any.whl"
    info = "smoke_probe-0.1.dist-info"
    with zipfile.ZipFile(dest / name, "w") as z:
        z.writestr("smoke_probe/__init__.py", "VALUE = 7\n")
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: smoke_probe\nVersion: 0.1\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return name


@pytest.mark.slow
def test_the_dry_run_passes_every_phase_and_installs_only_missing_wheels(tmp_path):
    """Every phase on the CPU: world, retriever, tiny model, SFT, GRPO (hf engine, as on the GPU machine, where
    vLLM is not carried), the conversion round trip."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    probe = _probe_wheel(wheels)
    (wheels / "numpy-0.0.1-py3-none-any.whl").write_bytes(b"not opened: numpy is installed")
    work = tmp_path / "work"
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    logs = tmp_path / "out"  # the device machine's $OUT: logs apart from the work dir's models and checkpoints
    proc = subprocess.run(["bash", "tools/gpu_smoke.sh", "--cpu-dry-run", "--engine", "hf", "--wheels", str(wheels),
                           "--work-dir", str(work), "--log-dir", str(logs), "--timeout-scale", "4", "--budget", "3000"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=2400)
    out = proc.stdout + proc.stderr
    phases = {m.group(1): m.group(2) for m in PHASE_LINE.finditer(proc.stdout)}
    names = ("numerics", "prepare", "sft", "grpo", "resume", "convert", "init", "width")
    assert phases == {name: "pass" for name in names}, out[-6000:]
    assert proc.returncode == 0 and "all phases passed" in proc.stdout
    # the summary holds every PHASE line, in order, written as each phase ended
    summary = (logs / "summary.log").read_text()
    assert [m.group(1) for m in PHASE_LINE.finditer(summary)] == list(names), summary
    assert {p.name for p in logs.glob("*.log")} >= {f"{n}.log" for n in names} | {"server.log"}
    assert not list(work.glob("*.log"))
    # numerics: three models, each asserted (gap, padded ids, update, offload round trip)
    numerics = (logs / "numerics.log").read_text()
    for model in ("qwen2_padded", "qwen3", "qwen3_moe"):
        line = re.search(rf"^NUMERICS {model}: ok \(.*log-prob gap (\S+);.*offload ([\d.]+) MiB, (\d+) tensors",
                         numerics, re.M)
        assert line and float(line.group(1)) <= 1e-3 and float(line.group(2)) > 0, numerics[-3000:]
    assert "engine/trainer log-prob gap per step" in (logs / "grpo.log").read_text()
    assert "CPU dry run (gloo, fp32), engine hf, model.use_te=false" in proc.stdout
    assert f"installing 1 wheels into {work}/site: {probe}" in proc.stdout  # numpy's stays out
    assert (work / "site" / "smoke_probe" / "__init__.py").is_file()
    # each phase did what its line claims
    assert "compared" in (logs / "convert.log").read_text() and "identical" in (logs / "convert.log").read_text()
    grpo = [json.loads(x) for x in (work / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in grpo if "actor/grad_norm" in r] == [1, 2]
    assert (work / "sft" / "hf" / "model.safetensors").is_file() and (work / "grpo" / "hf").is_dir()
    # the GRPO run took the GPU-only paths (a config the dry run silently dropped would not be checked on a GPU)
    cfg = (work / "grpo" / "config.yaml").read_text()
    for line in ("use_distributed_optimizer: true", "recompute: selective", "param_offload: true",
                 "optimizer_offload: true", "ref_offload: true"):
        assert line in cfg, line
    assert sorted(p.name for p in (work / "grpo" / "checkpoints").glob("step_*")) == ["step_000001", "step_000002"]
    # the resumed run started at step 2 and reproduced it exactly (the resume phase compares five metrics)
    resumed = [json.loads(x)["step"] for x in (work / "grpo_resume" / "metrics.jsonl").read_text().splitlines()]
    assert resumed and set(resumed) == {2}, resumed
    assert "largest relative difference 0 " in (logs / "resume.log").read_text()
    init = (logs / "init.log").read_text()
    assert "after the first collective on 6 groups" in init
    width = (logs / "width.log").read_text()
    assert "step done" in width and "planner: weights + grads + Adam" in width


def test_phases_past_the_budget_fail_without_running_and_the_summary_says_so(tmp_path):
    """One device command has 480 s: a phase that would start past --budget is a fail line, not a killed run."""
    logs = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", "tools/gpu_smoke.sh", "--cpu-dry-run", "--engine", "hf", "--work-dir",
                           str(tmp_path / "work"), "--log-dir", str(logs), "--budget", "10"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    lines = [ln for ln in (logs / "summary.log").read_text().splitlines() if ln.startswith("PHASE ")]
    assert [ln.split(":")[0] for ln in lines] == [f"PHASE {n}" for n in ("numerics", "prepare", "sft", "grpo",
                                                                          "resume", "convert", "init", "width")]
    assert all("fail (no time left" in ln for ln in lines), lines
    assert "gpu_smoke: FAILED: numerics prepare sft grpo resume convert init width" in proc.stdout


def test_a_phase_line_says_pass_or_fail_and_a_failure_shows_its_log(tmp_path, capsys):
    assert helper.run_phase("ok", [sys.executable, "-c", "print('fine')"], str(tmp_path / "ok.log"), False, 60) == 0
    rc = helper.run_phase("bad", [sys.executable, "-c", "import sys; print('the reason'); sys.exit(3)"],
                          str(tmp_path / "bad.log"), False, 60)
    out = capsys.readouterr().out
    assert rc == 3
    summary = tmp_path / "summary.log"
    helper.run_phase("again", [sys.executable, "-c", "import sys; print('why'); sys.exit(1)"], str(tmp_path / "a.log"),
                     False, 60, summary=str(summary))
    assert "why" in summary.read_text() and re.search(r"^PHASE again: fail", summary.read_text(), re.M)
    assert re.search(r"^PHASE ok: pass \(peak GPU memory n/a, \d+ s\)$", out, re.MULTILINE)
    assert re.search(r"^PHASE bad: fail \(peak GPU memory n/a, \d+ s\)$", out, re.MULTILINE)
    assert "the reason" in out  # the log's tail, so a GPU run's output says why without fetching files


def test_a_phase_that_hangs_is_killed_at_its_limit(tmp_path, capsys):
    rc = helper.run_phase("hang", [sys.executable, "-c", "import time; time.sleep(60)"], str(tmp_path / "h.log"),
                          False, 1)
    assert rc == 124
    assert "PHASE hang: fail" in capsys.readouterr().out


def test_the_fallback_retriever_serves_the_search_r1_contract(tmp_path):
    """What the GPU machine uses when bm25s/fastapi are not carried: the trainer's client must read its answers."""
    from megatron_searchr1.search.client import RetrievalClient

    docs = [{"id": "0", "contents": '"Lisbon"\nLisbon is the capital of Portugal.'},
            {"id": "1", "contents": '"Oslo"\nOslo is the capital of Norway.'},
            {"id": "2", "contents": '"Kyoto"\nKyoto has many temples.'}]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    url, stop = helper._overlap_server(str(corpus))
    try:
        client = RetrievalClient(url, topk=2)
        raw = client.retrieve(["capital of Norway", "temples"], topk=2)
        assert [item["document"]["id"] for item in raw[0]] == ["1", "0"]  # Norway is the rarer word
        assert raw[1][0]["document"]["id"] == "2" and len(raw[1]) == 1
        text = client.search(["capital of Norway"])[0]
        assert text.startswith('Doc 1(Title: "Oslo")')
    finally:
        stop()


def test_the_step_check_refuses_a_run_whose_update_did_nothing(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "actor/loss": 0.1, "actor/grad_norm": 0.5}, {"step": 2, "actor/loss": 0.1,
                                                                     "actor/grad_norm": 0.0}, {"step": 2, "val": 1}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert helper.check_steps(str(metrics), 2, "actor") == 1  # step 2's gradient is 0
    rows[1]["actor/grad_norm"] = 0.2
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert helper.check_steps(str(metrics), 2, "actor") == 0
    assert helper.check_steps(str(metrics), 3, "actor") == 1  # a step missing
    # the engine/trainer log-prob gap, asserted when asked for: a step without it, or above it, fails
    assert helper.check_steps(str(metrics), 2, "actor", max_gap=1e-3) == 1
    for row, gap in zip(rows[:2], (2e-4, 5e-4)):
        row[helper.GAP] = gap
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert helper.check_steps(str(metrics), 2, "actor", max_gap=1e-3) == 0
    assert helper.check_steps(str(metrics), 2, "actor", max_gap=3e-4) == 1


def test_the_round_trip_check_finds_a_changed_tensor(tmp_path):
    from safetensors.torch import save_file

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    w = {"x": torch.arange(6.0).reshape(2, 3), "y": torch.ones(2)}
    save_file(w, str(a / "model.safetensors"))
    save_file(dict(w), str(b / "model.safetensors"))
    assert helper.compare(str(a), str(b)) == 0
    save_file({**w, "y": torch.tensor([1.0, 1.5])}, str(b / "model.safetensors"))
    assert helper.compare(str(a), str(b)) == 1
    save_file({"x": w["x"]}, str(b / "model.safetensors"))
    assert helper.compare(str(a), str(b)) == 1
