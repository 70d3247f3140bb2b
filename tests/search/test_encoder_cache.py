"""Query dedup + LRU cache of the encoder, length-sorted batches, and the resumable sharded index build."""
import numpy as np
import pytest

from megatron_searchr1.search.dense import DenseRetriever
from megatron_searchr1.search.encoder import QueryCache


@pytest.fixture(scope="module")
def encoder(dense_index):
    return dense_index[1].encoder


def test_repeated_queries_are_encoded_once_and_equal_encoding_alone(encoder, world):
    qs = world["queries"][:6]
    batch = [qs[i % 6] for i in [0, 1, 0, 2, 3, 0, 4, 5, 1]]
    before = dict(encoder.cache.stats())
    calls = []
    real = encoder.encode_tokens
    encoder.encode_tokens = lambda tokens, bar=None: calls.append(len(tokens["input_ids"])) or real(tokens, bar)
    try:
        unique, inverse = encoder.encode_unique_queries(batch)
    finally:
        encoder.encode_tokens = real
    assert calls == [6] and unique.shape[0] == 6 and list(inverse) == [0, 1, 0, 2, 3, 0, 4, 5, 1]
    alone = np.stack([real(encoder.tokenize([q], is_query=True))[0] for q in qs])
    np.testing.assert_allclose(unique, alone, atol=1e-6)  # padding in a sorted batch: float rounding only
    after = encoder.cache.stats()
    assert after["duplicates_in_batch"] - before["duplicates_in_batch"] == 3


def test_cached_queries_skip_the_model_and_the_lru_is_bounded():
    cache = QueryCache(2)
    for q in "abc":
        cache.put(q, np.full(3, ord(q), np.float32))
    assert cache.get("a") is None and cache.get("b") is not None  # "a" was evicted, "b" is now the newest
    cache.put("d", np.zeros(3, np.float32))
    assert cache.get("c") is None and cache.get("b") is not None and len(cache._store) == 2


def test_server_side_cache_hits(dense_index, world):
    from megatron_searchr1.search.encoder import Encoder

    enc = Encoder(dense_index[1].encoder.config, query_cache_size=100)
    r = DenseRetriever(dense_index[1].corpus, dense_index[1].cpu_index, enc)
    qs = world["queries"][:4]
    first = r.search_ids(qs + qs, 3)
    again = r.search_ids(qs, 3)
    np.testing.assert_array_equal(again[0], first[0][:4])
    np.testing.assert_array_equal(again[1], first[1][:4])  # a cached query gives the very same scores
    st = enc.cache.stats()
    assert (st["misses"], st["duplicates_in_batch"], st["hits"]) == (4, 4, 4) and st["hit_rate"] == round(8 / 12, 4)


def test_an_interrupted_build_resumes_from_its_shards(tmp_path, dense_index, encoder):
    corpus = list(dense_index[1].corpus)[:50]
    straight = DenseRetriever.build(corpus, encoder=encoder, show_progress=False, chunk_docs=16)
    calls = []
    real = encoder.encode_tokens

    def dies_on_third(tokens, bar=None):
        calls.append(len(tokens["input_ids"]))
        if len(calls) == 3:
            raise KeyboardInterrupt("killed mid-build")
        return real(tokens, bar)

    encoder.encode_tokens = dies_on_third
    try:
        with pytest.raises(KeyboardInterrupt):
            DenseRetriever.build(corpus, encoder=encoder, show_progress=False, chunk_docs=16, shard_dir=tmp_path)
        calls.clear()
        encoder.encode_tokens = lambda tokens, bar=None: calls.append(len(tokens["input_ids"])) or real(tokens, bar)
        resumed = DenseRetriever.build(corpus, encoder=encoder, show_progress=False, chunk_docs=16,
                                       shard_dir=tmp_path)
    finally:
        encoder.encode_tokens = real
    assert calls == [16, 2]  # chunks 0 and 1 came from the shards; 2 and 3 (16 + 2 docs) were encoded
    np.testing.assert_array_equal(resumed.cpu_index.reconstruct_n(0, 50), straight.cpu_index.reconstruct_n(0, 50))
    # a different chunking is another build: its shards are not reused
    calls.clear()
    encoder.encode_tokens = lambda tokens, bar=None: calls.append(len(tokens["input_ids"])) or real(tokens, bar)
    try:
        DenseRetriever.build(corpus, encoder=encoder, show_progress=False, chunk_docs=25, shard_dir=tmp_path)
    finally:
        encoder.encode_tokens = real
    assert calls == [25, 25]
