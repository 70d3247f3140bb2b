"""trainer/reports.py: the evaluation table and the turn-by-turn rendering of a trajectory."""
import doctest
from types import SimpleNamespace

from megatron_searchr1.trainer import reports


def test_doctests():
    r = doctest.testmod(reports)
    assert r.attempted > 0 and r.failed == 0


def _rec(source, split, em, finish="answer"):
    return {"data_source": source, "split": split, "em": em, "subem": em, "f1": em, "searches": 1, "turns": 2,
            "length": 10, "finish": finish}


def test_summarize_eval_groups_by_source_split_and_all():
    report = reports.summarize_eval([_rec("nq", "test", 1.0), _rec("nq", "validation", 0.0, "length"),
                                     _rec("hotpotqa", "test", 1.0)])
    table = report["table"]
    assert table["all"]["n"] == 3 and table["all"]["em"] == 2 / 3
    assert table["nq"]["em"] == 0.5 and table["split:test"]["em"] == 1.0
    assert table["all"]["finish"] == {"answer": 2 / 3, "length": 1 / 3}
    assert report["metrics"]["hotpotqa/em"] == 1.0
    text = reports.format_eval_table(report, title="t")
    assert text.splitlines()[0] == "t" and "split:validation" in text


class _Tok:
    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


def test_turn_segments_split_where_the_loss_mask_changes():
    traj = SimpleNamespace(response_ids=[1, 2, 3, 4, 5], loss_mask=[1, 1, 0, 0, 1])
    assert reports.turn_segments(_Tok(), traj) == [("model", "1 2"), ("context", "3 4"), ("model", "5")]
