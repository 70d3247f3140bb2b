"""Reward routing by data_source: Search-R1's QA sources and our synthetic ones score by EM; unknown ones fail
with the list of known sources."""
import pytest

from megatron_searchr1 import reward
from megatron_searchr1.reward import qa_em, qa_em_format

SOURCES = ["nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle", "synthetic",
           "synthetic_1hop", "synthetic_3hop"]


@pytest.mark.parametrize("source", SOURCES)
def test_known_sources_score_by_em(source):
    assert reward.get_reward_fn(source) is qa_em.compute_score_em
    assert reward.compute_score(source, "<answer> the Nile </answer>", {"target": ["Nile"]}) == 1.0
    assert reward.compute_score(source, "<answer> Amazon </answer>", {"target": ["Nile"]}, format_score=0.1) == 0.1


def test_kinds():
    assert reward.get_reward_fn("nq", "subem") is qa_em.compute_score_subem
    assert reward.get_reward_fn("nq", "em_format") is qa_em_format.compute_score_em
    assert reward.get_reward_fn("nq", "f1") is qa_em.compute_score_f1
    resp = "<answer> the river Nile </answer>"
    assert reward.compute_score("nq", resp, {"target": ["Nile"]}, kind="subem") == 1.0
    assert reward.compute_score("nq", resp, {"target": ["Nile"]}, kind="f1") == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="unknown reward kind 'bleu'; choose one of em, subem, em_format, f1"):
        reward.get_reward_fn("nq", "bleu")


@pytest.mark.parametrize("source", ["NQ", "synthetic_hop", "synthetic2", "gsm8k", "", None])
def test_unknown_source_names_the_known_ones(source):
    with pytest.raises(ValueError) as err:
        reward.get_reward_fn(source)
    msg = str(err.value)
    assert f"no reward for data_source {source!r}" in msg
    for known in ("nq", "bamboogle", "2wikimultihopqa", "synthetic"):
        assert known in msg
