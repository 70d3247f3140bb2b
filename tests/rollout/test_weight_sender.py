"""WeightSender's thread (rollout/remote_sync.py) against a recording process group: every rollout rank still there
hears STOP, also after sending weights to another one failed (a rank waiting for weights would wait for ever)."""
from __future__ import annotations

import pickle

import torch

from megatron_searchr1.rollout.remote_sync import STOP, Bridge, RolePlan, WeightSender


class _Done:
    def __init__(self, error: Exception | None = None):
        self.error = error

    def wait(self):
        if self.error is not None:
            raise self.error


class RecordingGroup:
    """send() keeps each dst's byte stream; sends to a dead dst fail as gloo's do when the peer closed."""

    def __init__(self, dead: set[int]):
        self.dead, self.sent = dead, {}

    def send(self, tensors, dst, tag):
        if dst in self.dead:
            return _Done(RuntimeError(f"Connection closed by peer {dst}"))
        self.sent.setdefault(dst, []).append(tensors[0].clone())
        return _Done()


def objects(chunks: list[torch.Tensor]) -> list:
    """The objects send_object wrote (a length tensor, then that many bytes), bucket tensors skipped by length."""
    out, i = [], 0
    while i + 1 < len(chunks):
        n, data = chunks[i], chunks[i + 1]
        if n.dtype == torch.int64 and data.dtype == torch.uint8 and data.numel() == int(n.item()):
            try:
                out.append(pickle.loads(data.numpy().tobytes()))
                i += 2
                continue
            except Exception:  # noqa: BLE001 (a weight bucket, not an object)
                pass
        i += 1
    return out


def sender_with(pg: RecordingGroup, rollout_ranks: int) -> WeightSender:
    plan = RolePlan(world=1 + rollout_ranks, rollout_ranks=rollout_ranks)
    return WeightSender(Bridge(plan=plan, rank=0, weights=pg), bucket_bytes=1 << 20, dtype=None)


def queue(sender: WeightSender, version: int) -> None:
    with sender._cond:  # what send() queues after gathering: one bucket of raw bytes
        sender._pending = [(version, [("layout", torch.zeros(8, dtype=torch.uint8))], False)]
        sender._cond.notify_all()


def test_a_failed_send_still_stops_every_rollout_rank_left():
    pg = RecordingGroup(dead={2})
    sender = sender_with(pg, rollout_ranks=3)
    queue(sender, 1)
    sender._thread.join(timeout=10)
    assert not sender._thread.is_alive()
    assert "rollout rank 2 is gone" in str(sender._error)
    got = {dst: objects(chunks) for dst, chunks in pg.sent.items()}
    # rank 1 had version 1 before rank 2 failed; rank 3 never got it: both hear STOP with the reason
    assert [o.get("version") for o in got[1] if "version" in o] == [1]
    for dst in (1, 3):
        stops = [o for o in got[dst] if STOP in o]
        assert len(stops) == 1 and "rollout rank 2 is gone" in stops[0][STOP], got[dst]
    assert 2 not in got


def test_a_clean_close_sends_stop_without_a_reason_to_every_rank():
    pg = RecordingGroup(dead=set())
    sender = sender_with(pg, rollout_ranks=2)
    queue(sender, 1)
    sender.close()
    assert sender._error is None
    for dst in (1, 2):
        got = objects(pg.sent[dst])
        assert got[0]["version"] == 1 and got[-1] == {STOP: None}, got
