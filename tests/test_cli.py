"""megatron_searchr1/cli.py, and every command line of the project run as a user would: a mistake (a missing path,
a value out of range, a broken input file) is exit code 2 with one `error:` line naming what to change, never a
traceback; the converters say so in under 3 s (their argument checks come before the heavy imports)."""
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from megatron_searchr1.cli import ArgumentParser, UsageError, above, at_least, run_main
from tests.dist_utils import REPO

# ---- the helper, in process --------------------------------------------------------------------------------------


def _parser():
    p = ArgumentParser(prog="tool", description="d")
    p.add_argument("--iters", type=at_least(1), default=5)
    p.add_argument("--seconds", type=above(0), default=6.0, help="per measurement")
    p.add_argument("--name", default=None, help="optional")
    p.add_argument("--sources", default="", help="comma list")
    p.add_argument("--fast", action="store_true", help="switch")
    g = p.add_argument_group("server")
    g.add_argument("--port", type=int, default=8000)
    return p


def test_help_shows_every_default_also_without_help_text():
    text = _parser().format_help()
    assert "default: 5" in text              # --iters has no help text
    assert "per measurement (default: 6.0)" in text
    assert "default: 8000" in text           # a flag in a group, without help text
    assert "default: None" not in text and "(default: )" not in text and "default: False" not in text


def test_range_types_name_the_flag(capsys):
    p = _parser()
    assert p.parse_args(["--iters", "1", "--seconds", "0.5"]).iters == 1
    for argv, msg in ((["--iters", "0"], "argument --iters: must be >= 1, got 0"),
                      (["--seconds", "0"], "argument --seconds: must be > 0, got 0"),
                      (["--iters", "x"], "argument --iters: expected an integer, got 'x'")):
        with pytest.raises(SystemExit) as e:
            p.parse_args(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: {msg} (see tool --help)"), err


def test_run_main_turns_usage_errors_into_one_line(capsys):
    def main(argv):
        raise UsageError("--data 'x' does not exist:\n  run the maker first")

    with pytest.raises(SystemExit) as e:
        run_main(main, [])
    assert e.value.code == 2
    assert capsys.readouterr().err == "error: --data 'x' does not exist: run the maker first\n"
    assert run_main(lambda argv: None, []) == 0
    with pytest.raises(KeyError):  # our bugs keep their traceback
        run_main(lambda argv: {}["k"], [])


def test_run_main_turns_a_dead_retriever_into_one_line_and_exit_3(capsys):
    from megatron_searchr1.search.client import RetrievalDown

    def main(argv):
        raise RetrievalDown("http://127.0.0.1:9", 5, 8, "ConnectError: refused", "a training step", "too many")

    with pytest.raises(SystemExit) as e:
        run_main(main, [])
    assert e.value.code == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: the retrieval server at http://127.0.0.1:9 failed 5 of 8 "
                                                    "searches during a training step"), err
    assert "ConnectError: refused" in err


def test_error_lines_of_ranks_sharing_one_stream_never_run_together():
    """Ranks of one torchrun job write to one stderr pipe: each `error:` line must go out in a single write, or two
    ranks' lines can interleave ("...stopserror: ..."; seen in a two-rank run whose retriever died)."""
    child = ("import sys\n"
             "from megatron_searchr1.cli import error_exit\n"
             "for i in range(400):\n"
             "    try:\n"
             "        error_exit('rank ' + sys.argv[1] + ' ' + 'x' * 300)\n"
             "    except SystemExit:\n"
             "        pass\n")
    read, write = os.pipe()
    procs = [subprocess.Popen([sys.executable, "-c", child, str(r)], stderr=write, cwd=REPO) for r in range(4)]
    os.close(write)
    with os.fdopen(read) as stream:
        lines = stream.read().splitlines()
    assert all(p.wait() == 0 for p in procs)
    assert len(lines) == 4 * 400 and all(ln.startswith("error: rank ") and ln.endswith("x" * 300) and
                                          ln.count("error:") == 1 for ln in lines), \
        [ln for ln in lines if ln.count("error:") != 1][:2]


# ---- every command line, as a subprocess -------------------------------------------------------------------------

PY = sys.executable
CONVERTERS = ("hf_to_megatron", "megatron_to_hf")


def console_scripts() -> dict[str, str]:
    """setup.py's CONSOLE list: script name -> `module:function`."""
    text = (REPO / "setup.py").read_text()
    body = text[text.index("CONSOLE = ["):]
    return dict(line.strip().strip('",').split("=", 1) for line in body[: body.index("]")].splitlines()[1:]
                if "=" in line and not line.strip().startswith("#"))


def console(name: str, *args: str) -> list[str]:
    """The command that does what the installed console script `name` does (import its function, call it with
    no arguments, exit with what it returns), so the test needs no `pip install`."""
    module, func = console_scripts()[name].split(":")
    code = f"import sys; sys.argv[0] = {name!r}; from {module} import {func}; sys.exit({func}())"
    return [PY, "-c", code, *args]


def _cases(t: str) -> list[tuple[str, list[str], str]]:
    """(id, command, a string the error line must contain). `t` is a scratch dir with `corpus.jsonl` (a valid
    corpus), `bad.jsonl` (broken JSON) and `empty/` (an empty directory); `missing*` paths do not exist.
    Console scripts run as installed (`console`) and, where there is one, through their tools/ wrapper."""
    m = f"{t}/missing"
    return [
        ("make_tiny_model-missing", [PY, "tools/make_tiny_model.py", "--output-dir", f"{t}/tiny", "--text",
                                     f"{m}.txt"], "missing.txt"),
        ("make_tiny_model-range", console("searchr1-make-tiny-model", "--output-dir", f"{t}/tiny",
                                          "--hidden-size", "0"), "--hidden-size"),
        ("make_tiny_model-not-empty", console("searchr1-make-tiny-model", "--output-dir", t), "--overwrite"),
        ("hf_to_megatron-missing", [PY, "checkpoints_convert/hf_to_megatron.py", "--hf-dir", m, "--out-dir",
                                    f"{t}/o"], m),
        ("hf_to_megatron-range", console("searchr1-hf-to-megatron", "--hf-dir", f"{t}/empty", "--out-dir",
                                         f"{t}/o", "--tp", "0"), "--tp"),
        ("hf_to_megatron-no-config", console("searchr1-hf-to-megatron", "--hf-dir", f"{t}/empty", "--out-dir",
                                             f"{t}/o"), "has no config.json"),
        ("hf_to_megatron-out-under-a-file", [PY, "checkpoints_convert/hf_to_megatron.py", "--hf-dir", f"{t}/empty",
                                             "--out-dir", f"{t}/corpus.jsonl/o"], "corpus.jsonl is a file"),
        ("megatron_to_hf-missing", [PY, "checkpoints_convert/megatron_to_hf.py", "--ckpt-dir", m, "--out-dir",
                                    f"{t}/o"], m),
        ("megatron_to_hf-not-a-checkpoint", console("searchr1-megatron-to-hf", "--ckpt-dir", f"{t}/empty", "--out-dir",
                                                    f"{t}/o"), "has no searchr1_checkpoint.json"),
        ("megatron_to_hf-range", console("searchr1-megatron-to-hf", "--ckpt-dir", f"{t}/empty", "--out-dir",
                                         f"{t}/o", "--pp", "0"), "--pp"),
        ("build_index-missing", [PY, "tools/build_index.py", "--corpus", f"{m}.jsonl", "--out-dir", f"{t}/idx"],
         "--corpus"),
        ("build_index-range", console("searchr1-build-index", "--corpus", f"{t}/corpus.jsonl", "--out-dir",
                                      f"{t}/idx", "--torch-threads", "-1"), "--torch-threads"),
        ("server-missing", console("searchr1-retrieval-server", "--index-dir", m), "tools/build_index.py"),
        ("server-range", console("searchr1-retrieval-server", "--index-dir", f"{t}/empty", "--port", "-1"),
         "--port"),
        ("prepare_qa-missing", [PY, "tools/prepare_qa_data.py", "--train", f"nq={m}.jsonl", "--out-dir", f"{t}/qa"],
         "missing.jsonl"),
        ("prepare_qa-bad-json", console("searchr1-prepare-qa", "--test", f"nq={t}/bad.jsonl", "--out-dir",
                                        f"{t}/qa"), "bad.jsonl:1: not valid JSON"),
        ("synthetic_world-missing", [PY, "tools/make_synthetic_world.py", "--out-dir", f"{t}/w",
                                     "--oracle-index-dir", m], "--oracle-index-dir"),
        ("synthetic_world-range", console("searchr1-synthetic-world", "--out-dir", f"{t}/w", "--topk", "0"),
         "--topk"),
        ("synthetic_world-stop-early", console("searchr1-synthetic-world", "--out-dir", f"{t}/w", "--stop-early",
                                               "1.5"), "--stop-early"),
        ("train-missing", console("searchr1-train", f"{m}.yaml"), "missing.yaml"),
        ("train-range", console("searchr1-train", "examples/grpo_tiny_cpu.yaml", "trainer.total_steps=-1"),
         "trainer.total_steps"),
        ("sft-missing", console("searchr1-sft", f"{m}.yaml"), "missing.yaml"),
        ("sft-range", console("searchr1-sft", "examples/sft_tiny_cpu.yaml", "trainer.total_steps=-1"),
         "trainer.total_steps"),
        ("evaluate-missing", [PY, "tools/evaluate.py", f"{m}.yaml"], "missing.yaml"),
        ("evaluate-range", console("searchr1-evaluate", "examples/grpo_tiny_cpu.yaml", "trainer.total_steps=-1"),
         "trainer.total_steps"),
        ("infer-missing", [PY, "tools/infer.py", "--model", m, "--question", "q"], "--model"),
        ("infer-range", console("searchr1-infer", "--model", f"{t}/empty", "--question", "q", "--topk", "0"),
         "--topk"),
        ("infer-template-kwargs", console("searchr1-infer", "--model", f"{t}/empty", "--question", "q", "--protocol",
                                          "tool_calls", "--chat-template-kwargs", "{enable_thinking: false}"),
         "--chat-template-kwargs is not JSON"),
        ("cpu_demo-range", console("searchr1-cpu-demo", "--work-dir", f"{t}/demo", "--sft-steps", "0"),
         "--sft-steps"),
        # benchmarks (no input paths: sizes only)
        ("bench_retrieval-range", [PY, "tools/benchmarks/bench_retrieval.py", "--concurrency", "0"],
         "--concurrency"),
        ("bench_padding-range", [PY, "tools/benchmarks/bench_padding.py", "--sequences", "0"], "--sequences"),
        ("bench_rollout-range", [PY, "tools/benchmarks/bench_rollout.py", "--work-dir", f"{t}/roll", "--prompts", "0"],
         "--prompts"),
        ("bench_weight_sync-range", [PY, "tools/benchmarks/bench_weight_sync.py", "--iters", "0"], "--iters"),
        ("bench_tree_pack-range", [PY, "tools/benchmarks/bench_tree_pack.py", "--prompts", "0"], "--prompts"),
        ("bench_megatron_vs_hf-range", [PY, "tools/benchmarks/bench_megatron_vs_hf.py", "--layers", "0"],
         "--layers"),
    ]


def test_every_console_script_has_a_case():
    covered = {c[0].split("-")[0] for c in _cases("t")}
    for name in console_scripts():
        short = name.removeprefix("searchr1-").replace("-", "_")
        assert short in covered or short.replace("retrieval_", "") in covered, f"{name} has no case in _cases"


def test_converter_dtype_choices_match_the_converter():
    from megatron_searchr1.models import convert, convert_cli

    assert set(convert_cli.DTYPE_CHOICES) == {"auto", *convert.DTYPES}


CASE_IDS = [c[0] for c in _cases("t")]


def _run(cmd: list[str], timeout: float = 120) -> tuple[int, str, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # a command that hangs after (or instead of) its error
        return -1, f"TIMEOUT after {timeout}s; stderr: {(e.stderr or b'')[-2000:]!r}", time.perf_counter() - t0
    return p.returncode, p.stderr, time.perf_counter() - t0


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    t = tmp_path_factory.mktemp("cli")
    (t / "corpus.jsonl").write_text(json.dumps({"id": "0", "contents": '"A"\nA is a place.'}) + "\n")
    (t / "bad.jsonl").write_text('{"question": "q", \n')
    (t / "empty").mkdir()
    return str(t)


@pytest.fixture(scope="module")
def results(scratch):
    """Every case run once, four at a time (each is a fresh interpreter importing part of the stack)."""
    cases = _cases(scratch)
    with ThreadPoolExecutor(max_workers=4) as pool:
        outs = list(pool.map(lambda c: _run(c[1]), cases))
    return {c[0]: (c, out) for c, out in zip(cases, outs)}


def _assert_one_error_line(rc: int, err: str, expect: str, cmd: list[str]) -> None:
    shown = " ".join(cmd)
    assert "Traceback" not in err, f"{shown}\n{err}"
    assert rc == 2, f"{shown}: exit {rc}\n{err}"
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, f"{shown}: want one `error:` line\n{err}"
    assert expect in errors[0], f"{shown}: the error should name {expect!r}: {errors[0]}"


@pytest.mark.slow  # ~30 fresh interpreters: about a minute on two cores
@pytest.mark.parametrize("case_id", CASE_IDS)
def test_user_mistake_is_one_error_line_exit_2(results, case_id):
    (_, cmd, expect), (rc, err, _) = results[case_id]
    _assert_one_error_line(rc, err, expect, cmd)


@pytest.mark.slow
@pytest.mark.parametrize("case_id", [c for c in CASE_IDS if c.startswith(CONVERTERS)])
def test_converters_fail_fast(scratch, case_id):
    """Run alone (not beside the others): the converters must say what is wrong before importing torch/megatron."""
    _, cmd, expect = next(c for c in _cases(scratch) if c[0] == case_id)
    _, _, bare = _run([PY, "-c", "pass"])  # interpreter start on this (possibly busy) machine
    rc, err, seconds = _run(cmd, timeout=60)
    _assert_one_error_line(rc, err, expect, cmd)
    assert seconds < 3.0 + bare, f"{' '.join(cmd)} took {seconds:.1f}s to fail (python itself: {bare:.1f}s)"

