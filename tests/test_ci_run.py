""".ci/run runs README's two commands as a new user does: the main command in a fresh virtualenv (the install as the
README writes it, the demo at its CI size, every console script's --help), then the test install and the README's
test command; any failure stops it with a non-zero exit.

The real run is CI's (installing vLLM takes minutes); here .ci/run runs for real against a stand-in repository whose
tools/install.sh, examples/cpu_demo.sh and console scripts only record how they were called, from which
interpreter and which virtualenv."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.dist_utils import REPO


def readme_commands() -> tuple[str, str]:
    """The two ```bash blocks under README's "The two commands": (the main command, the test command)."""
    text = (REPO / "README.md").read_text()
    section = text.split("## The two commands", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)\n```", section, re.S)
    assert len(blocks) == 2, blocks
    return blocks[0].strip(), blocks[1].strip()


def test_ci_runs_the_readme_commands_as_written():
    main, tests = readme_commands()
    install, demo = (part.strip() for part in main.split("&&"))
    assert (install, demo) == ("bash tools/install.sh cpu", "bash examples/cpu_demo.sh")
    ci = (REPO / ".ci" / "run").read_text()
    lines = [line.strip() for line in ci.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert "set -euo pipefail" in lines
    venv = next(i for i, line in enumerate(lines) if line.startswith("python -m venv "))
    activate = next(i for i, line in enumerate(lines) if line.startswith("source ") and "/bin/activate" in line)
    at_install = lines.index(install)  # verbatim, inside the activated virtualenv
    at_demo = next(i for i, line in enumerate(lines) if line.startswith(demo + " --size ci"))
    at_tests = next(i for i, line in enumerate(lines) if line.startswith(tests))  # verbatim, then CI's own flags
    assert venv < activate < at_install < at_demo < at_tests
    assert "--runslow" in lines[at_tests]


STUB_INSTALL = """#!/usr/bin/env bash
set -euo pipefail
echo "install [$*] python=$(command -v python) venv=${VIRTUAL_ENV:-none} pythonpath=${PYTHONPATH:-none}" >> "$CI_LOG"
if [[ "${1:-}" == cpu ]]; then  # what pip's console scripts would be: each records its call
    for s in searchr1-one searchr1-two; do
        printf '#!/bin/sh\\necho "$(basename "$0") $* venv=$VIRTUAL_ENV" >> "$CI_LOG"\\nexit ${HELP_RC:-0}\\n' \\
            > "$VIRTUAL_ENV/bin/$s"
        chmod +x "$VIRTUAL_ENV/bin/$s"
    done
fi
"""
STUB_DEMO = """#!/usr/bin/env bash
echo "demo [$*] python=$(command -v python)" >> "$CI_LOG"
exit "${DEMO_RC:-0}"
"""


@pytest.fixture()
def stand_in(tmp_path):
    """A repository with .ci/run as it is, stand-in install and demo scripts, two console scripts in setup.py and a
    test suite of one passing test."""
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    shutil.copy2(REPO / ".ci" / "run", repo / ".ci" / "run")
    for path, text in (("tools/install.sh", STUB_INSTALL), ("examples/cpu_demo.sh", STUB_DEMO)):
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    (repo / "setup.py").write_text('CONSOLE = [\n    "searchr1-one=a:cli",\n    "searchr1-two=b:cli",\n]\n')
    (repo / "tests").mkdir()
    (repo / "tests" / "conftest.py").write_text(
        "def pytest_addoption(parser):\n    parser.addoption('--runslow', action='store_true')\n")
    (repo / "tests" / "test_ok.py").write_text("def test_ok():\n    open('PYTEST_RAN', 'w').close()\n")
    return repo


def _ci(repo, **env):
    log = repo.parent / "calls.log"
    full_env = {**os.environ, "CI_LOG": str(log), "TMPDIR": str(repo.parent), "PYTHONPATH": str(REPO), **env}
    # `python` on PATH is this interpreter, as on a CI machine whose python runs the tests; its virtualenvs come
    # without pip (the stand-in install needs none: ensurepip would take most of this test's time)
    bin_dir = repo.parent / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python").write_text(f'#!/usr/bin/env bash\nif [[ "$1 $2" == "-m venv" ]]; then exec {sys.executable} '
                                    f'-m venv --without-pip "${{@:3}}"; fi\nexec {sys.executable} "$@"\n')
    (bin_dir / "python").chmod(0o755)
    full_env["PATH"] = f"{bin_dir}{os.pathsep}{full_env['PATH']}"
    proc = subprocess.run(["bash", str(repo / ".ci" / "run")], cwd=repo.parent, env=full_env, capture_output=True,
                          text=True, timeout=600)
    return proc, (log.read_text().splitlines() if log.exists() else [])


def test_ci_runs_the_main_command_in_a_fresh_virtualenv_before_the_tests(stand_in):
    proc, calls = _ci(stand_in)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    venv_python = re.match(r"install \[cpu\] python=(\S+)/bin/python venv=(\S+) pythonpath=none", calls[0])
    assert venv_python and venv_python[1] == venv_python[2], calls  # the venv's python, CI's PYTHONPATH gone
    venv = venv_python[2]
    assert not venv.startswith(os.path.dirname(os.path.dirname(sys.executable)))  # a new one, not CI's
    assert calls[1].startswith("demo [--size ci --work-dir ") and f"python={venv}/bin/python" in calls[1]
    assert calls[2:4] == [f"searchr1-one --help venv={venv}", f"searchr1-two --help venv={venv}"]
    # then the test install, outside the virtualenv, and the README's test command
    assert re.match(r"install \[\] python=\S+ venv=none", calls[4]) and len(calls) == 5, calls
    assert (stand_in / "PYTEST_RAN").exists()
    assert not list(stand_in.parent.glob("searchr1-new-user.*"))  # the fresh virtualenv is removed afterwards


@pytest.mark.parametrize("failing", ["DEMO_RC", "HELP_RC"])
def test_a_failure_in_the_fresh_virtualenv_fails_ci_before_the_tests(stand_in, failing):
    proc, calls = _ci(stand_in, **{failing: "1"})
    assert proc.returncode != 0
    assert not any(c.startswith("install []") for c in calls) and not (stand_in / "PYTEST_RAN").exists()
    if failing == "HELP_RC":
        assert "error: 'searchr1-one --help' fails in the fresh virtualenv" in proc.stderr
