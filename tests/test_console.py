"""megatron_searchr1/console.py: third-party warning noise is filtered and ours is kept; progress in a log file is
plain lines, never tqdm's carriage-return redraws."""
import io
import subprocess
import sys
import warnings

import pytest

from megatron_searchr1.console import PlainProgress, progress, quiet_third_party_warnings
from tests.dist_utils import REPO


def _warn_from(module: str, category: type[Warning], text: str) -> None:
    """Issue a warning the way code in `module` does: `warnings.warn` attributes it to the calling frame's module."""
    exec(f"import warnings\nwarnings.warn({text!r}, {category.__name__})", {"__name__": module})


def _record(calls) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert quiet_third_party_warnings()
        for module, category, text in calls:
            _warn_from(module, category, text)
    return [str(w.message) for w in seen]


def test_third_party_noise_is_filtered_ours_is_kept():
    seen = _record([
        ("megatron.core.dist_checkpointing.strategies.torch", FutureWarning, "dcp deprecated"),
        ("torch.distributed.checkpoint.state_dict_loader", UserWarning, "load_state_dict is deprecated"),
        ("vllm.engine.arg_utils", DeprecationWarning, "old flag"),
        ("transformers.modeling_utils", FutureWarning, "attention default changes"),
        ("megatron_searchr1.rollout.engine", UserWarning, "ours: vllm version untested"),
        ("megatron_searchr1.megatron.initialize", FutureWarning, "ours: a future change"),
        ("torchvision_like_but_not_torch", UserWarning, "another package"),  # the prefix needs a dot boundary
        ("vllm.worker", RuntimeWarning, "a runtime warning is not noise"),
    ])
    assert seen == ["ours: vllm version untested", "ours: a future change", "another package",
                    "a runtime warning is not noise"]


def test_without_the_filter_the_same_warnings_show():  # the test above would fail if the filter did nothing
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _warn_from("megatron.core.dist_checkpointing", FutureWarning, "dcp deprecated")
    assert [str(w.message) for w in seen] == ["dcp deprecated"]


def test_the_users_own_warning_options_win():
    code = ("import warnings; from megatron_searchr1.console import quiet_third_party_warnings as q; "
            "print(q()); exec('import warnings; warnings.warn(\"still here\", FutureWarning)', {'__name__': 'vllm.x'})")
    proc = subprocess.run([sys.executable, "-W", "always", "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False" and "still here" in proc.stderr


def test_non_tty_progress_is_plain_lines_every_n_steps():
    out = io.StringIO()  # not a terminal, as a cluster job's log file
    bar = progress(total=10, desc="SFT steps", unit="step", every_steps=3, every_seconds=1e9, file=out)
    assert isinstance(bar, PlainProgress)
    for step in range(10):
        bar.update(1)
        bar.set_postfix(loss=f"{1.0 / (step + 1):.3f}")
    bar.close()
    bar.close()  # a second close adds nothing
    text = out.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert [line.split(" (")[0] for line in lines] == ["SFT steps: 3/10", "SFT steps: 6/10", "SFT steps: 9/10",
                                                       "SFT steps: 10/10"]
    assert lines[-1].startswith("SFT steps: 10/10 (100%)") and lines[-1].endswith("| loss=0.100")
    assert " step/s" in lines[0] and "elapsed" in lines[0]


def test_non_tty_progress_over_an_iterable_resumed_and_disabled():
    out = io.StringIO()
    assert list(progress(range(5), desc="d", every_steps=2, file=out)) == [0, 1, 2, 3, 4]
    assert [line.split(" (")[0] for line in out.getvalue().splitlines()] == ["d: 2/5", "d: 4/5", "d: 5/5"]

    out = io.StringIO()
    bar = progress(total=100, initial=90, desc="RL steps", every_seconds=1e9, file=out)  # resumed at step 90
    for _ in range(10):
        bar.update(1)
    bar.close()
    assert out.getvalue().splitlines()[-1].startswith("RL steps: 100/100 (100%)")
    assert len(out.getvalue().splitlines()) == 10  # ~20 lines per run: every ceil(10 / 20) = 1 step

    out = io.StringIO()
    bar = progress(total=5, disable=True, file=out)
    for _ in range(5):
        bar.update(1)
    bar.write("a step line")
    bar.close()
    assert out.getvalue() == "a step line\n"  # the bar is hidden, the caller's lines are not (as tqdm.write)


def test_progress_prints_after_every_seconds_even_between_steps(monkeypatch):
    import megatron_searchr1.console as console

    now = [0.0]
    monkeypatch.setattr(console.time, "monotonic", lambda: now[0])
    out = io.StringIO()
    bar = progress(total=1000, desc="slow", every_steps=500, every_seconds=30, file=out)
    for _ in range(4):
        now[0] += 20.0
        bar.update(1)
    assert [line.split(" (")[0] for line in out.getvalue().splitlines()] == ["slow: 2/1000", "slow: 4/1000"]
    assert "0.05 it/s" in out.getvalue().splitlines()[0]


def test_tty_progress_is_tqdm():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    tqdm = pytest.importorskip("tqdm")
    bar = progress(total=3, desc="x", file=Terminal())
    assert isinstance(bar, tqdm.tqdm)
    bar.close()


def test_console_module_does_not_import_torch():
    code = "import sys, megatron_searchr1.console; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "False", proc.stderr


def test_doctests():
    import doctest

    import megatron_searchr1.console as console

    result = doctest.testmod(console)
    assert result.failed == 0 and result.attempted > 0


@pytest.mark.slow  # two fresh interpreters importing torch and megatron.core
def test_megatrons_import_noise_is_filtered_in_a_real_run():
    """What a user saw: megatron.core warns at import that Apex / Transformer Engine are missing (UserWarning) and
    that a module path is deprecated (DeprecationWarning). With the filter none of it reaches stderr."""
    imports = "import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs"
    runs = {}
    for quiet in (False, True):
        code = ("import warnings; warnings.simplefilter('default'); "
                + ("from megatron_searchr1.console import quiet_third_party_warnings; quiet_third_party_warnings(); "
                   if quiet else "") + imports)
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs[quiet] = proc.stderr
    assert "UserWarning" in runs[False]  # the noise is there without the filter
    assert "Warning" not in runs[True], runs[True][-2000:]


@pytest.mark.parametrize("entry", ["train", "sft", "evaluate", "infer"])
def test_entry_points_filter_third_party_noise_before_their_heavy_imports(entry):
    """Each entry point's main() installs the filter first: even `--help` leaves it in place, so the warnings torch,
    Megatron and vLLM raise while they load (after argument parsing) are already filtered."""
    import importlib
    import warnings

    module = importlib.import_module(f"megatron_searchr1.{entry}")
    with warnings.catch_warnings():
        warnings.resetwarnings()
        with pytest.raises(SystemExit):
            module.main(["--help"])

        def ignored(name):
            return any(action == "ignore" and category is FutureWarning and mod is not None and mod.match(name)
                       for action, _, category, mod, _ in warnings.filters)

        assert ignored("torch.distributed.c10d_logger") and ignored("megatron.core.dist_checkpointing")
        assert not ignored("megatron_searchr1.trainer.rl")
