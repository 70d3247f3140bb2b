"""The KV-session stop candidates (vllm_sessions.stop_candidates / KVSessions.candidates) on byte-level BPEs
trained here: the ids whose token holds a stop's last character, no U+FFFD ids when the stops end in ASCII."""
import importlib.util
import sys
from types import SimpleNamespace

import pytest

from tests.dist_utils import REPO

STOPS = ("</search>", "</answer>")


def _bench():
    spec = importlib.util.spec_from_file_location("bench_stop_check",
                                                  REPO / "tools" / "benchmarks" / "bench_stop_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_stop_check"] = mod
    spec.loader.exec_module(mod)
    return mod


def _engine_candidates(tokenizer, stops):
    """The engine's own method, on a stand-in engine whose vLLM hands out this tokenizer."""
    from transformers import PreTrainedTokenizerFast

    from megatron_searchr1.rollout.engines.vllm_sessions import KVSessions

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    sessions = KVSessions(SimpleNamespace(get_tokenizer=lambda: hf), sampling_params=None)
    return sessions.candidates(stops), hf


def _check(vocab_size, bound, lines=4000):
    tok = _bench().train_byte_level_bpe(vocab_size, lines=lines)
    assert tok.get_vocab_size() == vocab_size
    ids, hf = _engine_candidates(tok, STOPS)
    texts = hf.batch_decode([[i] for i in range(vocab_size)], skip_special_tokens=False)
    partial = {i for i, t in enumerate(texts) if "\ufffd" in t}
    old_rule = {i for i, t in enumerate(texts) if "\ufffd" in t or ">" in t}
    assert ids == frozenset(i for i, t in enumerate(texts) if ">" in t)
    assert partial - ids, "the corpus should give partial-character tokens, or this checks nothing"
    print(f"{len(ids)} stop candidates of {vocab_size} ids ({len(old_rule)} with the U+FFFD ids)")
    assert len(ids) <= bound, (f"{len(ids)} stop candidates on a {vocab_size}-id byte-level BPE (measured when "
                               f"written: 1677 at 150k; the old rule, '>' or U+FFFD, gave {len(old_rule)})")
    # a stop ending in a non-ASCII character still stops on every partial-character token
    cjk_ids, _ = _engine_candidates(tok, ("\u300d",))
    assert partial <= cjk_ids


def test_stop_candidates_small_bpe():
    _check(20_000, bound=400, lines=400)  # 276 when written (927 with the U+FFFD ids)


@pytest.mark.slow
def test_stop_candidates_on_a_150k_byte_level_bpe():
    """Qwen2.5's size (151k): 1677 candidates when written, 2954 with the U+FFFD ids."""
    _check(150_000, bound=2_000)  # 1677 when written (2954 with the U+FFFD ids)
