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


def test_resume_drops_the_rows_a_killed_run_logged_after_its_checkpoint(tmp_path):
    """A run killed during step 3's save resumes from step 2: its step-3 rows must not appear twice."""
    first = RunLogger(str(tmp_path), enabled=True)
    for step in (1, 2, 3):
        first.log(step, {"reward/mean": float(step)})
        first.trajectories(step, [{"uid": f"u{step}"}])
    with open(tmp_path / "trajectories.jsonl", "a") as f:
        f.write('{"step": 3, "uid": "torn')  # the kill cut the last line
    first.close()
    again = RunLogger(str(tmp_path), enabled=True)
    again.resume_at(2)
    again.log(3, {"reward/mean": 30.0})
    again.trajectories(3, [{"uid": "again"}])
    again.close()
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["reward/mean"]) for m in metrics] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    trajs = [json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert [t["uid"] for t in trajs] == ["u1", "u2", "again"]
    assert read_scalars(again.tb_dir)["reward/mean"] == [(1, 1.0), (2, 2.0), (3, 30.0)]


MEAN_SCRIPT = '''
import json, sys
import torch.distributed as dist
from megatron_searchr1.metrics import mean_over_ranks
dist.init_process_group("gloo")
rank = dist.get_rank()
out = mean_over_ranks({"b": 10.0 * rank, "a": 1.0 + rank})       # keys in either order: packed sorted
try:
    mean_over_ranks({"a": 1.0} if rank == 0 else {"c": 1.0})
    mismatch = "no error"
except RuntimeError as e:
    mismatch = str(e)
with open(sys.argv[1] + f".{rank}.json", "w") as f:  # a file per rank: two ranks' prints can share a line
    json.dump({"out": out, "mismatch": mismatch}, f)
dist.destroy_process_group()
'''


def test_mean_over_ranks_averages_over_two_gloo_ranks(tmp_path):
    """Two real processes (torchrun, gloo): every rank gets the mean of each key; ranks with different keys raise
    (a rank missing a metric is a bug, not something to average)."""
    from tests.dist_utils import run_torchrun

    script = tmp_path / "mean_script.py"
    script.write_text(MEAN_SCRIPT)
    run_torchrun(script, 2, str(tmp_path / "result"), timeout=300)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"result.{rank}.json").read_text())
        assert got["out"] == {"a": 1.5, "b": 5.0}
        assert "ranks log different metric keys" in got["mismatch"]


def test_metrics_is_a_leaf_without_megatron():
    """metrics.py follows the collectives rule through the torch-only megatron_searchr1.collectives: importing it
    loads neither megatron-core nor our Megatron glue."""
    import subprocess
    import sys

    from tests.dist_utils import REPO

    code = ("import sys, megatron_searchr1.metrics\n"
            "print(sorted(m for m in sys.modules if m.startswith(('megatron.', 'megatron_searchr1.megatron'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
