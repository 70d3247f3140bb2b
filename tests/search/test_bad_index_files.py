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


def test_a_truncated_bm25_array_is_one_line_naming_it(tmp_path, bm25_index):
    """A copy cut short: the .npy header promises more bytes than the file has. Found from the header and the
    size before the corpus or bm25s loads (bm25s would say only "Failed to read all data", with no path)."""
    shutil.copytree(bm25_index[0], tmp_path / "idx")
    arrays = sorted((tmp_path / "idx" / "bm25").glob("*.npy"))
    with open(arrays[0], "r+b") as f:
        f.truncate(arrays[0].stat().st_size // 2)
    for flags in ((), ("--bm25-mmap",)):  # read and memory-mapped: both fail the same way without the check
        line = _serve("--index-dir", str(tmp_path / "idx"), *flags)
        assert f"{arrays[0]}: truncated" in line and "rebuild the index with tools/build_index.py" in line, line


def test_a_corpus_cut_mid_line_is_one_line_naming_it(tmp_path, bm25_index, world):
    text = open(world["path"]).read()
    cut = tmp_path / "cut.jsonl"
    cut.write_text(text[:len(text) // 2])  # ends inside a row, as a copy onto a full disk does
    line = _serve("--index-dir", bm25_index[0], "--corpus", str(cut))
    assert f"{cut}: its last line is not a complete row" in line and "pass the complete corpus with --corpus" in line


def test_a_damaged_row_inside_the_corpus_names_its_line(tmp_path, world):
    """A bad row that is not the last one is found when the corpus loads; still one error naming file and line."""
    from megatron_searchr1.search.retrievers import IndexFileError, index_corpus, load_retriever

    lines = open(world["path"]).read().splitlines(keepends=True)
    index_corpus(world["path"], tmp_path / "idx", kind="bm25", show_progress=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(lines[:10] + ['{"id": "10", "conte\n'] + lines[11:]))
    with pytest.raises(IndexFileError, match=rf"{bad}:11: malformed JSON .*pass an intact corpus with --corpus"):
        load_retriever(tmp_path / "idx", corpus_path=bad)


def test_truncated_dense_files_name_the_file(tmp_path):
    """The dense side's files: the refine vectors (.npy, checked from header and size) and the faiss index
    (faiss's own read error, re-raised with the path and what to do)."""
    import faiss
    import numpy as np

    from megatron_searchr1.search.dense import read_faiss_index
    from megatron_searchr1.search.retrievers import IndexFileError, npy_problem

    vectors = np.random.default_rng(0).standard_normal((50, 8)).astype(np.float32)
    np.save(tmp_path / "v.npy", vectors)
    assert npy_problem(tmp_path / "v.npy") is None
    whole = (tmp_path / "v.npy").read_bytes()
    (tmp_path / "v.npy").write_bytes(whole[:-4])
    assert npy_problem(tmp_path / "v.npy") == f"truncated: {len(whole) - 4} bytes, its header needs {len(whole)}"
    (tmp_path / "v.npy").write_bytes(whole[:5])
    assert npy_problem(tmp_path / "v.npy").startswith("not a readable .npy file")

    index = faiss.IndexFlatIP(8)
    index.add(vectors)
    faiss.write_index(index, str(tmp_path / "dense.index"))
    assert read_faiss_index(tmp_path / "dense.index").ntotal == 50
    whole = (tmp_path / "dense.index").read_bytes()
    (tmp_path / "dense.index").write_bytes(whole[:len(whole) // 2])
    with pytest.raises(IndexFileError, match=rf"{tmp_path / 'dense.index'} cannot be read by faiss .*rebuild it"):
        read_faiss_index(tmp_path / "dense.index")
