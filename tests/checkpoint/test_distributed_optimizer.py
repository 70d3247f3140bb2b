"""The distributed optimizer's checkpoints (parallel.use_distributed_optimizer, the GPU recipes' setting), saved in
the dp_reshardable layout: a fresh optimizer restores weights, Adam moments, fp32 shards and LR, the next step
equals the uninterrupted run's bit for bit (each parameter keeps its own Adam step: checkpoint/optimizer.py), and
another TP is refused with a message."""
import json
import os

import pytest

from tests.dist_utils import run_torchrun

SCRIPT = os.path.join(os.path.dirname(__file__), "distopt_script.py")


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("distopt")
    ckpt, out = root / "ckpt", root / "out"
    out.mkdir()
    run_torchrun(SCRIPT, 2, "save", ckpt, out)
    run_torchrun(SCRIPT, 2, "load", ckpt, out)
    return ckpt, out


@pytest.mark.slow
def test_distributed_optimizer_saves_and_restores_its_state(resumed):
    ckpt, out = resumed
    for rank in (0, 1):
        restored = json.loads((out / f"restored_rank{rank}.json").read_text())
        assert restored == {"params": True, "adam": True, "main": True, "lr": True}
    run_torchrun(SCRIPT, 2, "load", ckpt, out, 2)
    for rank in (0, 1):
        text = (out / f"refused_rank{rank}.txt").read_text()
        assert "saved at tp=1 pp=1" in text and "this run has tp=2 pp=1" in text


@pytest.mark.slow
def test_distributed_optimizer_resume_is_bit_exact(resumed):
    _, out = resumed
    for rank in (0, 1):
        assert json.loads((out / f"next_step_rank{rank}.json").read_text())["equal"]
