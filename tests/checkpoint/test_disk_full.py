"""A full (or read-only) output directory: a failed save removes its partial `.tmp` and raises one
CheckpointStorageError line (a UsageError, so the entry points print `error: ...`) with the path, the free space and
what a checkpoint needs; crashed saves' trees are removed at start; the shared-directory check turns OS errors into
one line and leaves no marker; keep_last prunes before a save when space is short. On a small tmpfs where mounting
is permitted (real ENOSPC from torch.save), else by injecting the OSError. The save of a real model into a full
disk under torchrun is in test_checkpoint.py's TP=2 test (checkpoint_script.py --full-root)."""
import errno
import json
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


# ---- the logs (metrics.py): a full disk when no checkpoint is due ------------------------------------------------
def _fill(path) -> None:
    """Write a filler file until the filesystem holding `path` refuses (ENOSPC)."""
    with open(os.path.join(path, "filler"), "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"x" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC
    with open(os.path.join(path, "filler"), "ab", buffering=0) as f:  # the last few bytes too
        try:
            while True:
                f.write(b"x")
        except OSError as e:
            assert e.errno == errno.ENOSPC


@pytest.mark.parametrize("tensorboard", [False, True])
def test_every_log_writer_turns_a_full_disk_into_one_line_and_leaves_whole_rows(tmp_path, capfd, tensorboard):
    """rank 0 crashed in metrics.py with OSError [Errno 28] while the other rank waited in a collective, and
    trajectories.jsonl kept a cut row. Now each writer (metrics.jsonl, trajectories, TensorBoard) remembers the
    refusal, writes nothing more, cuts a partial row back off, and raise_if_failed raises one LogStorageError line
    (a UsageError: `error:`, exit 2). TensorBoard's writer thread prints no traceback."""
    from megatron_searchr1.metrics import LogStorageError, RunLogger

    fs = tmp_path / "fs"
    with small_fs(fs, 256 * KB) as mounted:
        if not mounted:
            pytest.skip("mounting a tmpfs is not permitted here")
        logger = RunLogger(str(fs), enabled=True, tensorboard=tensorboard)
        logger.log(1, {"reward/mean": 0.5})
        logger.trajectories(1, [{"uid": "a", "response": "r" * 100}])
        logger.raise_if_failed()  # nothing failed yet
        _fill(str(fs))
        if tensorboard:  # TensorBoard writes first (from its thread; the flush re-raises here)
            logger.log(2, {"reward/mean": 0.7, **{f"x/{i}": float(i) for i in range(200)}})
            logger.trajectories(2, [{"uid": "b", "response": "r" * 4000}])
        else:
            os.truncate(fs / "filler", os.path.getsize(fs / "filler") - 300)  # room for part of a row, not a whole one
            logger.trajectories(2, [{"uid": "b", "response": "r" * 4000}])
            logger.log(2, {"reward/mean": 0.7})
        logger.append("val_report.jsonl", [{"step": 2, "x": "y" * 4000}])
        with pytest.raises(LogStorageError) as info:
            logger.raise_if_failed()
        line = str(info.value)
        assert isinstance(info.value, UsageError) and "\n" not in line, line
        first = str(fs / "tensorboard") if tensorboard else str(fs / "trajectories.jsonl")
        assert line.startswith(f"writing the run's logs failed: no space left on the device ({first}: "), line
        assert "free); free space there or put trainer.output_dir on a larger filesystem" in line
        logger.close()
        for name in ("metrics.jsonl", "trajectories.jsonl"):
            rows = [json.loads(ln) for ln in open(fs / name)]  # every row whole
            assert [r["step"] for r in rows] == [1], (name, rows)
        assert not os.path.exists(fs / "val_report.jsonl") or not open(fs / "val_report.jsonl").read()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err, err


def test_a_torn_last_row_is_cut_when_a_run_opens_its_logs(tmp_path):
    """A run killed mid-row (or an older run on a full disk) left half a row: the next run appended to it and the
    file no longer parsed. Opening the logs (a resume or a fresh run in the same directory) cuts it first."""
    from megatron_searchr1.metrics import RunLogger

    out = tmp_path / "run"
    out.mkdir()
    (out / "trajectories.jsonl").write_text('{"step": 1, "uid": "a"}\n{"step": 2, "uid": "b", "resp')
    (out / "metrics.jsonl").write_text('{"step": 1, "x": 1}\n')
    (out / "val_trajectories.jsonl").write_text('{"step": 1, "uid"')  # torn first row: the file becomes empty
    logger = RunLogger(str(out), enabled=True, tensorboard=False)  # no resume_at: no checkpoint to resume from
    logger.trajectories(2, [{"uid": "c"}])
    logger.trajectories(2, [{"uid": "d"}], name="val_trajectories.jsonl")
    assert [json.loads(ln)["uid"] for ln in open(out / "trajectories.jsonl")] == ["a", "c"]
    assert [json.loads(ln)["uid"] for ln in open(out / "val_trajectories.jsonl")] == ["d"]
    assert open(out / "metrics.jsonl").read() == '{"step": 1, "x": 1}\n'


def test_a_resume_onto_a_disk_still_full_is_refused_at_start_up(tmp_path, monkeypatch):
    """The resumed run trained a step before failing the same save again: free space (plus what keep_last would
    prune before the save) below the size of the checkpoint resumed from is refused at start-up, on every rank."""
    fs = tmp_path / "fs"
    with small_fs(fs, 1024 * KB) as mounted:
        root = str(fs / "ckpt")
        save_checkpoint(root, 1, {}, {}, {}, _blob(300 * KB))
        size = checkpoint_space.dir_size(ckpt.step_dir(root, 1))
        assert agreed_resume_target("auto", root, keep_last=1, check_room=True) == (root, 1)  # room enough
        if mounted:
            _fill(str(fs))
        else:
            monkeypatch.setattr(checkpoint_space, "free_bytes", lambda path: 10 * KB)
        assert checkpoint_space.free_bytes(root) < size
        for keep_last, advice in ((1, "free space there or put trainer.output_dir on a larger filesystem"),
                                  (3, "free space there, lower trainer.keep_last (now 3), or put")):
            with pytest.raises(CheckpointStorageError) as info:
                agreed_resume_target("auto", root, keep_last=keep_last, check_room=True)
            msg = str(info.value)
            assert "\n" not in msg and f"resuming from checkpoint step 1 in {root} (its next save will not fit)" in msg
            assert f"a checkpoint needs about {checkpoint_space.human(size)} (the size of step 1's checkpoint)" in msg
            assert advice in msg and (keep_last > 1 or "keep_last" not in msg), msg
        assert agreed_resume_target("auto", root) == (root, 1)  # without check_room (evaluation): as before


def test_what_keep_last_would_prune_before_the_save_counts_as_room(tmp_path, monkeypatch):
    root = str(tmp_path / "ckpt")
    for step in (1, 2):
        save_checkpoint(root, step, {}, {}, {}, _blob(100 * KB))
    size = checkpoint_space.dir_size(ckpt.step_dir(root, 2))
    monkeypatch.setattr(checkpoint_space, "free_bytes", lambda path: size // 2)
    assert agreed_resume_target("auto", root, keep_last=2, check_room=True) == (root, 2)  # step 1 goes first
    with pytest.raises(CheckpointStorageError, match="its next save will not fit"):
        agreed_resume_target("auto", root, keep_last=3, check_room=True)  # keeps both: no room


def test_a_failed_save_at_keep_last_1_does_not_advise_lowering_it(tmp_path, monkeypatch):
    fs = tmp_path / "fs"
    with small_fs(fs, 512 * KB) as mounted:
        root = str(fs / "ckpt")
        save_checkpoint(root, 1, {}, {}, {}, _blob(150 * KB), keep_last=1)
        if not mounted:
            _inject_enospc(monkeypatch, lambda p: "step_000002.tmp" in p)
        with pytest.raises(CheckpointStorageError) as info:
            save_checkpoint(root, 2, {}, {}, {}, _blob(600 * KB), keep_last=1)
        assert "keep_last" not in str(info.value) and "free space there or put trainer.output_dir" in str(info.value)
        with pytest.raises(CheckpointStorageError) as info:
            save_checkpoint(root, 2, {}, {}, {}, _blob(600 * KB), keep_last=3)
        assert "lower trainer.keep_last (now 3)" in str(info.value)
