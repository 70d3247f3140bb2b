"""Exact-match rewards for open-domain QA, under Search-R1's names (``verl/utils/reward_score/qa_em.py``).

``normalize_answer``, ``em_check`` and ``subem_check`` give the same results as Search-R1's (which follow the
SQuAD/FlashRAG normalisation): lower-case, drop ASCII punctuation, drop the articles a/an/the, squeeze whitespace.
Unicode letters and non-ASCII punctuation are kept, exactly as there.

Where we differ, on purpose:
- We score the **response only**. Search-R1 decodes prompt + response and so needs two ``<answer>`` matches
  (the prompt's instruction holds the example ``<answer> Beijing </answer>``); ``extract_solution`` here takes
  the last complete answer of the text it is given, and the trainer gives it the response.
- ``extract_solution`` takes the innermost complete answer: for ``<answer> a <answer> b </answer>`` it returns
  ``b`` (an unclosed opening tag is ignored), where Search-R1's regex returns ``a <answer> b``.
- Scores are floats (Search-R1 returns the int 0 when there is no answer).
- Goldens may also be a numpy array (what a parquet ``list<string>`` column reads back as) or a tuple.
"""
from __future__ import annotations

import re
import string
from collections import Counter
from typing import Mapping

from megatron_searchr1.data.prompts import ANSWER_END, ANSWER_START

_PUNCTUATION = frozenset(string.punctuation)  # ASCII only, as in SQuAD's evaluator
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_OPEN, _CLOSE = re.escape(ANSWER_START), re.escape(ANSWER_END)
# an opening tag, then text holding neither tag, then a closing tag
_COMPLETE_ANSWER = re.compile(f"{_OPEN}((?:(?!{_OPEN}|{_CLOSE}).)*){_CLOSE}", re.DOTALL)


def normalize_answer(s: str) -> str:
    """Lower-case, strip ASCII punctuation, drop articles, squeeze whitespace (in that order).

    >>> normalize_answer("The  Eiffel-Tower!")
    'eiffeltower'
    >>> normalize_answer("  A Tale of Two Cities ")
    'tale of two cities'
    >>> normalize_answer("Café « Zürich »")  # unicode letters and non-ASCII punctuation survive
    'café « zürich »'
    """
    text = s.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def golden_list(golden_answers) -> list[str]:
    """A str (one golden), or any iterable of them (list, tuple, numpy array) -> list of str.

    >>> import numpy as np; golden_list("Paris"), golden_list(np.array(["a", "b"])), golden_list(("x",))
    (['Paris'], ['a', 'b'], ['x'])
    """
    if isinstance(golden_answers, str):  # numpy.str_ is a str too
        return [golden_answers]
    if hasattr(golden_answers, "tolist"):  # numpy array: .tolist() gives plain Python str
        golden_answers = golden_answers.tolist()
        if isinstance(golden_answers, str):  # a 0-d array
            return [golden_answers]
    return [str(g) for g in golden_answers]


def em_check(prediction: str, golden_answers) -> int:
    """1 if the normalised prediction equals any normalised golden answer, else 0.

    >>> em_check("the Beatles", ["Beatles", "The Fab Four"])
    1
    >>> em_check("Beatles.", "beatles")
    1
    >>> em_check("The Beatles band", ["Beatles"])
    0
    """
    pred = normalize_answer(prediction)
    return int(any(normalize_answer(g) == pred for g in golden_list(golden_answers)))


def subem_check(prediction: str, golden_answers) -> int:
    """1 if any normalised golden answer is a substring of the normalised prediction, else 0.

    >>> subem_check("The Beatles band", ["Beatles"])
    1
    >>> subem_check("Beat", "Beatles")
    0
    """
    pred = normalize_answer(prediction)
    return int(any(normalize_answer(g) in pred for g in golden_list(golden_answers)))


def _token_f1(prediction: str, golden: str) -> float:
    pred_toks, gold_toks = normalize_answer(prediction).split(), normalize_answer(golden).split()
    if not pred_toks or not gold_toks:  # SQuAD: two empty answers agree, one empty answer scores 0
        return float(pred_toks == gold_toks)
    same = sum((Counter(pred_toks) & Counter(gold_toks)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_toks), same / len(gold_toks)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, golden_answers) -> float:
    """SQuAD token F1 between the normalised prediction and each golden answer; the best one.

    >>> f1_score("Paris France", ["Paris"])  # precision 1/2, recall 1/1
    0.6666666666666666
    >>> f1_score("the Paris", ["Lyon", "paris"])
    1.0
    >>> f1_score("Lyon", "Paris")
    0.0
    """
    return max((_token_f1(prediction, g) for g in golden_list(golden_answers)), default=0.0)


def extract_solution(response: str) -> str | None:
    """The stripped text of the last complete ``<answer>...</answer>`` in `response`; None if there is none.

    A complete answer is an opening tag and the next closing tag with no other answer tag between them, so an
    unclosed ``<answer>`` or a stray ``</answer>`` never swallows text. Pass the response alone: the prompt's
    example answer must not count.

    >>> extract_solution("<answer> Paris </answer> then <answer>Lyon</answer>")
    'Lyon'
    >>> extract_solution("<answer> Paris </answer> then <answer> Lyon")  # unclosed: ignored
    'Paris'
    >>> extract_solution("<answer> Paris <answer> Lyon </answer>")
    'Lyon'
    >>> extract_solution("<think> no answer yet </think>") is None
    True
    """
    matches = _COMPLETE_ANSWER.findall(response)
    return matches[-1].strip() if matches else None


def ground_truth_targets(ground_truth: Mapping) -> list[str]:
    """The golden answers of a row's ``reward_model.ground_truth`` (``{"target": [...]}``); a ValueError otherwise.

    >>> ground_truth_targets({"target": "Paris"})
    ['Paris']
    """
    if not isinstance(ground_truth, Mapping) or "target" not in ground_truth:
        raise ValueError(
            f"ground_truth must be a dict with a 'target' key (Search-R1's reward_model.ground_truth), "
            f"got {ground_truth!r}"
        )
    return golden_list(ground_truth["target"])


def compute_score_em(response: str, ground_truth: Mapping, format_score: float = 0.0, score: float = 1.0) -> float:
    """`score` if the response's answer matches a target exactly (normalised), `format_score` if it answered
    wrongly, 0 if it gave no complete answer. ``ground_truth = {"target": [...]}`` (list, numpy array or str).

    >>> compute_score_em("<think> x </think> <answer> Paris </answer>", {"target": ["paris"]})
    1.0
    >>> compute_score_em("<answer> Lyon </answer>", {"target": "Paris"}, format_score=0.1)
    0.1
    >>> compute_score_em("I think it is Paris", {"target": ["Paris"]}, format_score=0.1)
    0.0
    """
    answer = extract_solution(response)
    if answer is None:
        return 0.0
    return float(score) if em_check(answer, ground_truth_targets(ground_truth)) else float(format_score)


def compute_score_subem(response: str, ground_truth: Mapping, format_score: float = 0.0, score: float = 1.0) -> float:
    """As `compute_score_em`, with a substring match (a target inside the answer) instead of equality.

    >>> compute_score_subem("<answer> Paris, France </answer>", {"target": ["Paris"]})
    1.0
    """
    answer = extract_solution(response)
    if answer is None:
        return 0.0
    return float(score) if subem_check(answer, ground_truth_targets(ground_truth)) else float(format_score)


def compute_score_f1(response: str, ground_truth: Mapping) -> float:
    """Token F1 of the response's answer against the best target; 0 without a complete answer (a metric for
    validation, softer than EM).

    >>> compute_score_f1("<answer> Paris France </answer>", {"target": ["Paris"]})
    0.6666666666666666
    """
    answer = extract_solution(response)
    return 0.0 if answer is None else f1_score(answer, ground_truth_targets(ground_truth))


__all__ = [
    "normalize_answer", "em_check", "subem_check", "f1_score", "extract_solution",
    "compute_score_em", "compute_score_subem", "compute_score_f1", "golden_list", "ground_truth_targets",
]
