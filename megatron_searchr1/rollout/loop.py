"""The multi-turn search loop: a per-sample state machine, batched per turn over the samples still active.

    trajs = [Trajectory.start(prompt_ids, uid=..., sample=i) for ...]
    stats = run_rollout(engine, tokenizer, client.search, trajs, LoopSettings(max_turns=4, ...))

One turn, for every active sample at once:
  1. generate from `prompt_ids + response_ids` until `</search>` or `</answer>` (stop strings: nothing is
     generated past them, unlike Search-R1, which decodes every turn to its length limit and cuts);
  2. keep the engine's token ids and log-probs as they are (token-in, token-out: generated text is decoded only
     to read the action, never re-tokenized), loss mask 1;
  3. read the action from this turn's text: `<answer>` ends the sample; `<search> q </search>` queues `q`;
     anything else gets Search-R1's invalid-action text appended (loss mask 0);
  4. all of the turn's queries go to the retrieval client in one call; each observation is
     `data.prompts.format_observation(docs)` tokenized on its own (so rollouts and the SFT data agree byte for
     byte), cut to `max_obs_length` tokens keeping its closing tag, appended with loss mask 0.
That is Search-R1's protocol (the default, rollout.protocol=search_r1). What a protocol decides (stops, reading a
turn, observations, feedback) lives in rollout/protocols/: with rollout.protocol=tool_calls a turn's calls are read
in the model's own format, run on the configured tools (a search is a call of the `search` tool), and their results
appended as the chat template's tool-message delta; calls that cannot run get error observations, and
`max_invalid_calls` of them in a row end the trajectory `invalid_calls`.
After `max_turns` search turns comes one last turn in which a search is no longer run (Search-R1's final
turn); a sample that still does not answer ends `max_turns` (it searched) or `invalid` (it did not).
The prompt is never cut: `max_response_length` bounds the response, and a sample that reaches it ends `length`.
A failed search (the client's `SearchFailure` observation, "Search failed: ...") ends the sample `search_error` after
its observation. The loop never decides whether a run may go on: the trainer's searcher (trainer/roles.py
RolloutWorker.search, one search per engine group, counted by search/client.py SearchGuard) does, between rollouts.

Every turn asserts that response ids, loss mask, log-probs and versions have equal lengths.

Policy versions. Each response token carries the version of the weights the engine held when it was appended
(`Trajectory.versions`; observations and feedback take the version of the turn they follow). The caller's
`weights` hook runs before every turn's generate calls and returns the version the engine holds for that turn; a
disaggregated rollout rank with `rollout.partial` loads newer weights inside it, so a trajectory continues under the
new policy from its next turn on (trainer/rollout_rank.py). Without the hook every token is version 0.

On an engine that keeps sessions (vLLM, `rollout.kv_sessions`) each trajectory is one session: its KV cache stays in
the engine from turn to turn and a turn computes only the tokens after it (the observation); a finished trajectory's
session ends right away, the rest when the rollout ends.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Callable, Optional, Sequence

from megatron_searchr1.config.rl import RolloutConfig
from megatron_searchr1.data.prompts import INVALID_ACTION_FEEDBACK
from megatron_searchr1.rollout.engine import Engine, SamplingParams, keeps_sessions
from megatron_searchr1.rollout.protocols import Action, ProtocolSpec, build_protocol
from megatron_searchr1.rollout.protocols.search_r1 import parse_action  # noqa: F401  (re-exported)
from megatron_searchr1.rollout.protocols.tools import is_tool_failure, tool_specs

FINISH_REASONS = ("answer", "length", "max_turns", "invalid", "search_error", "invalid_calls")

# queries -> one observation text per query (RetrievalClient.search: formatted docs or a SearchFailure)
Searcher = Callable[[list[str]], list[str]]


@dataclass
class Trajectory:
    """One sample of one prompt, growing turn by turn."""

    prompt_ids: list[int]
    """The rendered, tokenized prompt; never cut."""
    uid: str = ""
    """Group id: the prompt's `extra_info.uid` (GRPO groups the n samples of one prompt by it)."""
    sample: int = 0
    """Which of the prompt's n samples this is."""
    response_ids: list[int] = field(default_factory=list)
    """Everything after the prompt: generated turns and observations."""
    loss_mask: list[int] = field(default_factory=list)
    """1 for tokens the policy generated, 0 for observations and invalid-action feedback."""
    logprobs: list[float] = field(default_factory=list)
    """The engine's log-prob of each generated token; 0.0 at mask-0 positions."""
    versions: list[int] = field(default_factory=list)
    """The policy version of each response token: the weights that generated it (mask-0 tokens: those of the turn
    they follow). Non-decreasing; more than one value only under partial rollouts."""
    turns: int = 0
    """Generation turns taken."""
    n_searches: int = 0
    """Searches run (queries sent)."""
    n_invalid: int = 0
    """Turns with neither a search nor an answer."""
    n_tool_calls: int = 0
    """Tool calls the model made (tool_calls protocol; a search is one under either protocol)."""
    n_invalid_calls: int = 0
    """Calls that could not run: unknown tool, unreadable JSON, arguments off the tool's schema."""
    invalid_streak: int = 0
    """Invalid calls in a row (rollout.max_invalid_calls of them end the trajectory `invalid_calls`)."""
    queries: list[str] = field(default_factory=list)
    """The queries, in order."""
    finish_reason: Optional[str] = None
    """None while active; then one of FINISH_REASONS."""
    answer: Optional[str] = None
    """The text inside <answer> ... </answer>, when the sample answered."""
    meta: dict = field(default_factory=dict)
    """What the trainer carries along (data_source, ground truth, question)."""
    routed_experts: Optional[object] = None
    """MoE routing replay: the engine's expert ids of every prompt and response token, (n, MoE layers, topk) int16,
    -1 where the engine computed none; set when the rollout ends (rollout/engines/vllm_routing.py attach)."""

    @property
    def active(self) -> bool:
        return self.finish_reason is None

    def extend(self, ids: Sequence[int], mask: int, logprobs: Optional[Sequence[float]] = None,
               version: int = 0) -> None:
        ids = list(ids)
        self.response_ids += ids
        self.loss_mask += [mask] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.versions += [version] * len(ids)
        if not (len(self.response_ids) == len(self.loss_mask) == len(self.logprobs) == len(self.versions)):
            raise AssertionError(f"trajectory {self.uid}/{self.sample}: ids {len(self.response_ids)}, mask "
                                 f"{len(self.loss_mask)}, logprobs {len(self.logprobs)} and versions "
                                 f"{len(self.versions)} differ in length")

    def finish(self, reason: str) -> None:
        assert reason in FINISH_REASONS, reason
        self.finish_reason = reason


_ROLLOUT = {f.name: f.default for f in fields(RolloutConfig)}  # config.rollout's defaults: the one place they live


@dataclass(frozen=True)
class LoopSettings:
    """What one rollout does (the trainer fills it from config.rollout). The fields named as RolloutConfig's mean
    what they mean there and take their defaults from it."""

    max_turns: int = _ROLLOUT["max_turns"]
    """Search turns before the final answer turn."""
    max_tokens_per_turn: int = _ROLLOUT["max_tokens_per_turn"]
    """Most tokens generated in one turn."""
    max_response_length: int = _ROLLOUT["max_response_length"]
    """Token budget of a whole response; the prompt is never cut."""
    max_obs_length: int = _ROLLOUT["max_obs_length"]
    """Most tokens of one observation."""
    temperature: float = _ROLLOUT["temperature"]
    top_p: float = _ROLLOUT["top_p"]
    top_k: int = _ROLLOUT["top_k"]
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a turn besides the stop strings (eos); such a turn is an invalid action."""
    seed: Optional[int] = None
    """Sampling seed: each generate call's base seed; the loop adds the turn number."""
    protocol_spec: ProtocolSpec = ProtocolSpec()
    """How the policy calls its tools (rollout.protocol and the tool fields; rollout/protocols/)."""


def protocol_from_config(r: RolloutConfig, tools_url: Optional[str] = None) -> ProtocolSpec:
    """config.rollout's protocol fields as a ProtocolSpec; `tools_url`: the retrieval server's root, where `/path`
    tool endpoints (the built-in `open`) live."""
    return ProtocolSpec(r.protocol, r.tool_parser, tool_specs(r.tools) if r.protocol == "tool_calls" else (),
                        r.max_invalid_calls, r.stop_at_call_end, tools_url, r.tool_timeout,
                        tuple(sorted(r.chat_template_kwargs.items())))


def settings_from_config(r: RolloutConfig, stop_token_ids: Sequence[int],
                         seed: Optional[int], tools_url: Optional[str] = None) -> tuple[LoopSettings, LoopSettings]:
    """The training and validation settings of config.rollout `r`, for every placement that runs the loop:
    training samples at `r.temperature` (top-p / top-k only when it samples: greedy decoding ignores them),
    validation at `r.val_temperature` with the run's `seed`. `tools_url`: protocol_from_config."""
    common = dict(max_turns=r.max_turns, max_tokens_per_turn=r.max_tokens_per_turn,
                  max_response_length=r.max_response_length, max_obs_length=r.max_obs_length,
                  stop_token_ids=tuple(stop_token_ids), protocol_spec=protocol_from_config(r, tools_url))
    train = LoopSettings(**common, temperature=r.temperature, top_p=r.top_p if r.temperature > 0 else 1.0,
                         top_k=r.top_k if r.temperature > 0 else -1)
    return train, LoopSettings(**common, temperature=r.val_temperature, seed=seed)


@dataclass
class RolloutStats:
    """Counters of one rollout (the trainer logs `as_metrics()`)."""

    finish: Counter = field(default_factory=Counter)
    turns: int = 0
    """Batched generate calls."""
    generated_tokens: int = 0
    """Tokens the engine decoded."""
    prefill_tokens: int = 0
    """Prompt tokens the engine computed (not served from its prefix cache)."""
    gen_seconds: float = 0.0
    search_seconds: float = 0.0

    def as_metrics(self, trajs: Sequence[Trajectory]) -> dict[str, float]:
        n = max(len(trajs), 1)
        out = {f"rollout/finish_{r}": self.finish.get(r, 0) / n for r in FINISH_REASONS}
        out.update({
            "rollout/turns_mean": sum(t.turns for t in trajs) / n,
            "rollout/searches_mean": sum(t.n_searches for t in trajs) / n,
            "rollout/invalid_turns_mean": sum(t.n_invalid for t in trajs) / n,
            "rollout/tool_calls_mean": sum(t.n_tool_calls for t in trajs) / n,
            "rollout/invalid_calls_mean": sum(t.n_invalid_calls for t in trajs) / n,
            "rollout/valid_action_ratio": 1.0 - sum(t.n_invalid for t in trajs) / max(sum(t.turns for t in trajs), 1),
            "rollout/response_length_mean": sum(len(t.response_ids) for t in trajs) / n,
            "rollout/response_length_max": max((len(t.response_ids) for t in trajs), default=0),
            "rollout/generated_tokens_mean": sum(sum(t.loss_mask) for t in trajs) / n,
            "rollout/prompt_length_mean": sum(len(t.prompt_ids) for t in trajs) / n,
            "rollout/computed_tokens": self.generated_tokens + self.prefill_tokens,
            "time/generate": self.gen_seconds,
            "time/search": self.search_seconds,
        })
        return out


def run_rollout(engine: Engine, tokenizer, search: Searcher, trajs: list[Trajectory], settings: LoopSettings,
                progress: Optional[Callable[[int, int], None]] = None,
                weights: Optional[Callable[[], int]] = None) -> RolloutStats:
    """Run every trajectory to a finish reason; returns the counters. `trajs` are filled in place. `weights`, called
    before each turn's generate calls (never during one), returns the policy version the engine holds for the turn
    (module doc); it may load newer weights first."""
    s = settings
    stats = RolloutStats()
    invalid_ids = tokenizer.encode(INVALID_ACTION_FEEDBACK, add_special_tokens=False)
    sessions = keeps_sessions(engine)
    try:
        _turns(engine, tokenizer, search, trajs, s, stats, invalid_ids, sessions, progress, weights)
    finally:
        if sessions:
            engine.end_sessions([id(t) for t in trajs])
    for t in trajs:  # max_turns = 0 and an empty batch leave nothing active; anything else was finished above
        if t.active:
            t.finish("max_turns")
    stats.finish.update(t.finish_reason for t in trajs)
    return stats


def _turns(engine: Engine, tokenizer, search: Searcher, trajs: list[Trajectory], s: LoopSettings,
           stats: RolloutStats, invalid_ids: list[int], sessions: bool,
           progress: Optional[Callable[[int, int], None]], weights: Optional[Callable[[], int]]) -> None:
    for turn in range(s.max_turns + 1):
        active = [t for t in trajs if t.active]
        if not active:
            break
        # Between turns is where new weights can come in: an engine cannot swap them inside a generate call
        # (AReaL aborts the in-flight requests and resumes them; slime's partial rollout re-queues aborted samples
        # for the next rollout). A load drops the engine's KV (sessions too): the next turn re-computes the context.
        version = weights() if weights is not None else 0
        advance(engine, tokenizer, search, active, s, lambda t: stats, invalid_ids, sessions, version,
                None if s.seed is None else s.seed + turn)
        if progress is not None:
            progress(sum(not t.active for t in trajs), len(trajs))


def advance(engine: Engine, tokenizer, search: Searcher, active: list[Trajectory], s: LoopSettings,
            stats_of: Callable[[Trajectory], RolloutStats], invalid_ids: list[int], sessions: bool, version: int,
            seed: Optional[int]) -> None:
    """One turn of every trajectory in `active` (all active; each at its own turn, `t.turns`, so a streaming caller
    may mix trajectories that started at different times): generate, read the action, run its calls. Counters go to
    `stats_of(t)`; a generate call's or a search round's time goes to each distinct stats object of its
    trajectories. `version` is the engine's policy version for this turn, `seed` the calls' base seed. What the
    protocol decides (stops, reading a turn, observations, feedback) comes from `s.protocol_spec`
    (rollout/protocols/); `invalid_ids` is kept for callers and unused: the protocol holds Search-R1's feedback."""
    proto = build_protocol(s.protocol_spec, tokenizer)
    stop_ids = tuple(s.stop_token_ids) + tuple(i for i in proto.stop_token_ids if i not in s.stop_token_ids)
    # One generate call per distinct turn budget (nearly always one: only samples near their response budget get a
    # smaller one).
    by_budget: dict[int, list[Trajectory]] = {}
    for t in active:
        left = s.max_response_length - len(t.response_ids)
        by_budget.setdefault(min(s.max_tokens_per_turn, left), []).append(t)
    turn_start = {id(t): len(t.response_ids) for t in active}
    stop_of = {}
    final = {id(t): t.turns >= s.max_turns for t in active}  # the last turn: no search, the sample must answer
    for budget, group in sorted(by_budget.items(), reverse=True):
        start = time.perf_counter()
        params = SamplingParams(max_tokens=budget, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                stop=proto.stop_strings, stop_token_ids=stop_ids, logprobs=True, seed=seed)
        prompts = [t.prompt_ids + t.response_ids for t in group]
        if sessions:  # each sample keeps its KV in the engine from turn to turn
            outs = engine.generate(prompts, params, sessions=[id(t) for t in group])
        else:
            outs = engine.generate(prompts, params)
        if len(outs) != len(group):
            raise RuntimeError(f"engine returned {len(outs)} generations for {len(group)} prompts")
        for t, g in zip(group, outs):
            st = stats_of(t)
            st.generated_tokens += len(g.token_ids)
            st.prefill_tokens += len(t.prompt_ids) + len(t.response_ids) - g.num_cached_tokens
            t.extend(g.token_ids, 1, g.logprobs, version)
            t.turns += 1
            stop_of[id(t)] = g.stop_reason
        elapsed = time.perf_counter() - start
        for st in {id(st): st for st in map(stats_of, group)}.values():
            st.turns += 1
            st.gen_seconds += elapsed

    pending: list[tuple[Trajectory, Action]] = []
    for t in active:
        action = proto.read(t.response_ids[turn_start[id(t)]:], stop_of.get(id(t)), stop_ids)
        if action.kind == "answer":
            t.answer = action.answer
            t.finish("answer")
        elif action.kind == "calls" and not final[id(t)]:
            t.queries += [c.arguments["query"].strip() for c in action.calls
                          if c.name == "search" and c.error is None and isinstance((c.arguments or {}).get("query"), str)]
            pending.append((t, action))
        elif final[id(t)]:
            if action.kind == "invalid":
                t.n_invalid += 1
            t.finish("max_turns" if action.kind == "calls" else "invalid")
        else:
            t.n_invalid += 1
            feedback = proto.feedback_ids(s.max_response_length - len(t.response_ids))
            if feedback is None:  # the protocol cannot go on after such a turn
                t.finish("invalid")
            else:
                t.extend(feedback, 0, version=version)
        if t.active and len(t.response_ids) >= s.max_response_length:
            t.finish("length")
    pending = [(t, a) for t, a in pending if t.active]

    if pending:
        calls = [c for _, a in pending for c in a.calls]
        start = time.perf_counter()
        outcomes = proto.run(calls, search)
        elapsed = time.perf_counter() - start
        for st in {id(st): st for st in (stats_of(t) for t, _ in pending)}.values():
            st.search_seconds += elapsed
        at = 0
        for t, action in pending:
            mine, at = outcomes[at: at + len(action.calls)], at + len(action.calls)
            for c, o in zip(action.calls, mine):
                t.n_tool_calls += 1
                if o.status == "invalid":
                    t.n_invalid_calls += 1
                    t.invalid_streak += 1
                else:
                    t.invalid_streak = 0
                    t.n_searches += c.name == "search"
            room = s.max_response_length - len(t.response_ids)
            ids = proto.observation_ids(action, [o.text for o in mine], room, s.max_obs_length)
            if ids is None:  # the results cannot follow within the budget
                t.finish("length")
                continue
            t.extend(ids, 0, version=version)
            if any(is_tool_failure(o.text) for o in mine):
                t.finish("search_error")
            elif t.invalid_streak >= s.protocol_spec.max_invalid_calls:
                t.finish("invalid_calls")
            elif len(t.response_ids) >= s.max_response_length:
                t.finish("length")
    if sessions:  # a finished sample's KV is not needed any more
        engine.end_sessions([id(t) for t in active if not t.active])


def response_text(tokenizer, t: Trajectory) -> str:
    """The whole response as text (for the reward and for printing; never tokenized again)."""
    return tokenizer.decode(t.response_ids, skip_special_tokens=False)


def generated_text(tokenizer, t: Trajectory) -> str:
    """What the model wrote: the loss-mask-1 runs (its turns), each decoded on its own, joined in order. The
    reward reads this: observations and the invalid-action feedback are not the model's words (the feedback
    itself spells out ``<answer> and </answer>``, which would read as an answer of a trajectory that never gave
    one).
    """
    runs, start = [], None
    for i, m in enumerate(list(t.loss_mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append(tokenizer.decode(t.response_ids[start:i], skip_special_tokens=False))
            start = None
    return "".join(runs)
