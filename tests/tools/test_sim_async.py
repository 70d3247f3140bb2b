"""tools/benchmarks/sim_async.py: the event loop against its closed form, the tail's effect, the staleness bound in
the event log, a user's dump, and the command line's refusals."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "benchmarks" / "sim_async.py"
_spec = importlib.util.spec_from_file_location("sim_async", SCRIPT)
sim = importlib.util.module_from_spec(_spec)
sys.modules["sim_async"] = sim  # dataclasses look their module up
_spec.loader.exec_module(sim)


def _args(**kw):
    base = dict(decode_tok_s=50.0, search_s=1.0, slots_per_gpu=64, turn_tokens=0.0, train_seconds=None, train_gpus=8,
                peak_tflops=1000.0, mfu=0.5, local_sync_gbps=50.0, wake_s=2.0, sync_gbps=5.0, load_gbps=25.0)
    base.update(kw)
    return SimpleNamespace(**base)


def _setup(shapes, batch=8, n=4, **kw):
    """A small model-free setup: 1e9 params (2 GB of bf16 weights), engine_tp 1, tp 1."""
    return sim.Setup(name="t", batch=batch, n=n, engine_tp=1, tp=1, total_params=1e9, active_params=1e9, mfu=0.5,
                     prompt_tokens=100.0, obs_tokens=100.0, shapes=shapes, args=_args(**kw))


def _lags(events):
    return [(step - 1) - v for e in events if e[0] == "train" for step in [e[3]] for _, v in e[4]]


@pytest.mark.parametrize("granularity,load_gbps", [("batch", 25.0), ("group", 1e12)])
def test_zero_variance_k0_matches_the_closed_form(granularity, load_gbps):
    """Every trajectory alike: the sync step is transfer + tau + T(N); k=0 alternates T' and tau + delta, so its
    mean period is max(T', (T' + tau + delta) / 2); the simulated ratio equals the closed form's. (Group
    granularity with free weight loads: there an engine's load also pauses the previous batch's groups.)"""
    shape = sim.Shape((200.0, 200.0), 1)
    s = _setup([shape], load_gbps=load_gbps)
    tau = 400 / 50 + 1.0
    steps, gpus, rollout = 13, 8, 4
    sync = sim.simulate(s, train_gpus=gpus, engines=gpus, k=-1, steps=steps, seed=0, colocated=True,
                        granularity=granularity)
    asyn = sim.simulate(s, train_gpus=gpus - rollout, engines=rollout, k=0, steps=steps, seed=0,
                        granularity=granularity)
    tokens = s.batch * s.n * s.train_tokens(shape, 1.0)
    weights = 2e9
    p_sync = weights / 50e9 + 2.0 + tau + s.train_seconds(tokens, gpus)
    t_prime = s.train_seconds(tokens, gpus - rollout) + weights / 50e9
    delta = weights / 5e9 + weights / (load_gbps * 1e9)
    assert tau + delta > t_prime  # the generation-bound branch: both terms of the formula matter
    p_async = max(t_prime, (t_prime + tau + delta) / 2)
    assert sync.step_s == pytest.approx(p_sync, rel=1e-9)
    assert asyn.step_s == pytest.approx(p_async, rel=1e-9)
    assert asyn.samples_per_s / sync.samples_per_s == pytest.approx(p_sync / p_async, rel=1e-9)
    assert asyn.dropped == 0 and set(_lags(asyn.events)) <= {0, 1}


def test_zero_variance_k0_with_shares_generates_one_batch_at_a_time():
    """The same setup with shares: every engine works on the same batch, so batch b+1 starts only when its version
    has arrived and every engine loaded it; generation-bound, the period is tau + the engine's load (not the
    alternation's mean of two engines that whole batches give), from step 3 on (batch 1 needs no new version)."""
    shape = sim.Shape((200.0, 200.0), 1)
    s = _setup([shape], load_gbps=25.0)
    tau, pause = 400 / 50 + 1.0, 2e9 / 25e9
    res = sim.simulate(s, train_gpus=4, engines=4, k=0, steps=13, seed=0, granularity="share")
    t_prime = s.train_seconds(s.batch * s.n * s.train_tokens(shape, 1.0), 4) + 2e9 / 50e9
    assert tau + pause > t_prime + 2e9 / 5e9  # generation-bound
    starts = [e[1] for e in res.events if e[0] == "train"]
    assert starts[1] - starts[0] == pytest.approx(tau)
    assert all(b - a == pytest.approx(tau + pause) for a, b in zip(starts[1:], starts[2:])), starts
    assert res.step_s == pytest.approx((tau + 11 * (tau + pause)) / 12)


def test_a_heavier_tail_raises_the_speedup():
    """Same mean generation time; one dump has every trajectory alike, the other a 1-in-10 tail 4.5x as long. The
    synchronous step waits for the tail every step; k=1 lets the next batches generate past it."""
    light = [sim.Shape((97.5, 97.5), 1)] * 10                                   # 4.9 s each
    heavy = [sim.Shape((50.0, 50.0), 1)] * 9 + [sim.Shape((180.0,) * 5, 4)] * 1  # 3 s, and one of 22 s
    lat = lambda shapes: sum(_setup(shapes).latency(x, 1.0) for x in shapes) / len(shapes)  # noqa: E731
    assert lat(light) == pytest.approx(lat(heavy), rel=0.01)
    ratios = {}
    for name, shapes in (("light", light), ("heavy", heavy)):
        s = _setup(shapes, batch=16, slots_per_gpu=16)  # async: 64 slots for 64 trajectories a step
        sync = sim.simulate(s, train_gpus=8, engines=8, k=-1, steps=12, seed=1, colocated=True)
        asyn = sim.simulate(s, train_gpus=4, engines=4, k=1, steps=12, seed=1, granularity="group")
        ratios[name] = asyn.samples_per_s / sync.samples_per_s
    assert ratios["heavy"] > 1.5 * ratios["light"], ratios


@pytest.mark.parametrize("granularity", ["group", "share", "stream", "batch"])
def test_the_staleness_bound_holds_in_the_event_log(granularity):
    """Every trained group's lag is within k+1, the bound is reached, drops are logged beyond it; share, stream and
    batch granularity train batch s-1 at step s (batch: every group of it from one version); stream starts each
    engine's groups in the order of its stream (group g on engine g mod K)."""
    shapes = [sim.Shape((30.0,), 0)] * 8 + [sim.Shape((200.0,) * 4, 3)] * 2
    for k in (0, 1, 2):
        s = _setup(shapes, batch=6, n=3, slots_per_gpu=20)
        res = sim.simulate(s, train_gpus=2, engines=4, k=k, steps=10, seed=k, granularity=granularity)
        lags = _lags(res.events)
        assert lags and max(lags) <= k + 1 and max(lags) == k + 1, (k, sorted(set(lags)))
        assert all(e[0] != "drop" or (e[2] - 1) - e[4] > k + 1 for e in res.events)
        starts = {e[2]: (e[3], e[4]) for e in res.events if e[0] == "start"}
        assert all(starts[g][1] >= starts[g][0] - 1 - k for g in starts)  # required_version at every start
        if granularity != "group":
            for e in res.events:
                if e[0] == "train":
                    assert {starts[g][0] for g, _ in e[4]} == {e[3] - 1}
                    assert granularity in ("share", "stream") or len({v for _, v in e[4]}) == 1
        if granularity == "stream":
            order = [e[2] for e in res.events if e[0] == "start"]
            for i in range(4):
                mine = [g for g in order if g % 4 == i]
                assert mine == list(range(i, i + 4 * len(mine), 4)), (i, mine)


def test_shares_put_every_engine_on_every_batch():
    """8 engines of 8 slots, batches of 8 groups x 4 (32 trajectories of 2 s), free weight moves: whole batches at
    k=0 keep at most 2 engines working, each needing 4 waves of its slots for a batch (about 3.5 s a batch with the
    two alternating); shares give every engine 1 group of every batch, one wave: a batch every 2 s, every batch's 8
    groups starting at once. Streaming groups is faster still: it also runs two batches at once on the 64 slots,
    which shares do not (an engine starts its share of b+1 after its share of b)."""
    s = _setup([sim.Shape((100.0,), 0)], slots_per_gpu=8, load_gbps=1e12, sync_gbps=1e12)
    runs = {g: sim.simulate(s, train_gpus=8, engines=8, k=0, steps=8, seed=0, granularity=g)
            for g in ("share", "batch", "group")}
    speed = {g: r.samples_per_s for g, r in runs.items()}
    assert runs["share"].step_s == pytest.approx(2.0) and speed["batch"] * 1.5 < speed["share"] < speed["group"], speed
    starts = [e for e in runs["share"].events if e[0] == "start"]
    for b in range(8):
        assert len({e[1] for e in starts if e[3] == b}) == 1 and sum(e[3] == b for e in starts) == 8


def test_a_user_dump_is_read(tmp_path):
    """Both record kinds the trainer writes; token counts are characters / 4, one per model turn."""
    train = tmp_path / "trajectories.jsonl"
    resp = "a" * 40 + "<information>" + "x" * 400 + "</information>" + "b" * 80
    train.write_text(json.dumps({"response": resp, "searches": 1}) + "\n")
    val = tmp_path / "val_trajectories.jsonl"
    turns = [["model", "c" * 20 + "<search> q </search>"], ["context", "y" * 99], ["model", "d" * 12]]
    val.write_text(json.dumps({"turns": turns}) + "\n\n")
    (a,) = sim.read_dump(str(train))
    assert a == sim.Shape((10.0, 20.0), 1)
    (b,) = sim.read_dump(str(val))
    assert b.searches == 1 and len(b.turn_tokens) == 2 and b.turn_tokens[1] == 3.0
    many = tmp_path / "many.jsonl"
    many.write_text("".join(json.dumps({"response": "w" * (40 * (i + 1)), "searches": 0}) + "\n" for i in range(6)))
    r = subprocess.run([sys.executable, str(SCRIPT), "--dump", str(many), "--recipes", "7b", "--gpus", "16",
                        "--staleness", "1", "--steps", "4", "--rollout-gpus", "8", "--json", str(tmp_path / "o.json")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"generation times from {many}" in r.stdout and "| 7b | 16 |" in r.stdout
    assert "verl fully-async" in r.stdout
    (row,) = json.loads((tmp_path / "o.json").read_text())
    assert row["gpus"] == 16 and row["async"]["1"]["rollout_gpus"] == 8 and row["async"]["1"]["speedup"] > 0


@pytest.mark.parametrize("argv,needle", [
    (["--recipes", "13b"], "--recipes '13b': unknown 13b"),
    (["--gpus", "0"], "every value must be >= 2"),
    (["--gpus", "8,x"], "comma-separated list of integers"),
    (["--dump", "/nonexistent.jsonl"], "does not exist"),
    (["--mfu", "3"], "--mfu 3.0 must be <= 1"),
    (["--recipes", "7b", "--gpus", "6"], "not a multiple of 7b's tp (4)"),
])
def test_bad_input_is_one_error_line(argv, needle):
    r = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr


def test_a_dump_that_is_not_json_is_refused(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{\"response\": \"x\", \"searches\": 0}\nnot json\n")
    r = subprocess.run([sys.executable, str(SCRIPT), "--dump", str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == f"error: --dump {str(bad)!r} line 2 is not JSON (pass a " \
                                                     "trajectories.jsonl)"


def test_help_shows_the_defaults_and_assumptions():
    r = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    assert "(default: 256)" in r.stdout and "(default: 8,64,256)" in r.stdout and "Assumptions" in r.stdout


def test_the_synchronous_baseline_spreads_each_batch_over_every_engine():
    """Granularity concerns the async rollout ranks: the colocated step uses all engines either way (a batch of 32
    trajectories on one engine of 8 slots would take 4 waves, on 8 engines one)."""
    s = _setup([sim.Shape((100.0,), 0)], slots_per_gpu=8)
    runs = [sim.simulate(s, train_gpus=8, engines=8, k=-1, steps=5, seed=0, colocated=True, granularity=g)
            for g in ("group", "share", "batch")]
    assert runs[0].step_s == runs[1].step_s == runs[2].step_s == pytest.approx(2e9 / 50e9 + 2.0 + 2.0 + s.train_seconds(
        s.batch * s.n * s.train_tokens(s.shapes[0], 1.0), 8))


def test_parameter_counts_of_the_recipes_models():
    """Qwen2.5-7B's published count exactly; Qwen3-30B-A3B's 30.5B total, 3.3B active."""
    cfgs = REPO / "tests" / "models" / "real_configs"
    total, active = sim.param_counts(json.loads((cfgs / "Qwen2.5-7B-Instruct.json").read_text()))
    assert total == active == 7_615_616_512
    total, active = sim.param_counts(json.loads((cfgs / "Qwen3-30B-A3B.json").read_text()))
    assert 30.4e9 < total < 30.6e9 and 3.2e9 < active < 3.4e9


def test_streamed_groups_fill_the_slots_a_share_leaves_idle():
    """A long tail (1 trajectory in 10 takes 6x as long), 4 engines: with shares an engine starts its share of batch
    b+1 only once its share of b is done, so its slots idle through the tail; streamed in the draw's order (each
    engine its own fixed groups, the trainer batches whole) they take the next batches' groups meanwhile: faster at
    every k, and more so with room to run ahead (k=2)."""
    shapes = [sim.Shape((30.0,), 0)] * 9 + [sim.Shape((180.0,), 0)]
    s = _setup(shapes, batch=8, n=2, slots_per_gpu=8)
    speed = {(g, k): sim.simulate(s, train_gpus=2, engines=4, k=k, steps=14, seed=3, granularity=g).samples_per_s
             for g in ("share", "stream") for k in (0, 2)}
    assert speed[("stream", 0)] > 1.3 * speed[("share", 0)] and speed[("stream", 2)] > 2 * speed[("share", 2)], speed
