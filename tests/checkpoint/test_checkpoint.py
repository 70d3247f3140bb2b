"""megatron_searchr1/checkpoint.py: atomic save, `latest`, keep_last, stale-save cleanup and RNG/scheduler/extra
restore in one process (fast); and at TP=2 under torchrun (slow): models, optimizer state, scheduler, RNG and extra
come back exactly into fresh objects, a rank SIGKILLed mid-save leaves the previous checkpoint loadable, the
actor subdirectory converts to Hugging Face with checkpoints_convert/megatron_to_hf.py, and a save into a full disk
fails on both ranks with one line (test_disk_full.py has the rest of the full-disk behaviour)."""
import json
import os
import random

import numpy as np
import pytest
import torch

from megatron_searchr1.checkpoint import (
    LATEST_FILE, CheckpointError, latest_step, load_checkpoint, save_checkpoint, step_dir,
)
from megatron_searchr1.checkpoint import space as checkpoint_space
from tests.checkpoint.small_fs import small_fs
from tests.checkpoints_convert.cli_utils import MEGATRON_TO_HF, run_cli, tiny
from tests.dist_utils import REPO, run_torchrun

SCRIPT = REPO / "tests" / "checkpoint" / "checkpoint_script.py"


def _sched(lr=0.1):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _draws():
    return random.random(), float(np.random.rand()), torch.rand(3)


def test_save_load_scheduler_extra_and_rng_in_one_process(tmp_path):
    root = str(tmp_path / "ckpt")
    sched = _sched()
    for _ in range(3):
        sched.step()
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    path = save_checkpoint(root, 3, {}, {}, {"actor": sched}, {"cursor": 12, "kl": {"value": 0.5}})
    assert path == step_dir(root, 3) and latest_step(root) == 3
    expected = _draws()

    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    fresh = _sched()
    extra = load_checkpoint(root, "latest", {}, {}, {"actor": fresh})
    assert extra == {"cursor": 12, "kl": {"value": 0.5}, "step": 3}
    assert fresh.state_dict() == sched.state_dict() and fresh.last_epoch == 3
    got = _draws()
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


def test_latest_keep_last_and_crashed_saves(tmp_path):
    root = str(tmp_path / "ckpt")
    assert latest_step(root) is None
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_checkpoint(root, "latest", {}, {}, {})
    for step in (1, 2):
        save_checkpoint(root, step, {}, {}, {}, {"at": step})
    # a save of step 3 that died half way: a .tmp tree without the marker, `latest` untouched
    os.makedirs(os.path.join(root, "step_000003.tmp", "actor"))
    open(os.path.join(root, "step_000003.tmp", "actor", "__0_0.distcp"), "wb").write(b"partial")
    assert latest_step(root) == 2
    assert load_checkpoint(root, "latest", {}, {}, {}) == {"at": 2, "step": 2}
    with pytest.raises(CheckpointError, match=r"no complete checkpoint for step 3 .* complete steps: \[1, 2\]"):
        load_checkpoint(root, 3, {}, {}, {})
    # the next save removes the stale tree and prunes to keep_last
    save_checkpoint(root, 4, {}, {}, {}, {"at": 4}, keep_last=2)
    assert sorted(os.listdir(root)) == [LATEST_FILE, "step_000002", "step_000004"]
    assert load_checkpoint(root, 2, {}, {}, {}) == {"at": 2, "step": 2}
    # `latest` naming a checkpoint that is gone: fall back to the newest complete one
    with open(os.path.join(root, LATEST_FILE), "w") as f:
        f.write("9\n")
    assert latest_step(root) == 4
    # saving a step again replaces it
    save_checkpoint(root, 4, {}, {}, {}, {"at": "again"})
    assert load_checkpoint(root, "latest", {}, {}, {})["at"] == "again"
    assert not any(n.endswith(".tmp") for n in os.listdir(root))


def test_bad_arguments(tmp_path):
    root = str(tmp_path)
    with pytest.raises(CheckpointError, match="keep_last must be >= 1"):
        save_checkpoint(root, 1, {}, {}, {}, keep_last=0)
    with pytest.raises(CheckpointError, match=r"optimizer\(s\) \['critic'\] have no model"):
        save_checkpoint(root, 1, {}, {"critic": object()}, {})
    with pytest.raises(CheckpointError, match=r"hf_dirs\['actor'\] = .* has no config.json"):
        save_checkpoint(root, 1, {"actor": object()}, {}, {}, hf_dirs={"actor": root})
    save_checkpoint(root, 1, {}, {}, {})
    with pytest.raises(CheckpointError, match=r"has no schedulers \['actor'\]"):
        load_checkpoint(root, 1, {}, {}, {"actor": _sched()})


@pytest.mark.slow
def test_tp2_save_crash_load_and_convert(tmp_path):
    from safetensors.torch import load_file

    hf_dir = tiny(tmp_path / "hf")
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    common = ["--hf-dir", hf_dir, "--root", root, "--out", out]
    run_torchrun(SCRIPT, 2, "--mode", "save", *common)
    assert latest_step(str(root)) == 5

    # rank 1 is SIGKILLed inside the save of step 6: step 5 stays the latest, complete checkpoint
    with pytest.raises(AssertionError, match="torchrun failed"):
        run_torchrun(SCRIPT, 2, "--mode", "crash", *common)
    assert os.path.isdir(root / "step_000006.tmp") and not os.path.exists(root / "step_000006")
    assert (root / LATEST_FILE).read_text().strip() == "5" and latest_step(str(root)) == 5

    # the actor subdirectory is a converter checkpoint as is
    rc, log = run_cli(MEGATRON_TO_HF, "--ckpt-dir", root / "step_000005" / "actor", "--out-dir", tmp_path / "hf_out")
    assert rc == 0, log
    exported, expected = load_file(str(tmp_path / "hf_out" / "model.safetensors")), torch.load(out / "actor_hf.pt")
    assert set(exported) == set(expected)
    for name, t in expected.items():
        assert torch.equal(exported[name], t), name

    # fresh models and optimizer at TP=2 get everything back (the script asserts and writes load_rank{r}.ok),
    # then save step 7 with keep_last=1, which clears the crashed save and step 5
    # ... and then (--full-root) a save of step 8 into a disk too small for it and the shared-directory check on
    # that disk filled up fail on both ranks with one storage line each, leaving nothing behind
    full = tmp_path / "full"
    with small_fs(full, 256 * 1024) as mounted:
        inject = [] if mounted else ["--inject-enospc"]  # no tmpfs: rank 1's write fails with ENOSPC instead
        run_torchrun(SCRIPT, 2, "--mode", "load", *common, "--full-root", full / "ckpt", *inject)
        assert (out / "load_rank0.ok").exists() and (out / "load_rank1.ok").exists()
        messages = [(out / f"full_rank{r}.txt").read_text().split("\n") for r in (0, 1)]
        assert messages[0] == messages[1] and len(messages[0]) == (2 if mounted else 1), messages
        assert "no space left on the device" in messages[0][0] and str(full / "ckpt") in messages[0][0]
        assert "step_000008.tmp was removed, no earlier checkpoint exists" in messages[0][0]
        assert os.listdir(full / "ckpt") == []  # no partial save, no marker, the filler removed by the script
        if mounted:
            assert "checking trainer.output_dir" in messages[0][1] and "no space left" in messages[0][1]
            assert checkpoint_space.dir_size(str(root / "step_000007")) > 256 * 1024  # the disk was too small
    assert sorted(os.listdir(root)) == [LATEST_FILE, "step_000007"]
    # saved through the roles (save_roles): the dict API's layout, the critic without optimizer or schedule
    marker = json.loads((root / "step_000007" / "checkpoint.json").read_text())
    assert (marker["models"], marker["optimizers"], marker["schedulers"]) == (["actor", "critic"], ["actor"], ["actor"])
    assert sorted(os.listdir(root / "step_000007")) == ["actor", "checkpoint.json", "critic", "optimizer", "rng",
                                                        "trainer_state.pt"]


def test_resume_target(tmp_path):
    from megatron_searchr1.checkpoint import resume_target

    root = str(tmp_path / "checkpoints")
    assert resume_target("disable", root) is None
    assert resume_target("auto", root) is None  # nothing saved yet: start fresh
    step_dir = tmp_path / "other_run" / "checkpoints" / "step_000012"
    step_dir.mkdir(parents=True)
    assert resume_target(str(step_dir), root) == (str(step_dir.parent), 12)
    from megatron_searchr1.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="not a step directory"):
        resume_target(str(tmp_path / "other_run"), root)
