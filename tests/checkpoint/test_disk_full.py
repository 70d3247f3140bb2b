"""A full (or read-only) output directory: a failed save removes its partial `.tmp` and raises one
CheckpointStorageError line (a UsageError, so the entry points print `error: ...`) with the path, the free space and
what a checkpoint needs; crashed saves' trees are removed at start; the shared-directory check turns OS errors into
one line and leaves no marker; keep_last prunes before a save when space is short. On a small tmpfs where mounting
is permitted (real ENOSPC from torch.save), else by injecting the OSError. The save of a real model into a full
disk under torchrun is in test_checkpoint.py's TP=2 test (checkpoint_script.py --full-root)."""
import errno
import os

import pytest
import torch

from megatron_searchr1 import checkpoint as ckpt
from megatron_searchr1.checkpoint import space as checkpoint_space
from megatron_searchr1.checkpoint import (
    LATEST_FILE, CheckpointStorageError, agreed_resume_target, check_shared_dir, latest_step, save_checkpoint,
)
from megatron_searchr1.cli import UsageError
from tests.checkpoint.small_fs import small_fs

KB = 1024


def _blob(n):
    return {"blob": torch.randint(0, 255, (n,), dtype=torch.uint8)}  # n bytes on disk (bytes would pickle larger)


def _inject_enospc(monkeypatch, when):
    """torch.save raises ENOSPC for paths where when(path) holds (no tmpfs to fill)."""
    real = torch.save

    def save(obj, path, *a, **kw):
        if when(str(path)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(obj, path, *a, **kw)

    monkeypatch.setattr(torch, "save", save)


def test_failed_save_removes_partial_and_says_one_line(tmp_path, monkeypatch):
    fs = tmp_path / "fs"
    with small_fs(fs, 512 * KB) as mounted:
        root = str(fs / "ckpt")
        save_checkpoint(root, 1, {}, {}, {}, _blob(150 * KB))
        if not mounted:
            _inject_enospc(monkeypatch, lambda p: "step_000002.tmp" in p)
        with pytest.raises(CheckpointStorageError) as info:
            save_checkpoint(root, 2, {}, {}, {}, _blob(600 * KB))
        msg = str(info.value)
        assert isinstance(info.value, UsageError) and "\n" not in msg
        assert "no space left on the device" in msg and root in msg and "step_000002" in msg
        size1 = checkpoint_space.human(checkpoint_space.dir_size(ckpt.step_dir(root, 1)))
        assert f"free, a checkpoint needs about {size1}" in msg and "KB" in size1, msg
        assert "step 1 (complete) is untouched" in msg
        assert sorted(os.listdir(root)) == [LATEST_FILE, "step_000001"] and latest_step(root) == 1


def test_keep_last_prunes_before_the_save_when_space_is_short(tmp_path, monkeypatch):
    fs = tmp_path / "fs"
    with small_fs(fs, 1024 * KB) as mounted:
        root = str(fs / "ckpt")
        for step in (1, 2):
            save_checkpoint(root, step, {}, {}, {}, _blob(350 * KB), keep_last=2)
        present = []  # which checkpoints exist while a save writes its files
        real = torch.save

        def save(obj, path, *a, **kw):
            if ".tmp" in str(path) and "step_" in str(path):
                present.append(sorted(n for n in os.listdir(root) if not n.endswith(".tmp")))
            return real(obj, path, *a, **kw)

        monkeypatch.setattr(torch, "save", save)
        if not mounted:  # what the tmpfs would say: less free than one checkpoint
            monkeypatch.setattr(checkpoint_space, "free_bytes", lambda path: 300 * KB)
        save_checkpoint(root, 3, {}, {}, {}, _blob(350 * KB), keep_last=2)
        # step 1 went before the new files were written; the newest complete one stayed
        assert present and all(p == [LATEST_FILE, "step_000002"] for p in present), present
        assert sorted(os.listdir(root)) == [LATEST_FILE, "step_000002", "step_000003"]
        # keep_last=1 never removes the newest complete checkpoint before the save
        present.clear()
        save_checkpoint(root, 4, {}, {}, {}, _blob(350 * KB), keep_last=1)
        assert present and all(p == [LATEST_FILE, "step_000003"] for p in present), present
        assert sorted(os.listdir(root)) == [LATEST_FILE, "step_000004"]


def test_stale_saves_are_removed_at_start(tmp_path):
    root, out = str(tmp_path / "out" / "checkpoints"), str(tmp_path / "out")
    save_checkpoint(root, 2, {}, {}, {}, {"at": 2})
    for name in ("step_000003.tmp", "step_000004.tmp"):
        os.makedirs(os.path.join(root, name, "actor"))
        open(os.path.join(root, name, "actor", "__0_0.distcp"), "wb").write(b"partial")
    assert agreed_resume_target("auto", root) == (root, 2)
    assert sorted(os.listdir(root)) == [LATEST_FILE, "step_000002"]
    os.makedirs(os.path.join(root, "step_000005.tmp"))
    check_shared_dir(out, ckpt_root=root)
    assert sorted(os.listdir(root)) == [LATEST_FILE, "step_000002"]


@pytest.mark.parametrize("code,cause", [(errno.ENOSPC, "no space left on the device"),
                                        (errno.EROFS, "the filesystem is read-only"),
                                        (errno.EACCES, "permission denied")])
def test_shared_dir_check_turns_os_errors_into_one_line_and_removes_markers(tmp_path, monkeypatch, code, cause):
    out = tmp_path / "out"
    out.mkdir()
    real_open = open

    class Failing:
        """The marker file is created, then its write fails (as on a full disk: an empty file stays)."""

        def __init__(self, path, mode):
            real_open(path, mode).close()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def write(self, text):
            raise OSError(code, os.strerror(code))

    monkeypatch.setattr(ckpt, "open", Failing, raising=False)
    with pytest.raises(CheckpointStorageError) as info:
        check_shared_dir(str(out), wait_s=0.1)
    msg = str(info.value)
    assert "\n" not in msg and cause in msg and str(out) in msg and "trainer.output_dir" in msg
    assert os.listdir(out) == []


def test_shared_dir_check_on_a_full_tmpfs(tmp_path):
    fs = tmp_path / "fs"
    with small_fs(fs, 64 * KB) as mounted:
        if not mounted:
            pytest.skip("mounting a tmpfs is not permitted here; the injected variant above covers the check")
        with open(fs / "filler", "wb", buffering=0) as f:  # fill it up to the last byte
            try:
                while True:
                    f.write(b"x" * 4096)
            except OSError as e:
                assert e.errno == errno.ENOSPC
        with pytest.raises(CheckpointStorageError, match="no space left on the device"):
            check_shared_dir(str(fs))
        assert os.listdir(fs) == ["filler"]
