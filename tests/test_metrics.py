"""RunLogger writes TensorBoard scalars, metrics.jsonl and trajectories that read back as written."""
import json

from megatron_searchr1.metrics import RunLogger, mean_over_ranks, read_scalars


def test_logger_round_trip(tmp_path):
    log = RunLogger(str(tmp_path), enabled=True)
    log.log(1, {"reward/mean": 0.25, "actor/pg_loss": -0.5})
    log.log(2, {"reward/mean": 0.75, "actor/pg_loss": -0.25})
    lines = []
    log.console(2, 10, {"reward/mean": 0.75, "actor/pg_loss": -0.25}, write=lines.append)
    log.trajectories(2, [{"uid": "a", "response": "<answer> x </answer>"}])
    log.close()
    scalars = read_scalars(log.tb_dir)
    assert scalars["reward/mean"] == [(1, 0.25), (2, 0.75)]
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[1])["actor/pg_loss"] == -0.25
    assert json.loads((tmp_path / "trajectories.jsonl").read_text())["uid"] == "a"
    assert lines[0].startswith("step 2/10 reward=0.75 pg_loss=-0.25")
    off = RunLogger(str(tmp_path / "off"), enabled=False)
    off.log(1, {"x": 1.0})
    assert not (tmp_path / "off").exists()
    assert mean_over_ranks({"a": 1.0}) == {"a": 1.0}  # a world of one (no process group)
