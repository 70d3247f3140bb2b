"""The rollout state machine with a scripted engine: stops, masks, invalid actions, max_turns, budgets."""
import pytest

from megatron_searchr1.data.prompts import INVALID_ACTION_FEEDBACK, format_observation
from megatron_searchr1.rollout import loop
from megatron_searchr1.rollout.loop import LoopSettings, Trajectory, run_rollout
from megatron_searchr1.search.client import SearchFailure
from tests.rollout.scripted import ScriptedEngine, SessionScriptedEngine


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from megatron_searchr1.models.tiny import TinyModelConfig, train_tokenizer

    return train_tokenizer(TinyModelConfig(output_dir=str(tmp_path_factory.mktemp("tok")), vocab_size=400))


DOCS = {"who founded acme?": 'Doc 1(Title: "Acme") Acme was founded by Bo Lund.\n',
        "when was bo lund born?": 'Doc 1(Title: "Bo Lund") Bo Lund was born in 1901.\n'}


class Searcher:
    def __init__(self, docs=DOCS, fail=()):
        self.docs, self.fail, self.calls = docs, set(fail), []

    def __call__(self, queries):
        self.calls.append(list(queries))
        return [SearchFailure("HTTP 503") if q in self.fail else self.docs.get(q, "Doc 1(Title: \"X\") nothing\n")
                for q in queries]


def _prompt(tok, text):
    return tok.encode(text, add_special_tokens=False)


def _run(tok, scripts, settings=LoopSettings(max_turns=3, max_tokens_per_turn=64), searcher=None):
    prompts = {f"Question {i}: {k}\n": v for i, (k, v) in enumerate(scripts.items())}
    keyed = {tuple(_prompt(tok, p)): v for p, v in prompts.items()}
    engine = ScriptedEngine(tok, keyed)
    trajs = [Trajectory(prompt_ids=list(k), uid=str(i)) for i, k in enumerate(keyed)]
    searcher = searcher or Searcher()
    stats = run_rollout(engine, tok, searcher, trajs, settings)
    for t in trajs:
        assert len(t.response_ids) == len(t.loss_mask) == len(t.logprobs) == len(t.versions)
    return trajs, stats, engine, searcher


def test_search_then_answer_keeps_engine_tokens_and_masks_the_observation(tok):
    turn1 = "<think> I need the founder. </think>\n<search> who founded acme? </search>"
    turn2 = "<think> Bo Lund. </think>\n<answer> Bo Lund </answer>"
    (t,), stats, engine, searcher = _run(tok, {"a": [turn1, turn2]})
    ids1, ids2 = tok.encode(turn1, add_special_tokens=False), tok.encode(turn2, add_special_tokens=False)
    obs = tok.encode(format_observation(DOCS["who founded acme?"]), add_special_tokens=False)
    assert t.response_ids == ids1 + obs + ids2  # exactly the engine's ids and the tokenized server text
    assert t.loss_mask == [1] * len(ids1) + [0] * len(obs) + [1] * len(ids2)
    # the engine's log-probs at mask-1 positions, 0.0 on the observation
    assert t.logprobs[: len(ids1)] == [-0.1 * (i + 1) for i in range(len(ids1))]
    assert t.logprobs[len(ids1): len(ids1) + len(obs)] == [0.0] * len(obs)
    assert (t.finish_reason, t.answer, t.n_searches, t.turns, t.queries) == ("answer", "Bo Lund", 1, 2,
                                                                              ["who founded acme?"])
    assert stats.finish["answer"] == 1 and searcher.calls == [["who founded acme?"]]


def test_nothing_is_kept_past_a_stop_tag(tok):
    turn1 = "<search> who founded acme? </search> and then I keep talking <answer> wrong </answer>"
    turn2 = "<answer> Bo Lund </answer> trailing words"
    (t,), _, _, _ = _run(tok, {"a": [turn1, turn2]})
    text = tok.decode(t.response_ids)
    assert "keep talking" not in text and "trailing" not in text and "wrong" not in text
    assert text.endswith("</answer>") and t.answer == "Bo Lund"


def test_one_search_call_per_turn_for_all_active_samples(tok):
    s1 = ["<search> who founded acme? </search>", "<search> when was bo lund born? </search>", "<answer> 1901 </answer>"]
    s2 = ["<search> when was bo lund born? </search>", "<answer> 1901 </answer>"]
    s3 = ["<answer> 7 </answer>"]
    trajs, stats, engine, searcher = _run(tok, {"a": s1, "b": s2, "c": s3})
    assert searcher.calls == [["who founded acme?", "when was bo lund born?"], ["when was bo lund born?"]]
    assert engine.calls == [3, 2, 1]  # each turn batches only the samples still active
    assert [t.n_searches for t in trajs] == [2, 1, 0]  # two search calls: searcher.calls above
    assert [t.answer for t in trajs] == ["1901", "1901", "7"]


def test_sessions_one_key_per_trajectory_ended_as_soon_as_it_finishes(tok):
    """On an engine that keeps sessions each trajectory keeps one key for all its turns and its session ends right
    after its last turn; the trajectories are what the same engine gives without sessions."""
    s1 = ["<search> who founded acme? </search>", "<search> when was bo lund born? </search>", "<answer> 1901 </answer>"]
    s2 = ["<answer> 7 </answer>"]
    s3 = ["<search> who founded acme? </search>"]  # never answers: ends max_turns after the final turn
    scripts = {f"Question {i}: {k}\n": v for i, (k, v) in enumerate({"a": s1, "b": s2, "c": s3}.items())}
    keyed = {tuple(_prompt(tok, p)): v for p, v in scripts.items()}
    results = []
    for engine in (ScriptedEngine(tok, keyed), SessionScriptedEngine(tok, keyed)):
        trajs = [Trajectory(prompt_ids=list(k), uid=str(i)) for i, k in enumerate(keyed)]
        run_rollout(engine, tok, Searcher(), trajs, LoopSettings(max_turns=2, max_tokens_per_turn=64))
        results.append([(t.response_ids, t.loss_mask, t.finish_reason) for t in trajs])
    assert results[0] == results[1]
    a, b, c = (id(t) for t in trajs)
    assert engine.keys == [[a, b, c], [a, c], [a, c]]
    assert engine.ended == [b, a, c] and not engine.held  # b after turn 1, a and c after turn 3


def test_each_token_carries_the_version_the_weights_hook_returned_for_its_turn(tok):
    """Partial rollouts: the hook runs before every turn (never inside a generate call) and may switch weights; a
    sample's tokens record each turn's version (its observation the turn's it follows), non-decreasing, and the
    sample counts as its oldest generated token (async_buffer.sample_version). Without the hook: version 0."""
    from megatron_searchr1.rollout.async_buffer import sample_version, version_metrics

    turn1 = "<search> who founded acme? </search>"
    turn2 = "<answer> Bo Lund </answer>"
    scripts = {"a": [turn1, turn2], "b": [turn2]}
    calls = []

    def weights():  # new weights arrive while turn 1's search runs
        calls.append(engine.calls[:])
        return 5 if len(calls) == 1 else 6

    prompts = {f"Question {i}: {k}\n": v for i, (k, v) in enumerate(scripts.items())}
    keyed = {tuple(_prompt(tok, p)): v for p, v in prompts.items()}
    engine = ScriptedEngine(tok, keyed)
    trajs = [Trajectory(prompt_ids=list(k), uid=str(i)) for i, k in enumerate(keyed)]
    run_rollout(engine, tok, Searcher(), trajs, LoopSettings(max_turns=2, max_tokens_per_turn=64), weights=weights)
    assert calls == [[], [2]]  # before turn 1, then before turn 2 (after turn 1's call); none after the last
    a, b = trajs
    n1 = len(tok.encode(turn1, add_special_tokens=False))
    n_obs = len(tok.encode(format_observation(DOCS["who founded acme?"]), add_special_tokens=False))
    assert a.versions == [5] * (n1 + n_obs) + [6] * (len(a.response_ids) - n1 - n_obs)
    assert a.versions == sorted(a.versions) and set(b.versions) == {5}
    assert [sample_version(t.versions, t.loss_mask) for t in trajs] == [5, 5]
    assert version_metrics([t.versions for t in trajs]) == {"async/multi_version_share": 0.5,
                                                            "async/versions_per_sample_mean": 1.5}
    (c,), _, _, _ = _run(tok, {"c": [turn1, turn2]})
    assert len(c.versions) == len(c.response_ids) and set(c.versions) == {0}


def test_invalid_action_gets_search_r1s_feedback_with_mask_zero(tok):
    (t,), _, _, _ = _run(tok, {"a": ["<think> hmm </think>", "<answer> x </answer>"]})
    fb = tok.encode(INVALID_ACTION_FEEDBACK, add_special_tokens=False)
    gen1 = tok.encode("<think> hmm </think>", add_special_tokens=False)
    assert t.response_ids[len(gen1): len(gen1) + len(fb)] == fb
    assert t.loss_mask[len(gen1): len(gen1) + len(fb)] == [0] * len(fb)
    assert t.n_invalid == 1 and t.finish_reason == "answer"


def test_max_turns_then_a_final_turn_without_search(tok):
    always = ["<search> who founded acme? </search>"]
    (t,), _, engine, searcher = _run(tok, {"a": always}, LoopSettings(max_turns=2, max_tokens_per_turn=64))
    assert t.turns == 3 and t.n_searches == 2 and len(searcher.calls) == 2  # the third (final) turn runs no search
    assert t.finish_reason == "max_turns"
    (t,), _, _, _ = _run(tok, {"a": ["<search> who founded acme? </search>", "<think> no idea </think>"]},
                         LoopSettings(max_turns=1, max_tokens_per_turn=64))
    assert t.finish_reason == "invalid" and t.n_invalid == 1
    # max_turns=0: one turn, no search at all (answer directly)
    (t,), _, _, searcher = _run(tok, {"a": ["<answer> 3 </answer>"]}, LoopSettings(max_turns=0))
    assert t.finish_reason == "answer" and searcher.calls == []


def test_response_budget_ends_with_length_and_never_cuts_the_prompt(tok):
    long = "<think> " + "word " * 200 + "</think>"
    settings = LoopSettings(max_turns=3, max_tokens_per_turn=50, max_response_length=120)
    (t,), stats, _, _ = _run(tok, {"a": [long]}, settings)
    assert t.finish_reason == "length" and len(t.response_ids) == 120
    assert tok.decode(t.prompt_ids).startswith("Question 0: a")
    assert stats.finish["length"] == 1


def test_long_observation_is_cut_to_budget_keeping_the_closing_tag(tok):
    docs = {"who founded acme?": "Doc 1(Title: \"Acme\") " + "lorem ipsum " * 300 + "\n"}
    settings = LoopSettings(max_turns=2, max_tokens_per_turn=64, max_obs_length=40)
    (t,), _, _, _ = _run(tok, {"a": ["<search> who founded acme? </search>", "<answer> a </answer>"]},
                         settings, Searcher(docs))
    obs = [i for i, m in zip(t.response_ids, t.loss_mask) if m == 0]
    assert len(obs) == 40 and tok.decode(obs).endswith("</information>\n\n")


def test_failed_search_ends_the_sample_with_search_error(tok):
    (t,), stats, _, _ = _run(tok, {"a": ["<search> who founded acme? </search>", "<answer> a </answer>"]},
                             searcher=Searcher(fail={"who founded acme?"}))
    assert t.finish_reason == "search_error" and "Search failed: HTTP 503" in tok.decode(t.response_ids)
    assert stats.finish["search_error"] == 1
    # the type decides, not the text: a passage that happens to start with those words is an observation
    docs = {**DOCS, "who founded acme?": 'Search failed: a 1999 novel\n'}
    (t,), _, _, _ = _run(tok, {"a": ["<search> who founded acme? </search>", "<answer> a </answer>"]},
                         searcher=Searcher(docs))
    assert t.finish_reason == "answer" and "Search failed: a 1999 novel" in tok.decode(t.response_ids)


def test_metrics_cover_every_finish_reason(tok):
    trajs, stats, _, _ = _run(tok, {"a": ["<answer> 1 </answer>"], "b": ["<think> x </think>"]},
                              LoopSettings(max_turns=0))
    m = stats.as_metrics(trajs)
    assert m["rollout/finish_answer"] == 0.5 and m["rollout/finish_invalid"] == 0.5
    assert set(f"rollout/finish_{r}" for r in loop.FINISH_REASONS) <= set(m)
    assert m["rollout/valid_action_ratio"] == 0.5


def test_doctests():
    import doctest

    assert doctest.testmod(loop).failed == 0


def test_loop_settings_take_their_defaults_from_the_rollout_config():
    """One source for the defaults: LoopSettings' fields named as RolloutConfig's default to config.rollout's."""
    import dataclasses

    from megatron_searchr1.config.rl import RolloutConfig

    shared = {f.name for f in dataclasses.fields(LoopSettings)} & {f.name for f in dataclasses.fields(RolloutConfig)}
    assert shared == {"max_turns", "max_tokens_per_turn", "max_response_length", "max_obs_length", "temperature",
                      "top_p", "top_k"}
    config, settings = RolloutConfig(), LoopSettings()
    assert {n: getattr(settings, n) for n in shared} == {n: getattr(config, n) for n in shared}


def test_settings_from_config_are_what_every_placement_samples_with():
    """Colocated and disaggregated rollouts take their settings from this one function: top-p / top-k only when
    training samples (greedy decoding must not carry a nucleus that vLLM would refuse or apply), validation at its
    own temperature with the run's seed, the budgets and stop ids of config.rollout in both."""
    from megatron_searchr1.config.rl import RolloutConfig
    from megatron_searchr1.rollout.loop import settings_from_config

    r = RolloutConfig(temperature=0.7, top_p=0.9, top_k=20, val_temperature=0.0, max_turns=3, max_obs_length=77)
    train, val = settings_from_config(r, [5, 9], seed=11)
    assert (train.temperature, train.top_p, train.top_k, train.seed) == (0.7, 0.9, 20, None)
    assert (val.temperature, val.seed) == (0.0, 11)
    for s in (train, val):
        assert (s.max_turns, s.max_obs_length, s.stop_token_ids) == (3, 77, (5, 9))
    greedy, _ = settings_from_config(RolloutConfig(temperature=0.0, top_p=0.9, top_k=20), [], seed=None)
    assert (greedy.top_p, greedy.top_k) == (1.0, -1)
