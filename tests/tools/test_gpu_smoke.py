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
    proc = subprocess.run(["bash", "tools/gpu_smoke.sh", "--cpu-dry-run", "--engine", "hf", "--wheels", str(wheels),
                           "--work-dir", str(work), "--timeout-scale", "4"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    out = proc.stdout + proc.stderr
    phases = {m.group(1): m.group(2) for m in PHASE_LINE.finditer(proc.stdout)}
    assert phases == {name: "pass" for name in ("prepare", "init", "sft", "grpo", "resume", "width", "convert")}, \
        out[-6000:]
    assert proc.returncode == 0 and "all phases passed" in proc.stdout
    assert "CPU dry run (gloo, fp32), engine hf, model.use_te=false" in proc.stdout
    assert f"installing 1 wheels into {work}/site: {probe}" in proc.stdout  # numpy's stays out
    assert (work / "site" / "smoke_probe" / "__init__.py").is_file()
    # each phase did what its line claims
    assert "compared" in (work / "convert.log").read_text() and "identical" in (work / "convert.log").read_text()
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
    assert "largest relative difference 0 " in (work / "resume.log").read_text()
    init = (work / "init.log").read_text()
    assert "after the first collective on 6 groups" in init
    width = (work / "width.log").read_text()
    assert "step done" in width and "planner: weights + grads + Adam" in width


def test_a_phase_line_says_pass_or_fail_and_a_failure_shows_its_log(tmp_path, capsys):
    assert helper.run_phase("ok", [sys.executable, "-c", "print('fine')"], str(tmp_path / "ok.log"), False, 60) == 0
    rc = helper.run_phase("bad", [sys.executable, "-c", "import sys; print('the reason'); sys.exit(3)"],
                          str(tmp_path / "bad.log"), False, 60)
    out = capsys.readouterr().out
    assert rc == 3
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
