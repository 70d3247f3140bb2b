"""A rollout rank's received weight versions in two reused host buffers (rollout/host_slots.py, driven by
rollout/remote_receiver.py): over many versions the receiver allocates exactly two buffers, each the bytes of one
version as sent (derived from the buckets that crossed, not restated); a version being loaded is never overwritten
(every load sees exactly the bytes of its own version, while newer versions keep arriving); a version marked for
validation keeps its slot until it is taken, and a rank waiting for newer weights serves it meanwhile (no deadlock
when both slots are held); close() ends and joins the receiving thread. The planner counts the same two slots."""
from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from megatron_searchr1.rollout import remote_sync
from megatron_searchr1.rollout.host_slots import HOST_SLOTS, HostSlots, version_bytes
from megatron_searchr1.rollout.remote_receiver import WeightReceiver
from megatron_searchr1.rollout.remote_sync import Bridge, RolePlan, WeightSender
from megatron_searchr1.rollout.weight_sync import unpack_bucket
from tests.rollout.test_remote_nccl import GlooBus, buckets_of, queue_version
from tests.test_plan import megatron_world  # noqa: F401 (fixture)


@pytest.fixture
def allocations(monkeypatch):
    """Every host buffer the receiver allocates: (nbytes, device)."""
    seen = []

    def host_buffer(nbytes, device):
        seen.append((nbytes, device))
        return torch.empty(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(remote_sync, "host_buffer", host_buffer)
    return seen


def pair(gloo=None):
    """Trainer rank 0's sender and one rollout rank's receiver over an in-process gloo stand-in (the CPU bridge)."""
    plan = RolePlan(world=2, rollout_ranks=1)
    gloo = gloo or GlooBus()
    store = dist.HashStore()
    sender = WeightSender(Bridge(plan=plan, rank=0, weights=gloo.group(0), store=store), 1 << 20, torch.bfloat16)
    receiver = WeightReceiver(Bridge(plan=plan, rank=1, weights=gloo.group(1), store=store))
    return sender, receiver


class SlowEngine:
    """Records what each load saw: {version: [bucket tensors as lists]} (copied after a pause, so a receiver that
    wrote into the slot being loaded would tear the copy)."""

    def __init__(self, pause: float):
        self.pause, self.loads, self._current = pause, [], []

    def load_weights(self, pairs):
        pairs = list(pairs)
        time.sleep(self.pause)
        self._current += [t.float().tolist() for _, t in pairs]

    def finish_weight_sync(self):
        self.loads.append(self._current)
        self._current = []


def test_many_versions_reuse_two_buffers_of_one_versions_bytes_and_every_load_is_whole(allocations):
    sender, receiver = pair()
    sizes = [300, 17, 64]
    versions = {v: buckets_of(v, sizes) for v in range(1, 13)}
    engine = SlowEngine(pause=0.02)
    loaded = []
    feeder_done = threading.Event()

    def feed():  # versions keep coming while the main thread loads: the receiver must use the other slot
        for v, buckets in versions.items():
            queue_version(sender, v, buckets)
            time.sleep(0.01)
        feeder_done.set()

    threading.Thread(target=feed, daemon=True).start()
    while not (feeder_done.is_set() and receiver.applied_version == 12):
        receiver.wait_for(max(receiver.applied_version, 0) + 1, timeout=30)
        got = receiver.apply(engine, inspect=lambda pairs: [t.float().tolist() for _, t in pairs])
        if got is not None:
            loaded.append(got)
    sender.close()
    receiver.wait_stop(timeout=30)
    assert receiver.close(timeout=30) and not receiver._thread.is_alive()
    # every load saw exactly its own version's bytes, both in what the engine got and in what inspect read back
    assert loaded and [v for v, _ in loaded] == sorted({v for v, _ in loaded})
    for (v, inspected), seen in zip(loaded, engine.loads, strict=True):
        want = [t.float().tolist() for layout, flat in versions[v] for _, t in unpack_bucket(flat, layout)]
        assert seen == want and inspected == want, v
    # two buffers for 12 versions, each the bytes one version moved (its buckets' layouts, aligned), pinned for the
    # bridge's device (cpu here: not pinned)
    moved = version_bytes([layout for layout, _ in versions[1]])
    assert moved >= sum(flat.numel() for _, flat in versions[1])
    assert allocations == [(moved, torch.device("cpu"))] * HOST_SLOTS
    assert receiver.slots.allocations == 2 and receiver.slots.nbytes == 2 * moved
    assert receiver.received_bytes == sum(flat.numel() for v in versions.values() for _, flat in v) \
        == 12 * sum(flat.numel() for _, flat in versions[1])


def test_a_due_validation_holds_its_slot_and_a_waiting_rank_serves_it(allocations):
    # versions 1 and 2 marked for validation fill both slots; version 3 cannot be received until one of them is taken.
    # The rank waits for version 3 (newer weights for its next batch) and, meanwhile, validates what is due
    gloo = GlooBus()
    sender, receiver = pair(gloo)
    for v in (1, 2):
        with sender._cond:
            sender._pending = remote_sync.queue_version(sender._pending or [], (v, buckets_of(v, [32]), True))
            sender._cond.notify_all()
        receiver.wait_for(v, timeout=30)
    queue_version(sender, 3, buckets_of(3, [32]))
    with pytest.raises(TimeoutError):  # without serving, the wait cannot end: both slots hold a version to validate
        receiver.wait_for(3, timeout=1.5)
    assert receiver.latest_version == 2 and [d.version for d in receiver.due] == [1, 2]
    validated = []

    class Engine:
        def load_weights(self, pairs):
            list(pairs)

        def finish_weight_sync(self):
            pass

    def serve():
        while (due := receiver.take_due()) is not None:
            receiver.load_due(Engine(), due)
            validated.append(due.version)

    assert receiver.wait_for(3, timeout=30, serve=serve)
    assert validated[:1] == [1] and receiver.latest_version == 3
    serve()
    assert validated == [1, 2] and receiver.slots.allocations == 2
    sender.close()
    receiver.wait_stop(timeout=30)
    assert receiver.close(timeout=30)


def test_pick_prefers_the_slot_not_holding_the_newest_version_and_waits_when_both_are_needed():
    slots = HostSlots(torch.device("cpu"), alloc=lambda n, d: torch.empty(n, dtype=torch.uint8))
    assert slots.pick(latest_slot=None) == 0 and slots.pick(latest_slot=0) == 1
    slots.holds[1] = 1  # being loaded: only the newest version's slot is left (that version is superseded)
    assert slots.pick(latest_slot=0) == 0
    slots.due[0] = 1  # marked for validation: nothing may be written now
    assert slots.pick(latest_slot=0) is None


def test_the_planner_counts_the_receivers_slots(megatron_world):
    # the async 7B recipe on 2 nodes: node 1's 8 rollout ranks each hold HOST_SLOTS versions, a version being every HF
    # tensor in the rollout dtype (bf16), which is what the sender's buckets carry
    from megatron_searchr1.planner import memory
    from tests.test_plan import plan, recipe

    assert memory.BRIDGE_HOST_VERSIONS == HOST_SLOTS
    cfg, hf = recipe("grpo_qwen2.5-7b_async", nodes=2)
    result, counts, _ = plan.plan_config(cfg, hf, nodes=2)
    assert result.host_bytes_per_node == HOST_SLOTS * counts.hf_params * 2 * 8


def test_trainer_rank_0_gathers_into_two_reused_slots_and_every_version_arrives_whole(allocations, monkeypatch):
    # the sender's side: each send() gathers a version into a slot (sync_weights stood in for: it hands the collector
    # one version's buckets, as WeightSync does); over 10 versions, some marked for validation, trainer rank 0
    # allocates 2 x the buckets of one version, and every version the rollout rank loads is exactly the one sent
    from types import SimpleNamespace

    sizes = [300, 17, 64]

    def sync_weights(model, collector, mapping, **kw):
        v = model.version
        if collector is not None:
            for i, n in enumerate(sizes):
                collector.load_weights([(f"w{i}", torch.full((n,), float(v * 10 + i), dtype=torch.bfloat16))])
        return SimpleNamespace(bytes=0, buckets=len(sizes), seconds=0.0)

    monkeypatch.setattr(remote_sync.weight_sync, "sync_weights", sync_weights)
    sender, receiver = pair()
    validated, loaded = [], []

    class Engine:
        def load_weights(self, pairs):
            self.pairs = [t.float().tolist() for _, t in pairs]
            loaded.append(self.pairs)

        def finish_weight_sync(self):
            pass

    def serve():
        while (due := receiver.take_due()) is not None:
            receiver.load_due(Engine(), due)
            validated.append(due.version)

    for v in range(1, 11):
        sender.send(SimpleNamespace(model=SimpleNamespace(version=v), mapping=None), v, validate=v % 4 == 0)
        if v % 3 == 0:  # the rollout rank catches up now and then
            receiver.wait_for(v, timeout=30, serve=serve)
            receiver.apply(Engine())
    sender.close()
    receiver.wait_stop(timeout=30)
    serve()
    receiver.apply(Engine())
    assert validated == [4, 8] and receiver.applied_version == 10
    for buckets in loaded:  # each bucket load is one tensor of one version, never a mix
        (values,) = buckets
        assert len(set(values)) == 1
    sender_allocs = [n for n, _ in allocations][: sender.host_allocations]
    assert sender.host_allocations == HOST_SLOTS * len(sizes), sender.host_allocations
    assert receiver.slots.allocations == HOST_SLOTS
    assert sorted(sender.sent_versions)[-1] == 10 and sender_allocs
    assert receiver.close(timeout=30)
