"""Rule rewards for QA with search, chosen by a row's ``data_source`` (Search-R1's ``_select_rm_score_fn``).

Every scorer takes ``(response, ground_truth, **kw)``: the decoded **response** (never prompt + response; see
``qa_em``) and the row's ``reward_model.ground_truth`` (``{"target": [...]}``). Search-R1's QA sources and our
synthetic world (``synthetic`` or ``synthetic_<h>hop``) all score by exact match; `kind` picks a variant:
``em`` (default), ``subem``, ``em_format`` (``qa_em_format``: partial credit for a well-formed search protocol)
or ``f1`` (token F1, for validation metrics).

>>> compute_score("nq", "<think> t </think> <answer> Paris </answer>", {"target": ["Paris"]})
1.0
>>> compute_score("synthetic_2hop", "<answer> Lyon </answer>", {"target": ["Paris"]})
0.0
"""
from __future__ import annotations

import re
from typing import Callable, Mapping

from megatron_searchr1.reward import qa_em, qa_em_format
from megatron_searchr1.reward.qa_em import (
    compute_score_em, compute_score_f1, compute_score_subem, em_check, extract_solution, f1_score, normalize_answer,
    subem_check,
)
from megatron_searchr1.reward.qa_em_format import is_retrieval_correct, is_valid_sequence

# Search-R1's QA benchmarks (its main_ppo routes the first seven; its format variant adds the last two).
QA_SOURCES = (
    "nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle", "web_questions", "strategyqa",
)
# Our synthetic world names its rows `synthetic_<hops>hop` (data/synthetic.py) so metrics split by hop count.
_SYNTHETIC = re.compile(r"synthetic(_\d+hop)?")

SCORERS: dict[str, Callable[..., float]] = {
    "em": qa_em.compute_score_em,
    "subem": qa_em.compute_score_subem,
    "em_format": qa_em_format.compute_score_em,
    "f1": qa_em.compute_score_f1,
}


def get_reward_fn(data_source: str, kind: str = "em") -> Callable[..., float]:
    """The scorer ``fn(response, ground_truth, **kw) -> float`` for rows of `data_source`.

    >>> get_reward_fn("hotpotqa") is compute_score_em
    True
    >>> get_reward_fn("mystery")
    Traceback (most recent call last):
    ...
    ValueError: no reward for data_source 'mystery'; known sources: nq, triviaqa, popqa, hotpotqa, \
2wikimultihopqa, musique, bamboogle, web_questions, strategyqa, synthetic (also synthetic_<h>hop)
    """
    if kind not in SCORERS:
        raise ValueError(f"unknown reward kind {kind!r}; choose one of {', '.join(SCORERS)}")
    if data_source in QA_SOURCES or _SYNTHETIC.fullmatch(data_source or ""):
        return SCORERS[kind]
    raise ValueError(
        f"no reward for data_source {data_source!r}; known sources: {', '.join(QA_SOURCES)}, "
        "synthetic (also synthetic_<h>hop)"
    )


def compute_score(data_source: str, response: str, ground_truth: Mapping, kind: str = "em", **kw) -> float:
    """Score one response with the scorer for its `data_source`; `kw` goes to the scorer (e.g. format_score)."""
    return get_reward_fn(data_source, kind)(response, ground_truth, **kw)


__all__ = [
    "QA_SOURCES", "SCORERS", "get_reward_fn", "compute_score",
    "normalize_answer", "em_check", "subem_check", "f1_score", "extract_solution",
    "compute_score_em", "compute_score_subem", "compute_score_f1", "is_valid_sequence", "is_retrieval_correct",
]
