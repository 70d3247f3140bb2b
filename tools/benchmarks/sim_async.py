# PYTHONPATH=$PWD python tools/benchmarks/sim_async.py                       # both recipes, 8/64/256 GPUs, k=0,1,2
# PYTHONPATH=$PWD python tools/benchmarks/sim_async.py --dump runs/x/trajectories.jsonl --recipes 7b --gpus 16
"""Predicted samples/s of synchronous colocated RL vs asynchronous disaggregated RL, by discrete-event simulation.

What it replays. Per-trajectory generation times come from a trajectory dump (the trainer's trajectories.jsonl or
val_trajectories.jsonl, `--dump`; by default the CPU demo's GRPO run, embedded as DEMO_TAIL): each record gives a
trajectory's searches and the tokens of each model turn, rescaled to --turn-tokens per model turn (the dump's
shape, the recipe's scale). A trajectory occupies one engine slot for sum(turn tokens) / --decode-tok-s plus
searches x --search-s. Per-batch training time is the batch's tokens x 10 x active parameters (actor forward and
backward 6, old and reference log-prob forwards 2 + 2) over the trainer GPUs at --mfu of --peak-tflops, or a
measured step (--train-seconds at --train-gpus GPUs) scaled by the GPU count.

The simulation. Engines (one per rollout.engine_tp GPUs, --slots-per-gpu x engine_tp slots each) take GRPO groups
(rollout.n trajectories; a group is done when its slowest trajectory is); batch b (train_batch_size groups in draw
order) may start only with policy version >= b-1-k in hand (the runtime's `required_version`), which bounds the lag
of every trained group by k+1; the trainer takes train_batch_size finished groups per step (oldest first, dropping
any whose lag exceeds k+1) and publishes version s at the end of step s. Synchronous colocated is the same loop with
k = -1 on all GPUs, generation and training in turn. Weights: the model's bf16 bytes (counted from its config.json)
cost a colocated run bytes / --local-sync-gbps + --wake-s per step; a disaggregated run a trainer-side gather
(bytes / --local-sync-gbps), then bytes / --sync-gbps to the engines, and each engine pauses its slots for
bytes / engine_tp / --load-gbps when it applies a version.
--granularity: share (the runtime's default, trainer/rollout_rank.py) splits every batch's groups into K contiguous
shares, one per engine, and each engine works through its shares batch after batch, on its own within the bound,
starting its share of batch b+1 once its whole share of b has finished (a rollout rank's loop returns when its last
trajectory does); stream (the runtime's rollout.async_granularity=group, trainer/rollout_stream.py) gives group g of
the draw to engine g mod K, which starts its groups in order as slots free up, across batches, and the trainer takes
batch b whole (the draw's order: it waits for the batch's slowest group); group streams groups to any engine with
free slots and the trainer takes the oldest finished groups, whatever their batch (verl's fully-async, AReaL, slime's
fully-async example; not built: the data order is not the draw's); batch gives each whole batch to one engine (batch
b to engine b mod K: the runtime before shares), so at most k+2 engines ever work. A trajectory's version is the one
its engine held when it started (stream: the runtime with rollout.partial=true, whose samples count as their oldest
token).

Assumptions (all flags; printed with the table): slots and per-sequence decode speed do not depend on load; prefill
and the trainer's attention FLOPs (s^2) are ignored; trajectories run independently (the runtime's loop batches a
turn's samples, so each turn waits for its slowest: the synchronous figure here is optimistic, the speed-up
conservative); a group's trajectories are drawn independently from the dump; training scales linearly in GPUs; the
recipe's train_batch_size is kept at every GPU count; the async split (rollout GPUs) is chosen among whole nodes
(8 GPUs, or multiples of tp/engine_tp below 16) near the balance of generation and training.
"""
from __future__ import annotations

import heapq
import json
import math
import os
import random
import re
import sys
from dataclasses import dataclass, field
from typing import Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from megatron_searchr1.cli import ArgumentParser, UsageError, at_least, above, run_main  # noqa: E402

RECIPES = {"7b": ("examples/grpo_qwen2.5-7b.yaml", "tests/models/real_configs/Qwen2.5-7B-Instruct.json", 0.30),
           "30b-a3b": ("examples/grpo_qwen3-30b-a3b.yaml", "tests/models/real_configs/Qwen3-30B-A3B.json", 0.15)}
"""name: (recipe, the model's config.json, training MFU assumed: dense 0.30; MoE 0.15, its all-to-alls and
small expert GEMMs)."""

DEMO_TAIL = ((1, 50, 44), (1, 60, 54), (1, 70, 18), (2, 90, 12), (2, 100, 13), (2, 110, 17), (2, 120, 15),
             (3, 130, 3), (3, 140, 8), (3, 150, 14), (3, 160, 2))
"""(searches, generated tokens, trajectories) of the CPU demo's GRPO run (examples/cpu_demo.md, 200 training
trajectories of trajectories.jsonl, steps 1-50; tokens = model-turn characters / 4, rounded to tens); every one
answered after its searches, so it has searches + 1 model turns."""

PEERS = (("verl fully-async (Qwen2.5-7B, 128 GPUs)", "2.35-2.67x",
          "verl docs/advance/fully_async.md: vs colocated synchronous"),
         ("AReaL (math and code, same GPU count)", "up to 2.77x", "arXiv 2505.24298 abstract: vs synchronous systems"),
         ("NeMo-RL GRPO, Qwen3-30B-A3B, 32 H100, 1 step off vs on policy", "171 -> 141 s/step (1.21x); v0.4: "
          "225 -> 244 s (0.92x)", "NeMo-RL docs/about/performance-summary.md, v0.7 and v0.4 tables"),
         ("NeMo-RL GRPO, Llama-3.1-8B, 16 H100, 1 step off vs on policy", "97.7 -> 74.6 s/step (1.31x)",
          "the same page, v0.4 table"))


# ------------------------------------------------------------------------------------------------------------------
# Inputs: the dump, the model's bytes, the recipe
# ------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """One trajectory's shape: tokens per model turn and its searches."""

    turn_tokens: tuple
    searches: int


def demo_shapes() -> list[Shape]:
    out = []
    for searches, tokens, count in DEMO_TAIL:
        turns = searches + 1
        out += [Shape(tuple([tokens / turns] * turns), searches)] * count
    return out


def read_dump(path: str) -> list[Shape]:
    """Shapes from a trajectories.jsonl (records with `response` and `searches`: model text is what lies outside
    <information> blocks) or a val_trajectories.jsonl (records with `turns`: [kind, text] segments); tokens are
    characters / 4. UsageError naming the line on anything else."""
    shapes = []
    try:
        with open(path) as f:
            lines = [ln for ln in f if ln.strip()]
    except OSError as e:
        raise UsageError(f"--dump {path!r}: {e.strerror}") from None
    for i, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
        except ValueError:
            raise UsageError(f"--dump {path!r} line {i} is not JSON (pass a trajectories.jsonl)") from None
        if isinstance(rec, dict) and isinstance(rec.get("turns"), list):
            model = [t[1] for t in rec["turns"] if isinstance(t, list) and len(t) == 2 and t[0] == "model"]
            searches = sum("<search>" in m for m in model)
        elif isinstance(rec, dict) and isinstance(rec.get("response"), str) and isinstance(rec.get("searches"), int):
            model = re.split(r"<information>.*?</information>", rec["response"], flags=re.S)
            searches = rec["searches"]
        else:
            raise UsageError(f"--dump {path!r} line {i} has neither `turns` nor `response` + `searches` (pass the "
                             "trainer's trajectories.jsonl or val_trajectories.jsonl)")
        tokens = tuple(max(1.0, len(m.strip()) / 4) for m in model if m.strip())
        if tokens:
            shapes.append(Shape(tokens, searches))
    if not shapes:
        raise UsageError(f"--dump {path!r} holds no trajectory with model text")
    return shapes


def param_counts(hf: dict) -> tuple[float, float]:
    """(total, active per token) parameters of a Qwen2/Qwen3(-MoE)/Llama config.json: embeddings (twice unless
    tied), attention (q, k, v, o; Qwen2's q/k/v biases), MLP (dense SwiGLU, or routed experts + router), norms."""
    h, L, V = hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]
    nq, ng = hf["num_attention_heads"], hf.get("num_key_value_heads", hf["num_attention_heads"])
    d = hf.get("head_dim") or h // nq
    emb = V * h * (1 if hf.get("tie_word_embeddings") else 2)
    attn = h * nq * d * 2 + h * ng * d * 2 + (nq + 2 * ng) * d * bool(hf.get("attention_bias", "qwen2" in
                                                                            hf.get("model_type", "")))
    experts = hf.get("num_experts") or 0
    if experts:
        fm, topk = hf["moe_intermediate_size"], hf["num_experts_per_tok"]
        mlp_total, mlp_active = experts * 3 * h * fm + h * experts, topk * 3 * h * fm + h * experts
    else:
        mlp_total = mlp_active = 3 * h * hf["intermediate_size"]
    norms = 2 * h + (2 * d if hf.get("model_type", "").startswith("qwen3") else 0)  # Qwen3's q/k norms
    return emb + L * (attn + mlp_total + norms) + h, emb + L * (attn + mlp_active + norms) + h


@dataclass
class Setup:
    """Everything one simulated run needs, resolved from the recipe, the model and the flags."""

    name: str
    batch: int                # groups per step (data.train_batch_size)
    n: int                    # trajectories per group (rollout.n)
    engine_tp: int
    tp: int
    total_params: float
    active_params: float
    mfu: float
    prompt_tokens: float
    obs_tokens: float
    shapes: list
    args: object = None

    @property
    def weight_bytes(self) -> float:
        return 2.0 * self.total_params

    def latency(self, shape: Shape, scale: float) -> float:
        a = self.args
        return sum(shape.turn_tokens) * scale / a.decode_tok_s + shape.searches * a.search_s

    def train_tokens(self, shape: Shape, scale: float) -> float:
        return self.prompt_tokens + sum(shape.turn_tokens) * scale + shape.searches * self.obs_tokens

    def train_seconds(self, tokens: float, gpus: int) -> float:
        a = self.args
        if a.train_seconds:
            return a.train_seconds * a.train_gpus / gpus * tokens / self.mean_step_tokens
        return tokens * 10 * self.active_params / (gpus * a.peak_tflops * 1e12 * self.mfu)

    mean_step_tokens: float = 0.0


def load_setup(name: str, shapes: list, args) -> Setup:
    from megatron_searchr1.config import ConfigError, load_config

    recipe, hf_path, mfu = RECIPES[name]
    try:
        cfg = load_config(os.path.join(REPO, recipe), [])
    except ConfigError as e:
        raise UsageError(f"{recipe}: {e}") from None
    with open(os.path.join(REPO, hf_path)) as f:
        total, active = param_counts(json.load(f))
    r = cfg.rollout
    s = Setup(name=name, batch=cfg.data.train_batch_size, n=r.n, engine_tp=r.engine_tp, tp=cfg.parallel.tp,
              total_params=total, active_params=active, mfu=args.mfu or mfu, prompt_tokens=args.prompt_tokens,
              obs_tokens=min(r.max_obs_length, args.obs_tokens), shapes=shapes, args=args)
    scale = token_scale(shapes, args.turn_tokens)
    s.mean_step_tokens = s.batch * s.n * sum(s.train_tokens(x, scale) for x in shapes) / len(shapes)
    return s


def token_scale(shapes: list, turn_tokens: float) -> float:
    """The factor that brings the dump's mean tokens per model turn to `turn_tokens` (0: keep the dump's)."""
    if not turn_tokens:
        return 1.0
    turns = [t for s in shapes for t in s.turn_tokens]
    return turn_tokens / (sum(turns) / len(turns))


def share(n: int, part: int, parts: int) -> range:
    """Engine `part`'s groups of a batch of `n`: rollout/batch_parts.py's rule (contiguous, sizes differing by at most
    one), restated here so the simulator does not import the engine stack.

    >>> [list(share(5, p, 3)) for p in range(3)]
    [[0], [1, 2], [3, 4]]
    """
    return range(n * part // parts, n * (part + 1) // parts)


# ------------------------------------------------------------------------------------------------------------------
# The event loop
# ------------------------------------------------------------------------------------------------------------------
@dataclass
class Engine:
    slots: int
    version: int = 0                      # the policy it holds
    running: dict = field(default_factory=dict)   # trajectory id -> [end time, group]
    queue: list = field(default_factory=list)     # groups assigned to it (share / batch granularity)
    busy_batch: int = -1                  # share / batch granularity: the batch it works on
    next_group: int = -1                  # stream granularity: its next group of the global stream


@dataclass
class Result:
    samples_per_s: float
    step_s: float
    dropped: int
    events: list


def simulate(s: Setup, *, train_gpus: int, engines: int, k: int, steps: int, seed: int,
             granularity: str = "share", colocated: bool = False) -> Result:
    """Run `steps` training steps; k = max_staleness (colocated: the synchronous loop, generation and training in
    turn on the same GPUs). Returns samples/s over steps 2..steps and the event log: ("start", t, group, batch,
    version), ("done", t, group), ("train", t_start, t_end, step, [(group, version)]), ("drop", t, step, group,
    version), ("publish", t, version)."""
    a = s.args
    rng = random.Random(seed)
    scale = token_scale(s.shapes, a.turn_tokens)
    eng = [Engine(slots=a.slots_per_gpu * s.engine_tp) for _ in range(engines)]
    if max(e.slots for e in eng) < s.n:
        raise UsageError(f"--slots-per-gpu x engine_tp = {eng[0].slots} slots cannot hold a group of {s.n}")
    pause = s.weight_bytes / s.engine_tp / (a.load_gbps * 1e9)
    if colocated:  # every engine generates every batch (granularity concerns the rollout ranks of async runs)
        transfer, gather, pause, k = s.weight_bytes / (a.local_sync_gbps * 1e9) + a.wake_s, 0.0, 0.0, -1
        granularity = "group"
    else:
        gather, transfer = s.weight_bytes / (a.local_sync_gbps * 1e9), s.weight_bytes / (a.sync_gbps * 1e9)
    total_groups = steps * s.batch + s.batch * (k + 2)
    heap: list = []                        # (time, seq, kind, payload)
    seq = [0]

    def push(t, kind, payload):
        seq[0] += 1
        heapq.heappush(heap, (t, seq[0], kind, payload))

    events, buffer, dropped = [], [], 0
    groups_left: dict = {}                 # group -> trajectories still running
    group_info: dict = {}                  # group -> (batch, version)
    group_tokens: dict = {}
    arrived, next_group, step, trainer_busy = 0, 0, 0, False
    step_end = {}
    traj_id = [0]

    def admissible(batch: int) -> bool:
        return arrived >= max(0, batch - 1 - k)

    def start_group(t: float, e: Engine, g: int) -> None:
        if e.version < arrived:            # apply the newest weights between generate calls: the slots pause
            e.version = arrived
            if pause and e.running:
                for tid, item in e.running.items():
                    item[0] += pause
                    push(item[0], "traj", (tid, id(e)))
            t += pause
        batch = g // s.batch
        group_info[g] = (batch, e.version)
        groups_left[g] = s.n
        group_tokens[g] = 0.0
        events.append(("start", t, g, batch, e.version))
        for _ in range(s.n):
            shape = rng.choice(s.shapes)
            traj_id[0] += 1
            end = t + s.latency(shape, scale)
            e.running[traj_id[0]] = [end, g]
            group_tokens[g] += s.train_tokens(shape, scale)
            push(end, "traj", (traj_id[0], id(e)))

    by_id = {id(e): e for e in eng}
    e_index = {id(e): i for i, e in enumerate(eng)}
    room = [(0, i) for i in range(len(eng))]  # (trajectories running, engine): group granularity's choice

    def dispatch(t: float) -> None:
        nonlocal next_group
        if granularity == "stream":  # engine i: groups i, i+K, ... in order, as slots free up, within the bound
            for i, e in enumerate(eng):
                e.next_group = i if e.next_group < 0 else e.next_group
                while (e.next_group < total_groups and admissible(e.next_group // s.batch)
                       and e.slots - len(e.running) >= s.n):
                    start_group(t, e, e.next_group)
                    e.next_group += len(eng)
            return
        if granularity == "group":
            while next_group < total_groups and admissible(next_group // s.batch):
                while room and room[0][0] != len(eng[room[0][1]].running):
                    heapq.heappop(room)    # a stale entry: that engine's load changed since
                if not room or eng[room[0][1]].slots - room[0][0] < s.n:
                    return
                _, i = heapq.heappop(room)  # the least loaded engine
                start_group(t, eng[i], next_group)
                heapq.heappush(room, (len(eng[i].running), i))
                next_group += 1
            return
        for i, e in enumerate(eng):        # one batch (share: its share of one batch) at a time per engine
            if not (e.queue or e.running):
                if granularity == "share":     # its share of every batch, in order
                    b, mine = e.busy_batch + 1, share(s.batch, i, len(eng))
                else:                          # batch b on engine b mod K
                    b, mine = (e.busy_batch + len(eng) if e.busy_batch >= 0 else i), range(s.batch)
                if mine and b * s.batch < total_groups and admissible(b):
                    e.busy_batch = b
                    e.queue = [b * s.batch + j for j in mine]
            while e.queue and e.slots - len(e.running) >= s.n:
                start_group(t, e, e.queue.pop(0))

    def try_train(t: float) -> None:
        nonlocal trainer_busy, dropped
        if trainer_busy or step >= steps:
            return
        # step+1 trains: batch `step` (share / batch granularity), or the oldest finished groups (group), but
        # not before every running group that would be too old for the next step has finished
        for x in [x for x in buffer if (step - x[1]) > k + 1]:
            buffer.remove(x)
            dropped += 1
            events.append(("drop", t, step + 1, x[0], x[1]))
        if granularity == "group":
            if any(groups_left[g] and step - group_info[g][1] == k + 1 for g in groups_left):
                return
            pick = sorted(buffer, key=lambda x: (x[1], x[0]))[:s.batch]
        else:
            pick = [x for x in buffer if group_info[x[0]][0] == step]
        if len(pick) < s.batch:
            return
        for x in pick:
            buffer.remove(x)
        tokens = sum(group_tokens[x[0]] for x in pick)
        end = t + s.train_seconds(tokens, train_gpus) + gather
        trainer_busy = True
        events.append(("train", t, end, step + 1, [(x[0], x[1]) for x in pick]))
        push(end, "trained", step + 1)

    dispatch(0.0)
    while heap:
        t, _, kind, payload = heapq.heappop(heap)
        if kind == "traj":
            tid, eid = payload
            e = by_id[eid]
            item = e.running.get(tid)
            if item is None or item[0] != t:
                continue                   # superseded by a pause
            del e.running[tid]
            heapq.heappush(room, (len(e.running), e_index[eid]))
            g = item[1]
            groups_left[g] -= 1
            if groups_left[g] == 0:
                events.append(("done", t, g))
                buffer.append((g, group_info[g][1], t))
                try_train(t)
            dispatch(t)
        elif kind == "trained":
            step, trainer_busy = payload, False
            step_end[step] = t
            push(t + transfer, "arrive", step)
            events.append(("publish", t, step))
            if step >= steps:
                break
            try_train(t)
        elif kind == "arrive":
            arrived = max(arrived, payload)
            dispatch(t)
            try_train(t)
    if step < steps:
        raise RuntimeError(f"simulation stalled at step {step} of {steps} (k={k}, {granularity})")
    span = step_end[steps] - step_end[1]
    return Result(samples_per_s=(steps - 1) * s.batch * s.n / span, step_s=span / (steps - 1), dropped=dropped,
                  events=events)


# ------------------------------------------------------------------------------------------------------------------
# Splits, the table, the command line
# ------------------------------------------------------------------------------------------------------------------
def split_step(s: Setup, gpus: int) -> int:
    """Rollout GPUs come in whole nodes (8) from 16 GPUs on, else in multiples of max(tp, engine_tp)."""
    return 8 if gpus >= 16 else max(s.tp, s.engine_tp)


def candidate_splits(s: Setup, gpus: int) -> list[int]:
    """Rollout-GPU counts to try: the whole-node counts nearest the balance of generation and training (each side
    estimated from the mean trajectory: generation capacity-bound at slots / mean latency trajectories per second),
    two on each side."""
    step = split_step(s, gpus)
    options = [r for r in range(step, gpus, step) if (gpus - r) % s.tp == 0 and r % s.engine_tp == 0]
    if not options:
        raise UsageError(f"{gpus} GPUs cannot be split into trainer GPUs (a multiple of tp={s.tp}) and rollout GPUs "
                         f"(a multiple of {step}): pass more --gpus")
    scale = token_scale(s.shapes, s.args.turn_tokens)
    mean_lat = sum(s.latency(x, scale) for x in s.shapes) / len(s.shapes)
    traj = s.batch * s.n

    def imbalance(r: int) -> float:
        gen = traj * mean_lat / (r * s.args.slots_per_gpu)
        return abs(math.log(gen / s.train_seconds(s.mean_step_tokens, gpus - r)))
    best = min(range(len(options)), key=lambda i: imbalance(options[i]))
    return options[max(0, best - 2):best + 3]


def run_all(args, setups: list) -> list[dict]:
    rows = []
    for s in setups:
        for gpus in args.gpus:
            if gpus % s.engine_tp or gpus % s.tp:
                raise UsageError(f"--gpus {gpus} is not a multiple of {s.name}'s tp ({s.tp}) and engine_tp "
                                 f"({s.engine_tp})")
            sync = simulate(s, train_gpus=gpus, engines=gpus // s.engine_tp, k=-1, steps=args.steps, seed=args.seed,
                            colocated=True, granularity=args.granularity)
            row = {"recipe": s.name, "gpus": gpus, "sync_step_s": sync.step_s, "sync": sync.samples_per_s, "async": {}}
            splits = [args.rollout_gpus] if args.rollout_gpus else candidate_splits(s, gpus)
            for k in args.staleness:
                best = None
                for r in splits:
                    if r >= gpus:
                        raise UsageError(f"--rollout-gpus {r} leaves no trainer GPU of {gpus}")
                    res = simulate(s, train_gpus=gpus - r, engines=r // s.engine_tp, k=k, steps=args.steps,
                                   seed=args.seed, granularity=args.granularity)
                    if best is None or res.samples_per_s > best[1].samples_per_s:
                        best = (r, res)
                r, res = best
                row["async"][k] = {"rollout_gpus": r, "samples_per_s": res.samples_per_s, "step_s": res.step_s,
                                   "speedup": res.samples_per_s / sync.samples_per_s, "dropped": res.dropped}
            rows.append(row)
    return rows


def render(rows: list, args, setups: list) -> str:
    ks = args.staleness
    head = ("| recipe | GPUs | sync step (s) | sync samples/s | "
            + " | ".join(f"async k={k}: rollout GPUs, samples/s, speed-up" for k in ks) + " |")
    out = [head, "|" + "---|" * (4 + len(ks))]
    for r in rows:
        cells = []
        for k in ks:
            a = r["async"][k]
            drop = f", {a['dropped']} dropped" if a["dropped"] else ""
            cells.append(f"{a['rollout_gpus']}/{r['gpus']}, {a['samples_per_s']:.1f}, **{a['speedup']:.2f}x**{drop}")
        out.append(f"| {r['recipe']} | {r['gpus']} | {r['sync_step_s']:.1f} | {r['sync']:.1f} | "
                   + " | ".join(cells) + " |")
    out += ["", "| peer | published speed-up | source |", "|---|---|---|"]
    out += [f"| {a} | {b} | {c} |" for a, b, c in PEERS]
    a = args
    out += ["", "Assumptions: " + "; ".join([
        f"generation times from {a.dump or 'the CPU demo GRPO run (DEMO_TAIL)'} rescaled to "
        + (f"{a.turn_tokens:g} tokens per model turn" if a.turn_tokens else "its own token counts"),
        f"{a.decode_tok_s:g} tok/s per sequence, {a.slots_per_gpu} slots per GPU, {a.search_s:g} s per search",
        "training: " + (f"{a.train_seconds:g} s per step measured at {a.train_gpus} GPUs, scaled linearly"
                        if a.train_seconds else
                        f"10 x active params FLOPs per token at {a.peak_tflops:g} TFLOPs x MFU "
                        + ", ".join(f"{s.name} {s.mfu:g}" for s in setups)),
        f"prompt {a.prompt_tokens:g} + observation {a.obs_tokens:g} tokens per search in the trained sequence",
        f"weights bf16 ({', '.join(f'{s.name} {s.weight_bytes / 1e9:.1f} GB' for s in setups)}): colocated "
        f"{a.local_sync_gbps:g} GB/s + {a.wake_s:g} s wake/sleep per step; disaggregated gather at "
        f"{a.local_sync_gbps:g} GB/s, {a.sync_gbps:g} GB/s to the engines, engine load {a.load_gbps:g} GB/s",
        f"{a.granularity} granularity, {a.steps} steps (2..{a.steps} timed), seed {a.seed}",
        "batch sizes as in the recipes at every GPU count; the best of a few whole-node splits"])]
    return "\n".join(out)


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{text!r} is not a comma-separated list of integers") from None
    if not values:
        raise ValueError("empty list")
    return values


def parse_args(argv: Optional[Sequence[str]]):
    p = ArgumentParser(prog="sim_async.py", description=__doc__.split("\n\n")[0],
                       epilog=__doc__.split("\n\n", 1)[1])

    def ints(low: int):
        def conv(text: str) -> list[int]:
            import argparse
            try:
                values = int_list(text)
            except ValueError as e:
                raise argparse.ArgumentTypeError(str(e)) from None
            if min(values) < low:
                raise argparse.ArgumentTypeError(f"{text!r}: every value must be >= {low}")
            return values
        return conv

    p.add_argument("--recipes", default="7b,30b-a3b", help=f"comma-separated, of {', '.join(RECIPES)}")
    p.add_argument("--gpus", type=ints(2), default="8,64,256", help="GPU counts (comma-separated)")
    p.add_argument("--staleness", type=ints(0), default="0,1,2", help="rollout.max_staleness values k")
    p.add_argument("--rollout-gpus", type=at_least(1), default=None,
                   help="fix the rollout GPUs of the async runs (default: the best of a few whole-node splits)")
    p.add_argument("--granularity", choices=("share", "group", "stream", "batch"), default="share",
                   help="share: every engine its contiguous share of every batch (the runtime's default); stream: "
                        "group g on engine g mod K, in order, batches whole (the runtime's streamed groups); group: "
                        "any engine takes the next group, the trainer any finished groups (not built); batch: batch "
                        "b to engine b mod K (the runtime before shares)")
    p.add_argument("--dump", default=None, help="a trajectories.jsonl / val_trajectories.jsonl to replay "
                                                "(default: the CPU demo's, embedded)")
    p.add_argument("--turn-tokens", type=at_least(0, float), default=150.0,
                   help="mean generated tokens per model turn after rescaling the dump (0: the dump's own)")
    p.add_argument("--decode-tok-s", type=above(0), default=40.0, help="decode speed of one sequence (tokens/s)")
    p.add_argument("--slots-per-gpu", type=at_least(1), default=256, help="sequences one GPU's engine runs at once")
    p.add_argument("--search-s", type=at_least(0, float), default=0.5, help="seconds per search call")
    p.add_argument("--prompt-tokens", type=at_least(0, float), default=250.0, help="prompt tokens per trajectory")
    p.add_argument("--obs-tokens", type=at_least(0, float), default=300.0,
                   help="observation tokens per search (capped at rollout.max_obs_length)")
    p.add_argument("--peak-tflops", type=above(0), default=989.0, help="bf16 dense peak of one GPU (H100 SXM)")
    p.add_argument("--mfu", type=above(0), default=None, help="training MFU (default: 0.30 dense, 0.15 MoE)")
    p.add_argument("--train-seconds", type=above(0), default=None,
                   help="a measured training step (time/update + log-prob passes) to use instead of the FLOPs model")
    p.add_argument("--train-gpus", type=at_least(1), default=8, help="the GPUs --train-seconds was measured on")
    p.add_argument("--local-sync-gbps", type=above(0), default=50.0, help="colocated weight sync / trainer gather")
    p.add_argument("--wake-s", type=at_least(0, float), default=2.0, help="colocated engine wake + sleep per step")
    p.add_argument("--sync-gbps", type=above(0), default=5.0, help="trainer -> engines transfer (disaggregated)")
    p.add_argument("--load-gbps", type=above(0), default=25.0, help="an engine loading received weights")
    p.add_argument("--steps", type=at_least(3), default=12, help="training steps simulated (2..steps timed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    args = p.parse_args(argv)
    if args.mfu is not None and args.mfu > 1:
        raise UsageError(f"--mfu {args.mfu} must be <= 1 (a fraction of --peak-tflops)")
    names = [x.strip() for x in args.recipes.split(",") if x.strip()]
    bad = [x for x in names if x not in RECIPES]
    if bad or not names:
        raise UsageError(f"--recipes {args.recipes!r}: unknown {', '.join(bad) or 'empty'} (choose from "
                         f"{', '.join(RECIPES)})")
    args.recipes = names
    if args.dump is not None and not os.path.isfile(args.dump):
        raise UsageError(f"--dump {args.dump!r} does not exist (pass a run's trajectories.jsonl)")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    shapes = read_dump(args.dump) if args.dump else demo_shapes()
    setups = [load_setup(name, shapes, args) for name in args.recipes]
    rows = run_all(args, setups)
    print(render(rows, args, setups))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
