"""Format reward: the think -> search -> information -> ... -> answer grammar on the response alone, and the
score table of Search-R1's qa_em_format (structure 0.2, final format 0.1, retrieval 0.1 as in its paper)."""
import pytest

from megatron_searchr1.data import prompts
from megatron_searchr1.reward.qa_em_format import (
    compute_score_em, extract_information_blocks, is_retrieval_correct, is_valid_sequence,
)

GT = {"target": ["Paris"]}
KW = dict(structure_format_score=0.2, final_format_score=0.1, retrieval_score=0.1)


def _search(query, docs):
    return prompts.search_turn("need facts", query) + prompts.format_observation(docs)


def _answer(ans):
    return prompts.answer_turn("done", ans)


@pytest.mark.parametrize("response", [
    _answer("Paris"),
    _search("capital of France", "Doc 1(Title: France) ...") + _answer("Paris"),
    _search("q1", "d1") + _search("q2", "d2") + _answer("Paris"),
    "\n  <think>\n</think>   <answer></answer>\n",  # whitespace anywhere outside tags is fine
])
def test_valid_sequences(response):
    assert is_valid_sequence(response) == (True, "valid")


@pytest.mark.parametrize("response, reason", [
    ("<answer> Paris </answer>", "unexpected tag '<answer>' in state 'start'"),
    ("<think> t </think> <search> q </search> <answer> x </answer>", "unexpected tag '<answer>' in state 'searched'"),
    # after an observation the model must think again before answering or searching
    ("<think> t </think><search> q </search><information> d </information><answer> x </answer>",
     "unexpected tag '<answer>' in state 'observed'"),
    ("<think> t </think><search> q </search><information> d </information><search> q </search>",
     "unexpected tag '<search>' in state 'observed'"),
    ("Sure! <think> t </think><answer> x </answer>", "unexpected text 'Sure!' in state 'start'"),
    ("<think> t </think><answer> x </answer> bye", "unexpected text 'bye' in state 'done'"),
    ("<think> t </think><answer> x </answer><|im_end|>", "unexpected text '<|im_end|>' in state 'done'"),
    ("<think> t </think><answer> x </answer><think> more </think>", "unexpected tag '<think>' in state 'done'"),
    ("<think> t <think> </think></think><answer> x </answer>", "unexpected tag '<think>' in state 'in_think'"),
    ("<think> t </think><answer> x", "1 <answer> vs 0 </answer>"),
    ("<think> t </think>", "incomplete: ended in state 'thought'"),
    ("", "incomplete: ended in state 'start'"),
])
def test_invalid_sequences_say_why(response, reason):
    assert is_valid_sequence(response) == (False, reason)


def test_retrieval_check():
    text = _search("q", "Doc 1(Title: X) nothing") + _search("q", "Doc 1(Title: France) capital: PARIS.")
    assert extract_information_blocks(text) == ["Doc 1(Title: X) nothing", "Doc 1(Title: France) capital: PARIS."]
    assert is_retrieval_correct(text, ["paris"]) is True
    assert is_retrieval_correct(text, "Paris") is True  # a str golden is one answer
    assert is_retrieval_correct(text, ["Lyon"]) is False
    # a golden answer in the model's own text (outside <information>) does not count
    assert is_retrieval_correct("<think> Paris </think>", ["Paris"]) is False


def test_score_table():
    found, missed = _search("q", "Paris is the capital"), _search("q", "nothing useful")
    assert compute_score_em(found + _answer("Paris"), GT, **KW) == 1.0              # correct, valid
    assert compute_score_em("<answer> Paris </answer>", GT, **KW) == pytest.approx(0.8)  # correct, invalid
    assert compute_score_em(found + _answer("Lyon"), GT, **KW) == pytest.approx(0.3)     # wrong, valid, retrieved
    assert compute_score_em(missed + _answer("Lyon"), GT, **KW) == pytest.approx(0.2)    # wrong, valid
    assert compute_score_em("<answer> Lyon </answer>", GT, **KW) == pytest.approx(0.1)   # wrong, invalid
    assert compute_score_em(found + "<think> hmm </think>", GT, **KW) == 0.0              # no answer, invalid
    # defaults: plain EM
    assert compute_score_em("<answer> Paris </answer>", GT) == 1.0
    assert compute_score_em(missed + _answer("Lyon"), GT) == 0.0


def test_prompt_example_is_not_scored():
    """The response alone is checked: no chat marker needed, the prompt's example answer plays no part."""
    response = _search("capital of China", "Beijing is the capital")
    assert compute_score_em(response, {"target": ["Beijing"]}, **KW) == 0.0
