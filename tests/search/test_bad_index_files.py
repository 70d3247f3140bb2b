"""Damaged index files and a wrong corpus: the server says so in one `error:` line naming the file, exit 2."""
import shutil
import subprocess
import sys

import pytest


def _serve(*flags):
    r = subprocess.run([sys.executable, "-m", "megatron_searchr1.search.server", *flags, "--port", "0"],
                       capture_output=True, text=True, timeout=180)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    return errors[0]


def test_a_corrupt_index_meta_is_one_line_naming_it(tmp_path, bm25_index):
    shutil.copytree(bm25_index[0], tmp_path / "idx")
    meta = tmp_path / "idx" / "index_meta.json"
    meta.write_text(meta.read_text()[:40])  # cut mid-write
    line = _serve("--index-dir", str(tmp_path / "idx"))
    assert f"{meta} is damaged (not JSON" in line and "rebuild the index with tools/build_index.py" in line


@pytest.mark.slow
def test_a_corpus_of_another_size_names_the_corpus_flag(tmp_path, bm25_index, world):
    lines = open(world["path"]).read().splitlines(keepends=True)
    (tmp_path / "short.jsonl").write_text("".join(lines[:-5]))
    line = _serve("--index-dir", bm25_index[0], "--corpus", str(tmp_path / "short.jsonl"))
    assert f"{tmp_path / 'short.jsonl'} has {len(lines) - 5} docs but the index" in line
    assert "with --corpus" in line and "corpus_path=" not in line
