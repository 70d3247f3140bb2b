"""EM with a format reward, under Search-R1's names (``verl/utils/reward_score/qa_em_format.py``).

A response earns partial credit for following the search protocol even when its answer is wrong:

    <think> ... </think> ( <search> ... </search> <information> ... </information> <think> ... </think> )*
    <answer> ... </answer>

with nothing but whitespace between the tags. ``is_valid_sequence`` walks the response through that grammar as a
small state machine; ``is_retrieval_correct`` asks whether some ``<information>`` block contains a golden answer.
``compute_score_em`` combines them with the same outcomes and keyword names as Search-R1's (structure, retrieval,
final-format and answer scores; see its docstring for the table).

Where we differ, on purpose:
- Search-R1 checks the text after ``<|im_start|>assistant`` (it decodes prompt + response; a Qwen chat marker
  must be present). We take the **response only**, so no marker is needed and any chat template works.
  Decode the response without special tokens: a trailing ``<|im_end|>`` is text after ``</answer>``, and text
  after the answer makes a sequence invalid here as there.
- A str golden is one answer here (Search-R1's retrieval check iterates over its characters).
"""
from __future__ import annotations

import re
from typing import Mapping

from megatron_searchr1.data.prompts import (
    ANSWER_END, ANSWER_START, INFO_END, INFO_START, SEARCH_END, SEARCH_START, THINK_END, THINK_START,
)
from megatron_searchr1.reward.qa_em import (
    em_check, extract_solution, golden_list, ground_truth_targets, normalize_answer,
)

_TAGS = (THINK_START, THINK_END, SEARCH_START, SEARCH_END, INFO_START, INFO_END, ANSWER_START, ANSWER_END)
_TAG_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in _TAGS) + ")")
_INFO_BLOCK = re.compile(re.escape(INFO_START) + "(.*?)" + re.escape(INFO_END), re.DOTALL)

# (state, tag) -> next state. States outside a tag ("start", "thought", "searched", "observed") allow only
# whitespace as text; states inside one allow any text; "done" allows nothing more.
_TRANSITIONS = {
    ("start", THINK_START): "in_think",
    ("observed", THINK_START): "in_think",
    ("in_think", THINK_END): "thought",
    ("thought", SEARCH_START): "in_search",
    ("in_search", SEARCH_END): "searched",
    ("searched", INFO_START): "in_information",
    ("in_information", INFO_END): "observed",
    ("thought", ANSWER_START): "in_answer",
    ("in_answer", ANSWER_END): "done",
}
_INSIDE = {"in_think", "in_search", "in_information", "in_answer"}


def is_valid_sequence(response: str) -> tuple[bool, str]:
    """Whether `response` follows think -> (search -> information -> think)* -> answer; and why not.

    >>> is_valid_sequence("<think> a </think>\\n<search> q </search>\\n\\n<information> d </information>\\n\\n"
    ...                   "<think> b </think>\\n<answer> x </answer>")
    (True, 'valid')
    >>> is_valid_sequence("<think> a </think> <answer> x </answer>")
    (True, 'valid')
    >>> is_valid_sequence("<answer> x </answer>")  # no thought first
    (False, "unexpected tag '<answer>' in state 'start'")
    >>> is_valid_sequence("<think> a </think> so: <answer> x </answer>")
    (False, "unexpected text 'so:' in state 'thought'")
    >>> is_valid_sequence("<think> a </think><search> q </search>")
    (False, "incomplete: ended in state 'searched'")
    """
    for open_tag, close_tag in zip(_TAGS[::2], _TAGS[1::2]):
        n_open, n_close = response.count(open_tag), response.count(close_tag)
        if n_open != n_close:
            return False, f"{n_open} {open_tag} vs {n_close} {close_tag}"
    state = "start"
    for part in _TAG_SPLIT.split(response):
        if not part.strip():
            continue
        if part in _TAGS:
            nxt = _TRANSITIONS.get((state, part))
            if nxt is None:
                return False, f"unexpected tag {part!r} in state {state!r}"
            state = nxt
        elif state not in _INSIDE:
            return False, f"unexpected text {part.strip()!r} in state {state!r}"
    if state != "done":
        return False, f"incomplete: ended in state {state!r}"
    return True, "valid"


def extract_information_blocks(text: str) -> list[str]:
    """The stripped contents of every ``<information>`` block, in order.

    >>> extract_information_blocks("<information> d1 </information> x <information>d2</information>")
    ['d1', 'd2']
    """
    return [m.strip() for m in _INFO_BLOCK.findall(text)]


def is_retrieval_correct(text: str, golden_answers) -> bool:
    """True if some ``<information>`` block contains a golden answer (both normalised).

    >>> is_retrieval_correct("<information> Doc 1(Title: Paris) The capital. </information>", ["paris"])
    True
    >>> is_retrieval_correct("<information> Lyon </information>", "Paris")
    False
    """
    goldens = [normalize_answer(g) for g in golden_list(golden_answers)]
    return any(g in normalize_answer(block) for block in extract_information_blocks(text) for g in goldens)


def compute_score_em(
    response: str,
    ground_truth: Mapping,
    structure_format_score: float = 0.0,
    final_format_score: float = 0.0,
    retrieval_score: float = 0.0,
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """EM reward with format credit, Search-R1's outcomes (its paper's values in brackets: 0.2, 0.1, 0.1):

    ======================  ==============  ============================================
    answer                  valid format    reward
    ======================  ==============  ============================================
    correct                 yes             score
    correct                 no              score - structure_format_score
    wrong or missing        yes             structure_format_score (+ retrieval_score if
                                            an <information> block holds a golden answer)
    wrong                   no              final_format_score
    missing                 no              0
    ======================  ==============  ============================================

    `format_score` is accepted (the reward manager passes it) and unused, as in Search-R1.

    >>> good = "<think> t </think><search> q </search><information> Paris is big </information>"
    >>> kw = dict(structure_format_score=0.2, final_format_score=0.1, retrieval_score=0.1)
    >>> compute_score_em(good + "<think> t </think><answer> Paris </answer>", {"target": ["Paris"]}, **kw)
    1.0
    >>> round(compute_score_em(good + "<think> t </think><answer> Lyon </answer>", {"target": ["Paris"]}, **kw), 6)
    0.3
    >>> compute_score_em("<answer> Lyon </answer>", {"target": ["Paris"]}, **kw)
    0.1
    """
    del format_score
    targets = ground_truth_targets(ground_truth)
    valid, _ = is_valid_sequence(response)
    answer = extract_solution(response)
    if answer is not None and em_check(answer, targets):
        return float(score) if valid else float(score - structure_format_score)
    if valid:
        bonus = retrieval_score if is_retrieval_correct(response, targets) else 0.0
        return float(structure_format_score + bonus)
    return 0.0 if answer is None else float(final_format_score)
