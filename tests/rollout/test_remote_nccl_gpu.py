"""The weight buckets between two real processes joined by init_role_world as in a run (rollout/remote_sync.py):
trainer rank 0 and one rollout rank. Two versions of bf16 buckets made by the trainer's own collector, then STOP: the
rollout rank holds exactly the bytes sent, in host memory (pinned on GPUs), and hears STOP. Over gloo on CPUs (runs
anywhere: it checks this harness too), and over NCCL with each rank on a GPU of its own (NCCL refuses two ranks on
one GPU: needs 2 GPUs). The fake-group tests of the NCCL path are tests/rollout/test_remote_nccl.py."""
from __future__ import annotations

import os
import socket
import time

import pytest
import torch

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


def weights(version: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Each version's buckets: (name, bf16 tensor) pairs, the same on every rank (seeded)."""
    g = torch.Generator().manual_seed(version)
    return [[(f"b{b}.w{i}", torch.randn(n, generator=g).to(torch.bfloat16)) for i, n in enumerate(sizes)]
            for b, sizes in enumerate([(1000, 7), (70000,), (3, 5, 11)])]


def _rank(rank: int, port: int, out: str, backend: str) -> None:
    from megatron_searchr1.rollout.remote_receiver import WeightReceiver
    from megatron_searchr1.rollout.remote_sync import RolePlan, WeightSender, _BucketCollector, init_role_world
    from megatron_searchr1.rollout.weight_sync import unpack_bucket

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    gpu = backend == "nccl"
    bridge = init_role_world(RolePlan(world=2, rollout_ranks=1), rank, "cuda" if gpu else "cpu", 2, backend)
    assert (bridge.weights_data is not None) == gpu
    assert bridge.device == (torch.device("cuda", rank) if gpu else torch.device("cpu"))
    if rank == 0:
        sender = WeightSender(bridge, bucket_bytes=1 << 20, dtype=torch.bfloat16)
        for version in (1, 2):
            collector = _BucketCollector(bridge.device)
            for pairs in weights(version):
                collector.load_weights([(n, t.to(bridge.device)) for n, t in pairs])
            assert all(flat.is_pinned() == gpu for _, flat in collector.buckets)
            with sender._cond:
                sender._pending = [(version, collector.buckets, False)]
                sender._cond.notify_all()
            while version not in sender.sent_versions:
                sender.raise_if_failed()
                time.sleep(0.01)
        sender.close()
        sender.raise_if_failed()
    else:
        receiver = WeightReceiver(bridge)
        receiver.engine_ready.set()
        assert receiver.wait_for(2, timeout=120)
        receiver.wait_stop(timeout=120)
        version, buckets, _ = receiver._latest
        assert version == 2 and receiver.stopped and receiver.stop_reason is None
        for (layout, flat), pairs in zip(buckets, weights(2), strict=True):
            assert flat.is_pinned() == gpu and flat.device.type == "cpu"
            got = unpack_bucket(flat, layout)
            assert [n for n, _ in got] == [n for n, _ in pairs]
            assert all(torch.equal(t, want) for (_, t), (_, want) in zip(got, pairs))
    with open(os.path.join(out, f"ok{rank}"), "w") as f:
        f.write("ok")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.skipif(
    not TWO_GPUS, reason="NCCL between the roles needs 2 GPUs (one per rank)"))])
def test_two_versions_between_two_processes_arrive_byte_for_byte(tmp_path, backend):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, str(tmp_path), backend), nprocs=2, join=True)
    assert sorted(os.listdir(tmp_path)) == ["ok0", "ok1"]
