"""tools/benchmarks/bench_rollout.py's token accounting on a scripted engine, counted by hand, so it cannot drift.

The scripted engine emits each turn's text as the tokenizer's ids and honours stop strings only when given them:
through the Search-R1-style adapter (no stops) it emits the whole scripted text, tag and all that follows.
"""
from __future__ import annotations

import importlib.util
import sys

import pytest

from megatron_searchr1.data.prompts import INVALID_ACTION_FEEDBACK, STOP_STRINGS, format_observation
from megatron_searchr1.rollout.engine import SamplingParams
from megatron_searchr1.rollout.loop import LoopSettings, Trajectory, run_rollout
from tests.dist_utils import REPO
from tests.rollout.scripted import ScriptedEngine


def _bench():
    spec = importlib.util.spec_from_file_location("bench_rollout", REPO / "tools" / "benchmarks" / "bench_rollout.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_rollout"] = mod  # dataclasses look their module up while the class is being built
    spec.loader.exec_module(mod)
    return mod


bench = _bench()

PROMPT = "Question: who founded acme?\n"
TURN1 = "<think> look it up </think>\n<search> who founded acme? </search>"
WASTE1 = "\n\n<information> invented docs </information>"  # what a model writes after </search>
TURN2 = "<think> found it </think>\n<answer> Bo Lund </answer>"
WASTE2 = " and then some more words"
DOCS = 'Doc 1(Title: "Acme") Acme was founded by Bo Lund.\n'


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from megatron_searchr1.models.tiny import TinyModelConfig, train_tokenizer

    return train_tokenizer(TinyModelConfig(output_dir=str(tmp_path_factory.mktemp("tok")), vocab_size=400))


def _n(tok, text):
    return len(tok.encode(text, add_special_tokens=False))


def _rollout(tok, wrap, scripts, settings=LoopSettings(max_turns=2, max_tokens_per_turn=64, temperature=0.0)):
    prompt = tok.encode(PROMPT, add_special_tokens=False)
    engine = wrap(ScriptedEngine(tok, {tuple(prompt): scripts}), [prompt])
    searches = []
    traj = Trajectory(prompt_ids=list(prompt), uid="0")
    stats = run_rollout(engine, tok, lambda qs: searches.append(qs) or [DOCS] * len(qs), [traj], settings)
    return engine.counts, traj, stats, searches


def test_stop_cut(tok):
    ids = tok.encode(TURN1 + WASTE1 + " </answer>", add_special_tokens=False)
    assert bench.stop_cut(tok, ids, STOP_STRINGS) == _n(tok, TURN1)
    assert bench.stop_cut(tok, ids, ("</answer>",)) == len(ids)
    assert bench.stop_cut(tok, ids[: _n(tok, TURN1) - 1], STOP_STRINGS) is None
    assert bench.stop_cut(tok, ids, ()) is None


def test_searchr1_style_counts_by_hand(tok):
    counts, traj, stats, searches = _rollout(tok, lambda e, _: bench.SearchR1StyleEngine(e, tok),
                                             [TURN1 + WASTE1, TURN2 + WASTE2])
    p, t1, w1, t2, w2 = (_n(tok, s) for s in (PROMPT, TURN1, WASTE1, TURN2, WASTE2))
    obs = _n(tok, format_observation(DOCS))
    # The loop saw the cut turns: the same trajectory our loop builds.
    assert traj.finish_reason == "answer" and traj.answer == "Bo Lund" and searches == [["who founded acme?"]]
    assert traj.response_ids == tok.encode(TURN1, add_special_tokens=False) + tok.encode(
        format_observation(DOCS), add_special_tokens=False) + tok.encode(TURN2, add_special_tokens=False)
    assert counts.requests == 2
    assert counts.prompt_tokens == counts.prefill == p + (p + t1 + obs)  # whole context, every turn, no credit
    assert counts.decoded == (t1 + w1) + (t2 + w2)  # decoded to the end of the script (eos / limit)
    assert counts.past_stop == w1 + w2
    assert counts.computed == 2 * p + t1 + obs + t1 + w1 + t2 + w2
    assert counts.per_request == [(p, p, t1 + w1, w1), (p + t1 + obs, p + t1 + obs, t2 + w2, w2)]
    assert bench.lower_bound([traj]) == p + t1 + obs + t2
    # The loop's own counters see the cut generations only (what it was handed).
    assert stats.generated_tokens == t1 + t2


def test_searchr1_style_turn_limit_and_invalid(tok):
    """A turn cut by the per-turn limit before any tag is kept whole (invalid action); nothing counts as waste."""
    settings = LoopSettings(max_turns=1, max_tokens_per_turn=5, temperature=0.0)
    counts, traj, _, searches = _rollout(tok, lambda e, _: bench.SearchR1StyleEngine(e, tok),
                                         ["<think> a b c d e f g h i j </think>", TURN2], settings)
    p, inv = _n(tok, PROMPT), _n(tok, INVALID_ACTION_FEEDBACK)
    assert searches == [] and traj.n_invalid == 2  # both turns: the first gets the feedback, the final one ends
    assert counts.decoded == 5 + 5 and counts.past_stop == 0  # TURN2 is cut by the limit too: no tag reached
    assert counts.prefill == p + (p + 5 + inv)
    assert traj.finish_reason == "invalid" and bench.lower_bound([traj]) == p + 5 + inv + 5


def test_metered_ours_counts_by_hand(tok):
    """Our loop through the meter: stops honoured, so nothing past a tag; the scripted engine caches nothing."""
    counts, traj, stats, _ = _rollout(tok, lambda e, firsts: bench.MeteredEngine(e, tok, firsts),
                                      [TURN1 + WASTE1, TURN2 + WASTE2])
    p, t1, t2 = _n(tok, PROMPT), _n(tok, TURN1), _n(tok, TURN2)
    obs = _n(tok, format_observation(DOCS))
    assert counts.decoded == t1 + t2 and counts.past_stop == 0
    assert counts.prefill == p + (p + t1 + obs) and counts.first_turn_cached == 0
    assert counts.computed == stats.prefill_tokens + stats.generated_tokens
    assert bench.lower_bound([traj]) == p + t1 + obs + t2


class _CachingEngine:
    """Reports a fixed number of cached prompt tokens per request, and decodes past the tag once."""

    def __init__(self, cached, ids):
        self.cached, self.ids = cached, ids

    def generate(self, prompts, params):
        from megatron_searchr1.rollout.engine import Generation

        return [Generation(token_ids=list(self.ids), logprobs=[0.0] * len(self.ids), finish_reason="stop",
                           num_cached_tokens=self.cached) for _ in prompts]


def test_metered_credits_cache_and_sees_waste(tok):
    ids = tok.encode(TURN1 + WASTE1, add_special_tokens=False)
    first = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    m = bench.MeteredEngine(_CachingEngine(4, ids), tok, [first])
    m.generate([first, first + [11, 12]], SamplingParams(max_tokens=64))
    c = m.counts
    assert c.prefill == (10 - 4) + (12 - 4) and c.first_turn_cached == 4  # only the first-turn prompt's hit
    assert c.past_stop == 2 * _n(tok, WASTE1)  # an engine that ignored the stop string is caught, not trusted


def test_bad_arguments_exit_2(capsys):
    from megatron_searchr1.cli import run_main

    with pytest.raises(SystemExit) as e:
        run_main(bench.main, ["--hidden-size", "48"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --hidden-size")
