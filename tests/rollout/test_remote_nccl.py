"""The weight buckets over NCCL (rollout/remote_nccl.py, driven by remote_sync.py's sender and receiver,
bridge_backend nccl), on fake process groups in threads (no GPU here): what a GPU run would break on. Every rollout
rank takes part in every broadcast, in the order trainer rank 0 issues them, with the byte counts it sends; the control
messages stay on gloo (nothing but pickled objects there); the staging buffers are made on the bridge's GPU in bytes,
each thread sets that GPU as its own, received buckets wait in pinned host memory, and a rollout rank makes no device
buffer before its engine is built; STOP reaches every rank left when a rank is gone, also ranks waiting in a broadcast
that never comes; a rollout rank in a broadcast notices a silent trainer. The same stop rule on the CPU bridge
(buckets over gloo). Plus the backend chosen per device and its config check."""
from __future__ import annotations

import pickle
import queue
import threading

import pytest
import torch
import torch.distributed as dist

from megatron_searchr1.cli import UsageError
from megatron_searchr1.config import ConfigError, load_config
from megatron_searchr1.rollout import remote_nccl, remote_sync
from megatron_searchr1.rollout.remote_receiver import WeightReceiver
from megatron_searchr1.rollout.remote_sync import STOP, STOP_KEY, Bridge, RolePlan, WeightSender, bridge_backend
from megatron_searchr1.rollout.weight_sync import layout_bucket, pack_bucket

GPU = 3  # the bridge's fake CUDA device index (LOCAL_RANK)


class _Work:
    def __init__(self, done=lambda: True, error=None):
        self.done, self.error = done, error

    def is_completed(self) -> bool:
        return self.done()

    def wait(self):
        if self.error is not None:
            raise self.error


class GlooBus:
    """Point-to-point messages between bridge ranks in one process, as ProcessGroupGloo's send / recv; a send to a
    dead rank fails as gloo's does; `log` keeps every message (src, dst, tensor)."""

    def __init__(self, dead=()):
        self.dead, self.log, self.queues = set(dead), [], {}
        self.lock = threading.Lock()

    def q(self, src, dst, tag) -> queue.Queue:
        with self.lock:
            return self.queues.setdefault((src, dst, tag), queue.Queue())

    def group(self, rank: int):
        bus = self

        class Group:
            def send(self, tensors, dst, tag):
                if dst in bus.dead:
                    return _Work(error=RuntimeError(f"Connection closed by peer {dst}"))
                t = tensors[0].clone()
                bus.log.append((rank, dst, t))
                bus.q(rank, dst, tag).put(t)
                return _Work()

            def recv(self, tensors, src, tag):
                tensors[0].copy_(bus.q(src, rank, tag).get(timeout=30))
                return _Work()

        return Group()


class NcclBus:
    """Broadcasts among `members` bridge ranks as an NCCL group does them: the n-th broadcast of every member is one
    collective, complete once all members issued it (a missing member: never), the root's bytes then copied into the
    others; a byte count that differs from the root's is an error. `log[rank]` = [(root, nbytes, dtype, device)];
    `aborted` = the ranks whose communicator was aborted (ProcessGroupNCCL.abort), in order."""

    def __init__(self, members: int):
        self.members, self.log, self.calls, self.delivered, self.aborted = members, {}, {}, set(), []
        self.lock = threading.Lock()

    def group(self, rank: int):
        bus = self

        class Group:
            def abort(self):
                bus.aborted.append(rank)

            def broadcast(self, tensor, root):
                with bus.lock:
                    mine = bus.log.setdefault(rank, [])
                    seq = len(mine)
                    mine.append((root, tensor.numel() * tensor.element_size(), tensor.dtype, tensor.device))
                    bus.calls.setdefault(seq, {})[rank] = tensor

                def done() -> bool:
                    with bus.lock:
                        calls = bus.calls[seq]
                        if len(calls) < bus.members:
                            return False
                        if seq not in bus.delivered:  # every member at once: the root may reuse its buffer after
                            bus.delivered.add(seq)
                            for r, t in calls.items():
                                if t.numel() != calls[root].numel():
                                    raise RuntimeError(f"broadcast {seq}: {t.numel()} bytes on rank {r}, "
                                                       f"{calls[root].numel()} on the root")
                                if r != root:
                                    t.copy_(calls[root])
                        return True

                return _Work(done)

        return Group()


@pytest.fixture
def fake_gpu(monkeypatch):
    """Device buffers and pinned host buffers as CPU tensors, recording what was asked for; which device each thread
    made its own."""
    seen = {"device_buffer": [], "host_buffer": [], "use_device": []}

    def device_buffer(nbytes, device):
        seen["device_buffer"].append((nbytes, device))
        return torch.empty(nbytes, dtype=torch.uint8)

    def host_buffer(nbytes, device):
        seen["host_buffer"].append((nbytes, device))
        return torch.empty(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(remote_nccl, "device_buffer", device_buffer)
    monkeypatch.setattr(remote_sync, "host_buffer", host_buffer)
    monkeypatch.setattr(remote_nccl, "use_device",
                        lambda d: seen["use_device"].append((threading.current_thread().name, d)))
    return seen


def buckets_of(version: int, sizes: list[int]) -> list:
    """A version's buckets as WeightSender queues them: (layout, flat bytes), one bf16 tensor per bucket."""
    out = []
    for i, n in enumerate(sizes):
        t = torch.full((n,), float(version * 10 + i), dtype=torch.bfloat16)
        layout = layout_bucket([(f"w{i}", (n,), t.dtype)])
        flat = torch.empty(layout.nbytes, dtype=torch.uint8)
        pack_bucket([t], layout, out=flat)
        out.append((layout, flat))
    return out


def make(k: int, dead=(), store=None, absent=(), over_nccl: bool = True):
    """Trainer rank 0's sender and the receivers of the rollout ranks not in `dead` / `absent` (an absent rank takes
    its gloo messages but never joins a broadcast: it died after its header). `over_nccl=False`: the CPU bridge, whose
    buckets go over gloo after each header."""
    plan = RolePlan(world=1 + k, rollout_ranks=k)
    gloo, nccl = GlooBus(dead), NcclBus(k + 1)
    store = store if store is not None else dist.HashStore()

    def bridge(b):
        return Bridge(plan=plan, rank=plan.global_rank(b), weights=gloo.group(b),
                      weights_data=nccl.group(b) if over_nccl else None, store=store,
                      device=torch.device("cuda", GPU) if over_nccl else torch.device("cpu"))

    sender = WeightSender(bridge(0), bucket_bytes=1 << 20, dtype=torch.bfloat16)
    receivers = {b: WeightReceiver(bridge(b)) for b in range(1, k + 1) if b not in dead and b not in absent}
    for r in receivers.values():
        r.engine_ready.set()
    return sender, receivers, gloo, nccl


def queue_version(sender: WeightSender, version: int, buckets: list) -> None:
    with sender._cond:
        sender._pending = [(version, buckets, False)]
        sender._cond.notify_all()


def gloo_objects(gloo: GlooBus, dst: int) -> list:
    """Every message rank 0 sent `dst` over gloo, read as send_object's pairs; fails on anything else (a bucket)."""
    chunks = [t for src, d, t in gloo.log if src == 0 and d == dst]
    assert len(chunks) % 2 == 0, "an odd message on gloo: bucket bytes went over gloo"
    out = []
    for n, data in zip(chunks[::2], chunks[1::2]):
        assert n.dtype == torch.int64 and data.numel() == int(n.item())
        out.append(pickle.loads(data.numpy().tobytes()))
    return out


def test_every_rollout_rank_takes_every_broadcast_in_the_senders_order(fake_gpu):
    sender, receivers, gloo, nccl = make(k=3)
    versions = {1: buckets_of(1, [5, 300, 17]), 2: buckets_of(2, [64, 8])}
    for v, buckets in versions.items():
        queue_version(sender, v, buckets)
        for r in receivers.values():
            assert r.wait_for(v, timeout=30)
    sender.close()
    for r in receivers.values():
        r.wait_stop(timeout=30)
    assert sender._error is None and sender.sent_versions == [1, 2]
    sizes = [flat.numel() for v in (1, 2) for _, flat in versions[v]]
    assert sender.sent_bytes == sum(sizes)
    for b in range(4):  # one collective per bucket, rank 0 the root, the sender's byte counts, in its order
        assert [(root, n) for root, n, _, _ in nccl.log[b]] == [(0, n) for n in sizes], b
        assert all(dtype == torch.uint8 for _, _, dtype, _ in nccl.log[b])
    for b, r in receivers.items():
        version, got, _ = r._latest
        assert version == 2 and [f.tolist() for _, f in got] == [f.tolist() for _, f in versions[2]]
        assert r.received_bytes == sum(sizes) and r.stopped and r.stop_reason is None
        objs = gloo_objects(gloo, b)  # only headers and STOP over gloo
        assert [o.get("version") for o in objs[:-1]] == [1, 2] and objs[-1] == {STOP: None}
    # the staging buffers are on the bridge's GPU; received buckets wait in (pinned) host memory for that GPU;
    # every thread that touches NCCL made the bridge's GPU its own
    assert {d for _, d in fake_gpu["device_buffer"]} == {torch.device("cuda", GPU)}
    assert {d for _, d in fake_gpu["host_buffer"]} == {torch.device("cuda", GPU)}
    assert sorted(n for n, _ in fake_gpu["use_device"]) == ["weight-receiver"] * 3 + ["weight-sender"]
    assert {d for _, d in fake_gpu["use_device"]} == {torch.device("cuda", GPU)}


def test_a_dead_rank_before_the_broadcast_still_stops_every_rank_left(fake_gpu):
    store = dist.HashStore()
    sender, receivers, gloo, _ = make(k=3, dead={2}, store=store)
    queue_version(sender, 1, buckets_of(1, [32]))
    sender._thread.join(timeout=30)
    assert "rollout rank 2 is gone" in str(sender._error)
    # rank 1 took its header and waits in the broadcast (reads STOP from the store); rank 3 hears it over gloo
    for b in (1, 3):
        receivers[b].wait_stop(timeout=30)
        assert receivers[b].stopped and "rollout rank 2 is gone" in receivers[b].stop_reason
        assert receivers[b].latest_version == -1
    assert "rollout rank 2 is gone" in store.get(STOP_KEY).decode()


def test_over_gloo_a_failed_send_still_stops_every_rollout_rank_left():
    # the CPU bridge: rank 1 had version 1 before the send to rank 2 failed, rank 3 never got it; both hear STOP
    # with the reason (a rank left waiting for weights would wait for ever: nothing else ends it on another node)
    sender, receivers, gloo, _ = make(k=3, dead={2}, over_nccl=False)
    queue_version(sender, 1, buckets_of(1, [32]))
    sender._thread.join(timeout=30)
    assert not sender._thread.is_alive() and "rollout rank 2 is gone" in str(sender._error)
    for b in (1, 3):
        receivers[b].wait_stop(timeout=30)
        assert receivers[b].stopped and "rollout rank 2 is gone" in receivers[b].stop_reason
    assert receivers[1].latest_version == 1 and receivers[3].latest_version == -1
    assert not any(d == 2 for _, d, _ in gloo.log)


def test_over_gloo_a_clean_close_sends_every_version_then_stop_without_a_reason():
    sender, receivers, _, _ = make(k=2, over_nccl=False)
    queue_version(sender, 1, buckets_of(1, [32, 16]))
    sender.close()
    assert sender._error is None
    for r in receivers.values():
        r.wait_stop(timeout=30)
        assert r.stop_reason is None and r.latest_version == 1 and r.received_bytes == sender.sent_bytes > 0


def test_a_rank_gone_during_a_broadcast_lets_close_stop_the_others(fake_gpu):
    sender, receivers, _, nccl = make(k=3, absent={2})
    queue_version(sender, 1, buckets_of(1, [32]))
    for b in (1, 3):  # both wait in the broadcast that rank 2 never joins
        while b not in nccl.log:
            threading.Event().wait(0.01)
    assert nccl.aborted == []
    sender.close(reason="rollout rank 2 is gone", timeout=30)
    assert not sender._thread.is_alive() and "abandoned" in str(sender._error)
    for b in (1, 3):
        receivers[b].wait_stop(timeout=30)
        assert receivers[b].stop_reason == "rollout rank 2 is gone"
    # every side that gave up its broadcast aborted its communicator: no NCCL kernel is left waiting for the watchdog
    # (engine.close() and the exit would wait with it for parallel.timeout_minutes)
    assert sorted(nccl.aborted) == [0, 1, 3]


def test_a_silent_trainer_ends_a_receiver_waiting_in_a_broadcast(fake_gpu, monkeypatch):
    monkeypatch.setattr(remote_sync, "GONE_SECONDS", 0.5)
    plan = RolePlan(world=2, rollout_ranks=1)
    gloo, nccl = GlooBus(), NcclBus(2)
    receiver = WeightReceiver(Bridge(plan=plan, rank=1, weights=gloo.group(1), weights_data=nccl.group(1),
                                     store=dist.HashStore(), device=torch.device("cuda", GPU)))
    receiver.engine_ready.set()
    layout = buckets_of(1, [8])[0][0]
    remote_sync.send_object(gloo.group(0), {"version": 1, "layouts": [layout], "validate": False}, 1,
                            remote_sync.WEIGHTS_TAG)  # the header, and then trainer rank 0 says nothing more
    with pytest.raises(RuntimeError, match="trainer rank 0 is gone.*heartbeat stood still"):
        receiver.wait_for(1, timeout=30)
    assert nccl.aborted == [1]  # the broadcast given up: its communicator aborted


def test_auto_is_the_tested_transport_on_every_device_and_nccl_needs_cuda():
    # the NCCL path has run on fake groups only: auto stays on gloo on CUDA too until a GPU run passes; nccl is opt-in
    pairs = [("auto", "cuda"), ("auto", "cpu"), ("gloo", "cuda"), ("gloo", "cpu"), ("nccl", "cuda")]
    assert [bridge_backend(c, d) for c, d in pairs] == ["gloo", "gloo", "gloo", "gloo", "nccl"]
    with pytest.raises(UsageError, match=r"^parallel.bridge_backend=nccl needs CUDA, but this run's device is cpu"):
        bridge_backend("nccl", "cpu")
    assert load_config(None, []).parallel.bridge_backend == "auto"
    with pytest.raises(ConfigError, match="parallel.bridge_backend must be auto, gloo or nccl, got 'tcp'"):
        load_config(None, ["parallel.bridge_backend=tcp"])


def test_a_rollout_rank_joins_no_broadcast_before_its_engine_is_built(fake_gpu):
    # vLLM sizes its KV cache from the free GPU memory it measures while it builds the engine: the staging buffer and
    # the NCCL communicator must not appear in the middle of that
    plan = RolePlan(world=2, rollout_ranks=1)
    gloo, nccl = GlooBus(), NcclBus(2)
    receiver = WeightReceiver(Bridge(plan=plan, rank=1, weights=gloo.group(1), weights_data=nccl.group(1),
                                     store=dist.HashStore(), device=torch.device("cuda", GPU)))
    sender = WeightSender(Bridge(plan=plan, rank=0, weights=gloo.group(0), weights_data=nccl.group(0),
                                 store=dist.HashStore(), device=torch.device("cuda", GPU)), 1 << 20, torch.bfloat16)
    queue_version(sender, 1, buckets_of(1, [16]))
    with pytest.raises(TimeoutError):
        receiver.wait_for(1, timeout=1.0)
    assert 1 not in nccl.log and len(fake_gpu["device_buffer"]) == 1  # the sender's staging buffer only
    receiver.engine_ready.set()
    assert receiver.wait_for(1, timeout=30) and len(nccl.log[1]) == 1
    sender.close()


def test_a_broadcast_that_fails_on_the_rollout_rank_is_its_own_error_not_a_gone_trainer(fake_gpu, monkeypatch):
    def out_of_memory(nbytes, device):
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {nbytes} bytes")

    plan = RolePlan(world=2, rollout_ranks=1)
    gloo, nccl = GlooBus(), NcclBus(2)
    receiver = WeightReceiver(Bridge(plan=plan, rank=1, weights=gloo.group(1), weights_data=nccl.group(1),
                                     store=dist.HashStore(), device=torch.device("cuda", GPU)))
    monkeypatch.setattr(remote_nccl, "device_buffer", out_of_memory)
    receiver.engine_ready.set()
    layout = buckets_of(1, [8])[0][0]
    remote_sync.send_object(gloo.group(0), {"version": 1, "layouts": [layout], "validate": False}, 1,
                            remote_sync.WEIGHTS_TAG)
    with pytest.raises(RuntimeError, match=r"^receiving weights over NCCL failed \(OutOfMemoryError: CUDA out of"):
        receiver.wait_for(1, timeout=30)


def test_nccl_on_a_machine_without_cuda_is_one_error_line_before_torch_loads(monkeypatch):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    disagg = ["parallel.rollout_placement=disaggregated", "parallel.rollout_ranks=1", "data.val_files=[]",
              "parallel.bridge_backend=nccl"]
    monkeypatch.setenv("MEGATRON_SEARCHR1_DEVICE", "cpu")
    with pytest.raises(ConfigError, match=r"^parallel.bridge_backend=nccl needs CUDA, but MEGATRON_SEARCHR1_DEVICE"):
        load_config(None, disagg).validate(world_size=3)  # this machine's checks come first
    load_config(None, disagg).validate(world_size=3, check_files=False)  # the planner checks a GPU recipe anywhere
    # the command line: one `error:` line, exit 2, and torch never imported (python -X importtime lists imports)
    env = {**os.environ, "WORLD_SIZE": "3", "PYTHONPATH": str(repo)}
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "megatron_searchr1.train",
                          str(repo / "examples/grpo_tiny_cpu.yaml"), *disagg[:2], "parallel.bridge_backend=nccl"],
                         env=env, capture_output=True, text=True, timeout=120, cwd=repo)
    lines = [ln for ln in out.stderr.splitlines() if not ln.startswith("import time:")]
    imported = [ln.split("|")[-1].strip() for ln in out.stderr.splitlines() if ln.startswith("import time:")]
    assert out.returncode == 2 and lines == ["error: parallel.bridge_backend=nccl needs CUDA, but "
                                             "MEGATRON_SEARCHR1_DEVICE=cpu: set parallel.bridge_backend=auto or gloo"]
    assert "torch" not in imported
