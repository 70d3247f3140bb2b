"""README.md's shell blocks, run in order as a new user would on a fresh clone, so the README cannot drift from
what runs.

A block is skipped when the line right before its fence is `<!-- no-run -->` (GPU- or hub-only commands, the
install, and the long runs: the CPU demo, the test suite). Every other ```bash block runs with `bash -e -o pipefail`
in a scratch directory that holds the repository's tracked top-level files and folders as symlinks (so `data/`,
`runs/` and the rest start empty, as in a fresh clone); background jobs a block leaves behind are killed with it.
The retrieval server's port 8000 is replaced by a free port (the machine may run other servers).
SEARCHR1_README=path runs another file (to try README edits before making them).
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys

import pytest

from tests.dist_utils import REPO

NO_RUN = "<!-- no-run -->"
# Never run by accident: a block with one of these must be marked (it installs packages or runs the whole suite).
MUST_BE_MARKED = ("install.sh", "pip install", "pytest")
BLOCK_TIMEOUT_S = 1200


def shell_blocks(markdown: str) -> list[tuple[int, str, bool]]:
    """(line number of the opening fence, code, runs) of every ```bash / ```sh block; `runs` is False when the
    line right before the fence is the no-run marker.

    >>> shell_blocks("a\\n```bash\\necho 1\\n```\\n<!-- no-run -->\\n```bash\\nrm -rf x\\n```\\n```python\\nx\\n```\\n")
    [(2, 'echo 1\\n', True), (6, 'rm -rf x\\n', False)]
    """
    lines = markdown.splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        if m.group(1) in ("bash", "sh", "shell", "console"):
            runs = not (i > 0 and lines[i - 1].strip() == NO_RUN)
            out.append((i + 1, "".join(line + "\n" for line in lines[i + 1:end]), runs))
        i = end + 1
    return out


def test_shell_blocks_honour_the_marker():
    text = "x\n```bash\na\n```\n<!-- no-run -->\n```bash\nb\n```\n```python\nc\n```\n```\nd\n```\n"
    assert shell_blocks(text) == [(2, "a\n", True), (6, "b\n", False)]


def curls_without_fail(code: str) -> list[str]:
    """The `curl` commands in `code` that would exit 0 on an HTTP error (a 4xx or 5xx): those without `-f` /
    `--fail` (alone or in a bundle such as `-sf`), so a README block whose request is refused would still pass.

    >>> curls_without_fail("curl -s localhost:1/x\\n  -d '{}'\\ncurl -sf x\\ncurl --fail x && echo curl -s")
    ['curl -s localhost:1/x']
    """
    found = []
    for line in code.replace("\\\n", " ").splitlines():
        for command in re.split(r"&&|\|\||;|\|", line):
            words = command.split()
            if not words or words[0] != "curl":
                continue
            flags = [w for w in words[1:] if w.startswith("-")]
            if not any(w in ("--fail", "--fail-with-body") or (not w.startswith("--") and "f" in w[1:])
                       for w in flags):
                found.append(command.strip())
    return found


def test_curl_check_spots_a_missing_fail_flag():
    assert curls_without_fail("curl -s --retry 3 localhost:8000/retrieve -d '{}'\n") == [
        "curl -s --retry 3 localhost:8000/retrieve -d '{}'"]
    assert curls_without_fail("curl -sf --retry 3 localhost:8000/retrieve \\\n  -d '{}'\n") == []
    assert curls_without_fail("curl --retry-connrefused --fail x\n") == []


def test_readme_requests_fail_on_http_errors():
    """The README's runnable blocks run under `bash -e`: a request must fail the block when the server refuses it."""
    readme = os.environ.get("SEARCHR1_README") or str(REPO / "README.md")
    blocks = shell_blocks(open(readme, encoding="utf-8").read())
    bad = [(line, cmd) for line, code, runs in blocks if runs for cmd in curls_without_fail(code)]
    assert not bad, f"{readme}: add -f to these curl calls: " + "; ".join(f"line {ln}: {c}" for ln, c in bad)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens.

    >>> _slug("Mixture of experts (Qwen3-MoE, Qwen2-MoE)")
    'mixture-of-experts-qwen3-moe-qwen2-moe'
    """
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_links(markdown_path) -> list[str]:
    """The relative links of a markdown file whose file does not exist in the repository, or whose `#anchor` names
    no heading of the file it points to (web links are not followed)."""
    base = os.path.dirname(os.path.abspath(markdown_path))
    text = open(markdown_path, encoding="utf-8").read()
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(base, path)) if path else os.path.abspath(markdown_path)
        if not os.path.exists(full):
            bad.append(f"{target}: no such file")
        elif anchor and full.endswith(".md"):
            with open(full, encoding="utf-8") as f:
                headings = {_slug(m) for m in re.findall(r"^#+ +(.+)$", f.read(), flags=re.M)}
            if anchor not in headings:
                bad.append(f"{target}: no heading with that anchor")
    return bad


def test_readme_links_point_at_files_and_headings_that_exist():
    """Every guide the README's index names, and every section it points into, is in the repository."""
    readme = os.environ.get("SEARCHR1_README") or str(REPO / "README.md")
    assert not broken_links(readme), broken_links(readme)


def test_link_check_spots_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n## Some section (x)\n")
    (tmp_path / "b.md").write_text("[ok](a.md#some-section-x) [self](#top) [web](https://x.org/y) "
                                   "[gone](c.md) [anchor](a.md#nope)\n# Top\n")
    assert broken_links(tmp_path / "b.md") == ["c.md: no such file", "a.md#nope: no heading with that anchor"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fresh_clone(dest) -> None:
    """Symlink the repository's tracked top-level entries into `dest` (untracked data and runs stay behind)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for top in sorted({path.split("/", 1)[0] for path in tracked.splitlines()}):
        if os.path.exists(REPO / top):
            os.symlink(REPO / top, dest / top)


def _run_block(code: str, cwd, env) -> tuple[int, str]:
    """Run one block; its output goes to a file, not a pipe (a server left in the background would hold a pipe
    open), and its whole process group is killed when the block's shell is done."""
    log = cwd / ".block.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", code], cwd=cwd, env=env, text=True,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = -1
        finally:
            try:  # a server the block started in the background, or the whole block on a timeout
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    text = log.read_text(errors="replace")
    return rc, text + (f"\nTIMEOUT after {BLOCK_TIMEOUT_S}s" if rc == -1 else "")


@pytest.mark.slow  # minutes: it builds a world, an index, a tiny model and converts it both ways
def test_readme_blocks_run_in_order(tmp_path):
    readme = os.environ.get("SEARCHR1_README") or str(REPO / "README.md")
    blocks = shell_blocks(open(readme, encoding="utf-8").read())
    unmarked = [(line, code) for line, code, runs in blocks if runs and any(w in code for w in MUST_BE_MARKED)]
    assert not unmarked, (f"{readme}: mark these blocks `{NO_RUN}` (they install packages or run the test suite): "
                          + "; ".join(f"line {line}: {code.splitlines()[0]}" for line, code in unmarked))
    clone = tmp_path / "clone"
    clone.mkdir()
    _fresh_clone(clone)
    port = str(_free_port())
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    failures, ran = [], 0
    for line, code, runs in blocks:
        if not runs:
            continue
        code = re.sub(r"(?<=[ :])8000\b", port, code)
        rc, out = _run_block(code, clone, env)
        ran += 1
        if rc != 0:
            failures.append(f"--- block at {os.path.basename(readme)}:{line} exited {rc}:\n{code}--- output (tail):\n"
                            + "\n".join(out.splitlines()[-25:]))
    assert ran, f"{readme} has no runnable shell block"
    assert not failures, f"{len(failures)} of {ran} README blocks failed:\n" + "\n".join(failures)
