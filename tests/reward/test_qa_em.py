"""EM/F1 rewards: Search-R1's normalisation edge cases, answer extraction from the response alone, targets as
list / numpy array / str."""
import numpy as np
import pytest

from megatron_searchr1.data import prompts
from megatron_searchr1.reward import qa_em
from megatron_searchr1.reward.qa_em import (
    compute_score_em, compute_score_f1, compute_score_subem, em_check, extract_solution, f1_score, normalize_answer,
    subem_check,
)


@pytest.mark.parametrize("raw, norm", [
    ("The Beatles", "beatles"),                 # article and case
    ("a an the", ""),                           # only articles
    ("Theatre", "theatre"),                     # an article is a whole word, not a prefix
    ("Ann the Anne", "ann anne"),
    ("U.S.A.", "usa"),                          # ASCII punctuation is deleted, not replaced by a space
    ("rock-n-roll", "rocknroll"),
    ("  New\tYork\n City  ", "new york city"),  # all whitespace squeezed
    ("the,the", "thethe"),                      # punctuation goes first, so 'the,the' is one word
    ("Café Zürich", "café zürich"),             # unicode letters kept, lower-cased
    ("ÉCOLE", "école"),
    ("«Paris»", "«paris»"),                     # non-ASCII punctuation kept (string.punctuation is ASCII)
    ("1,000", "1000"),
    ("", ""),
])
def test_normalize_answer(raw, norm):
    assert normalize_answer(raw) == norm


def test_em_and_subem_goldens_as_str_list_tuple_array():
    for goldens in ("Beatles", ["Stones", "the beatles"], ("Stones", "Beatles"), np.array(["Stones", "BEATLES!"])):
        assert em_check("The Beatles", goldens) == 1
        assert subem_check("The Beatles band", goldens) == 1
    # a str golden is one answer, not a list of characters
    assert em_check("b", "Beatles") == 0
    assert subem_check("x", "ab") == 0
    assert em_check("The Beatles band", ["Beatles"]) == 0
    assert em_check("anything", []) == 0
    assert em_check("", [""]) == 1  # both normalise to the empty string, as in Search-R1


def test_f1_is_squad_token_f1_max_over_goldens():
    # pred tokens [new, york, city], gold [new, york]: same 2, precision 2/3, recall 1 -> f1 = 0.8
    assert f1_score("New York City", ["York New"]) == pytest.approx(0.8)
    assert f1_score("New York City", ["Boston", "new york city"]) == 1.0
    # repeated tokens count once per occurrence: pred [a1, a1] vs gold [a1]: same 1, p 1/2, r 1 -> 2/3
    assert f1_score("paris paris", "paris") == pytest.approx(2 / 3)
    assert f1_score("the", "a") == 1.0  # both empty after normalisation
    assert f1_score("the", "paris") == 0.0
    assert f1_score("paris", []) == 0.0


def test_extract_solution_last_complete_answer_of_the_response():
    A0, A1 = prompts.ANSWER_START, prompts.ANSWER_END
    assert extract_solution(f"{A0} one {A1}") == "one"  # a single answer counts (Search-R1 needed two)
    assert extract_solution(f"{A0} one {A1} {A0}two{A1}") == "two"
    assert extract_solution(f"{A0} one {A1} {A0} two") == "one"  # unclosed last answer ignored
    assert extract_solution(f"{A0} two") is None
    assert extract_solution(f"two {A1}") is None
    assert extract_solution(f"{A0} one {A0} two {A1}") == "two"
    assert extract_solution(f"{A0}one{A1} stray {A1}") == "one"
    assert extract_solution(f"{A0}\n multi\nline \n{A1}") == "multi\nline"
    assert extract_solution(f"{A0}{A1}") == ""
    assert extract_solution("") is None


def test_prompt_example_answer_never_counts():
    """The instruction holds '<answer> Beijing </answer>'; only the response is scored."""
    prompt = prompts.make_prefix("What is the capital of China?")
    assert "<answer> Beijing </answer>" in prompt
    response = "<think> I should search. </think>\n<search> capital of China </search>"
    gt = {"target": ["Beijing"]}
    assert compute_score_em(response, gt) == 0.0
    assert extract_solution(response) is None
    # and a real answer in the response is found without needing a second match
    assert compute_score_em(response + "\n<answer> Beijing </answer>", gt) == 1.0


def test_compute_score_em_outcomes_and_target_types():
    resp = "<think> t </think>\n<answer> The Eiffel Tower </answer>"
    for target in (["eiffel tower"], np.array(["Louvre", "Eiffel Tower"], dtype=object), "eiffel tower",
                   np.array(["eiffel tower"])):
        assert compute_score_em(resp, {"target": target}) == 1.0
    assert compute_score_em(resp, {"target": ["Louvre"]}, format_score=0.2) == 0.2
    assert compute_score_em(resp, {"target": ["eiffel tower"]}, score=2.0) == 2.0
    assert compute_score_em("no answer here", {"target": ["x"]}, format_score=0.2) == 0.0
    assert isinstance(compute_score_em("no answer", {"target": ["x"]}), float)


def test_compute_score_subem_and_f1():
    resp = "<answer> The Eiffel Tower in Paris </answer>"
    assert compute_score_subem(resp, {"target": ["eiffel tower"]}) == 1.0
    assert compute_score_em(resp, {"target": ["eiffel tower"]}) == 0.0
    assert compute_score_subem(resp, {"target": ["louvre"]}, format_score=0.1) == 0.1
    # tokens [eiffel, tower, in, paris] vs [eiffel, tower]: p 2/4, r 1 -> 2/3
    assert compute_score_f1(resp, {"target": ["Eiffel Tower"]}) == pytest.approx(2 / 3)
    assert compute_score_f1("none", {"target": ["x"]}) == 0.0


def test_ground_truth_without_target_is_a_clear_error():
    with pytest.raises(ValueError, match="'target'"):
        compute_score_em("<answer> a </answer>", ["a"])
    with pytest.raises(ValueError, match="'target'"):
        qa_em.compute_score_subem("<answer> a </answer>", {"answers": ["a"]})


def test_doctests_of_the_reward_modules():
    import doctest

    from megatron_searchr1.reward import qa_em_format

    for module in (qa_em, qa_em_format):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0, (module.__name__, result)
