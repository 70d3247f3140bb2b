"""Checkpoints over several nodes (megatron_searchr1/checkpoint/): the shared-output-dir check and the resume step
that rank 0 alone decides, under torchrun with 2 gloo ranks standing in for 2 nodes (several_nodes_script.py)."""
import json
import os

from tests.dist_utils import REPO, run_torchrun

SCRIPT = REPO / "tests" / "checkpoint" / "several_nodes_script.py"


def test_shared_output_dir_passes_and_cleans_up(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run_torchrun(SCRIPT, 2, "--mode", "shared", "--base", tmp_path / "run", "--out", out, timeout=120)
    assert sorted(os.listdir(out)) == ["rank0.ok", "rank1.ok"]
    assert os.listdir(tmp_path / "run") == []


def test_node_local_output_dirs_are_refused_on_every_rank(tmp_path):
    """Each rank sees only its own directory, as nodes with a node-local trainer.output_dir do: every rank raises
    one clear error naming the directory and what to change (and none waits forever for the others)."""
    out = tmp_path / "out"
    out.mkdir()
    run_torchrun(SCRIPT, 2, "--mode", "split", "--base", tmp_path / "run", "--out", out, timeout=120)
    msgs = []
    for rank in (0, 1):
        msg = (out / f"rank{rank}.err").read_text()
        assert "is not one directory shared by all 2 ranks" in msg, msg
        assert f"trainer.output_dir='{tmp_path / 'run' / f'rank{rank}'}'" in msg  # the directory, as this rank has it
        assert "shared filesystem" in msg
        msgs.append(msg.replace(f"rank{rank}'", "rankR'"))
    assert msgs[0] == msgs[1]  # one verdict: the same blind rank and missing markers on both


def test_rank0_decides_the_resume_step_for_every_rank(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run_torchrun(SCRIPT, 2, "--mode", "resume", "--base", tmp_path / "run", "--out", out, timeout=120)
    got = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    # rank 1's own root says step 1; it resumes rank 0's step 2 (on a shared filesystem the roots are one path)
    assert got[0]["target"] == got[1]["target"] == [str(tmp_path / "run" / "rank0" / "checkpoints"), 2]
    assert got[0]["bad"] and got[0]["bad"] == got[1]["bad"] and "not a step directory" in got[0]["bad"]
