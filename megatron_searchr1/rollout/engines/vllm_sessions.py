"""KV sessions: each sample is one resumable vLLM request for the whole rollout (`VLLMEngine.generate(sessions=)`).

vLLM's prefix cache reuses whole KV blocks only (32 tokens on the CPU), so a new request per turn recomputes the
last partial block of the context every turn, and what it reuses can be evicted while the sample waits for its
search. With `generate(..., sessions=keys)` each sample is one resumable vLLM request for the whole rollout (vLLM's
streaming-input sessions): a stopped turn keeps its KV blocks, and the next turn sends only the tokens after what the
engine holds (the turn's last sampled token, which vLLM has not computed yet, and the observation). Stop strings are
not available on such requests, so the engine stops on every token that could complete one (any token whose text
holds a stop string's last character) and looks at the turn's text: a stop string ends the turn as vLLM's own check
would (its tokens last, nothing after them); otherwise the request resumes at once, losing nothing (the paused token
is the next one computed anyway). With `seed_per_request` a session's own random stream continues from turn to
turn; otherwise each call samples from its one seeded stream, as plain requests do. Sessions end with
`end_sessions()`, before a weight sync (its prefix-cache reset), sleep and close. A prompt that does not extend its
session's tokens starts a new one.

This drives private vLLM 0.32 APIs (the input processor's resumable requests, the scheduler's session update, the
in-process engine core): `VLLM_TESTED` in vllm_engine.py names the versions it is tested with.
"""
from __future__ import annotations

import copy
import inspect
import itertools
import logging
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Optional, Sequence

from megatron_searchr1.rollout.engine import Generation, SamplingParams

# the engine's logger: sessions are part of VLLMEngine, and users filter its messages by that name
logger = logging.getLogger("megatron_searchr1.rollout.engines.vllm_engine")


def sampled_tokens(completion, logprobs: bool) -> tuple[list[int], list[float]]:
    """A vLLM completion's token ids and, when asked for, the log-prob of each sampled token (else zeros)."""
    ids = list(completion.token_ids)
    if not logprobs:
        return ids, [0.0] * len(ids)
    return ids, [step[tok].logprob for step, tok in zip(completion.logprobs, ids)]


def check_finish(finish: Optional[str], what: str = "a request") -> None:
    """Only stop and length end our requests; anything else (abort) is an engine failure, not a sample."""
    if finish not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished {what} with finish_reason={finish!r} (aborted?)")


def sessions_available() -> bool:
    """vLLM's engine core keeps resumable requests (streaming-input sessions), as in vLLM 0.32."""
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.engine.input_processor import InputProcessor
    except ImportError:
        return False
    return ("resumable" in inspect.signature(InputProcessor.process_inputs).parameters
            and hasattr(Scheduler, "_update_request_as_session"))


def stop_candidates(token_texts: Sequence[str], stops: Sequence[str]) -> frozenset[int]:
    r"""The ids whose token can complete one of `stops`: its text (decoded alone) holds a stop's last character.

    A byte-level tokenizer can split a multi-byte character over tokens; a token decoded alone then shows
    U+FFFD, so for a stop string that ends in a non-ASCII character those ids are candidates too. One that ends in
    an ASCII character needs none of them: UTF-8 never hides an ASCII byte inside a multi-byte sequence, so a token
    holding that byte shows the character itself (Search-R1's stops all end in '>'). Counts on a Qwen-sized BPE:
    tools/benchmarks/NOTES-vllm.md.

    >>> sorted(stop_candidates(["a", "b>", "\ufffd", ">\n", "</answer>"], ["</answer>"]))
    [1, 3, 4]
    >>> sorted(stop_candidates(["a", "\u300d", "\ufffd"], ["\u300d"]))
    [1, 2]
    """
    lasts = {st[-1] for st in stops}
    partial = any(not c.isascii() for c in lasts)
    return frozenset(i for i, t in enumerate(token_texts) if (partial and "\ufffd" in t) or any(c in t for c in lasts))


@dataclass
class _Session:
    """One sample's resumable vLLM request."""

    request_id: str
    """vLLM's internal request id."""
    external_id: str
    """Ours: what vLLM's outputs carry."""
    tokens: list[int]
    """The sequence the request holds: context + generated ids; vLLM has computed all but the last one."""


@dataclass
class _Turn:
    """One prompt of a generate() call running in a session."""

    index: int
    session: _Session
    cached: Optional[int]
    """Context tokens the engine did not compute: held by the session, else vLLM's prefix-cache count (None yet)."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)



class KVSessions:
    """The sessions of one VLLMEngine (the module docstring), a part the engine owns: `engine.sessions`.

    It holds its own state (the live sessions by key, the stop-candidate sets, the pause count) and reaches vLLM only
    through the `vllm.LLM` it is given; `sampling_params(params, index, max_tokens=, session_stop_ids=)` is the
    engine's request builder, so session and plain requests sample alike."""

    def __init__(self, llm, sampling_params: Callable):
        self.llm = llm
        self._sampling_params = sampling_params
        self.held: dict[Hashable, _Session] = {}
        """Live sessions by the caller's key."""
        self._ids = itertools.count()
        self._stop_candidates: dict[tuple[str, ...], frozenset[int]] = {}
        self.pauses = 0
        """Session turns paused at a token that could have completed a stop string but did not, then resumed."""
        self._warned_room = False

    def scheduler(self):
        """The in-process engine core's scheduler (what sessions are sized against), or None where it is not there."""
        sched = getattr(getattr(getattr(self.llm.llm_engine, "engine_core", None), "engine_core", None),
                        "scheduler", None)
        needed = ("max_num_active_reqs", "kv_cache_manager", "running")
        return sched if sched is not None and all(hasattr(sched, n) for n in needed) else None

    def candidates(self, stops: tuple[str, ...]) -> frozenset[int]:
        """Token ids that could complete one of `stops` (stop_candidates over this engine's vocabulary)."""
        if not stops:
            return frozenset()
        if stops not in self._stop_candidates:
            tok = self.llm.get_tokenizer()
            vocab = max(len(tok), max(tok.get_vocab().values()) + 1)
            texts = tok.batch_decode([[i] for i in range(vocab)], skip_special_tokens=False)
            self._stop_candidates[stops] = stop_candidates(texts, stops)
        return self._stop_candidates[stops]

    def _send(self, session: _Session, tokens: list[int], sp, new: bool) -> None:
        """Hand vLLM a session's first request (`new`) or the tokens that continue it."""
        from vllm.inputs import TokensPrompt

        eng = self.llm.llm_engine
        # a copy: vLLM extends a session's prompt list in place when the next chunk arrives
        req = eng.input_processor.process_inputs(session.external_id, TokensPrompt(prompt_token_ids=list(tokens)), sp,
                                                 supported_tasks=eng.get_supported_tasks(), resumable=True)
        # vLLM checks `last token in stop_token_ids` after every token, and keeps a list: with hundreds of candidate
        # ids that is a linear scan per token on the engine thread. A frozenset makes it one hash lookup.
        req.sampling_params.stop_token_ids = frozenset(req.sampling_params.stop_token_ids or ())
        if new:
            eng.input_processor.assign_request_id(req)
            session.request_id = req.request_id
        else:
            req.request_id, req.external_req_id = session.request_id, session.external_id
        # In-process, the output processor's request state and the scheduler's request would share one prompt list,
        # and both extend it when a session continues (each chunk would be appended twice): give each its own.
        own = copy.copy(req)
        own.prompt_token_ids = list(req.prompt_token_ids)
        eng.output_processor.add_request(own, None, None, 0)
        eng.engine_core.add_request(req)

    def room(self, prompts: Sequence[list[int]], params: SamplingParams,
                           keys: Sequence[Hashable]) -> bool:
        """Whether this call's sessions fit in vLLM at once; if not, the call runs as plain requests.

        A session paused at the end of its turn keeps its request slot and its KV blocks until it ends. vLLM queues
        plain requests that do not fit, but a call whose sessions cannot all be alive at once would wait forever
        for a slot or a block that only a later turn frees. So: every session of the call must fit in
        `max_num_seqs` slots and in the KV cache with its whole turn; sessions of other samples are ended first
        when they are in the way (their full blocks stay in the prefix cache).
        """
        sched = self.scheduler()
        slots = sched.max_num_active_reqs
        blocks = sched.kv_cache_manager.block_pool.num_gpu_blocks - 1  # vLLM keeps one null block
        size = self.llm.llm_engine.vllm_config.cache_config.block_size
        need = sum(-(-(len(p) + params.max_tokens) // size) for p in prompts)
        if len(keys) > slots or need > blocks:
            if not self._warned_room:
                self._warned_room = True
                logger.warning("%d samples needing %d KV blocks do not fit in %d request slots (max_num_seqs) and "
                               "%d KV blocks at once: such turns run without KV sessions (prefix cache only)",
                               len(keys), need, slots, blocks)
            return False
        mine = set(keys)
        others = [k for k in self.held if k not in mine]
        held = sum(-(-len(self.held[k].tokens) // size) for k in others)
        if len(others) + len(keys) > slots or held + need > blocks:
            self.end(others)
        return True

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams,
                              keys: Sequence[Hashable]) -> list[Generation]:
        stops = tuple(params.stop)
        real_stop_ids = set(params.stop_token_ids)
        stop_ids = sorted(real_stop_ids | self.candidates(stops))
        window = max((len(st) for st in stops), default=0) + 2  # tokens enough to hold any stop string
        tok = self.llm.get_tokenizer() if stops else None
        turns: dict[str, _Turn] = {}
        max_len = self.llm.llm_engine.model_config.max_model_len
        for i, (prompt, key) in enumerate(zip(prompts, keys)):
            prompt = list(prompt)
            if len(prompt) >= max_len:
                raise ValueError(f"prompt {i} has {len(prompt)} tokens, the engine's max_model_len is {max_len}")
            sp = self._sampling_params(params, i, session_stop_ids=stop_ids)
            held = self.held.get(key)
            if held is not None and len(prompt) >= len(held.tokens) and prompt[:len(held.tokens)] == held.tokens:
                # vLLM holds held.tokens[:-1]; its last sampled token and what follows are the new input
                turns[held.external_id] = _Turn(i, held, cached=len(held.tokens) - 1)
                self._send(held, prompt[len(held.tokens) - 1:], sp, new=False)
                held.tokens = prompt
            else:
                if held is not None:
                    self.end([key])
                session = _Session("", f"mss-{next(self._ids)}", prompt)
                self.held[key] = session
                turns[session.external_id] = _Turn(i, session, cached=None)
                self._send(session, prompt, sp, new=True)

        gens: list[Optional[Generation]] = [None] * len(prompts)
        scheduler = self.scheduler()
        running, idle_steps = len(turns), 0
        while running:
            outputs = self.llm.llm_engine.step()
            # a step that runs nothing (no request scheduled, none producing output) while ours wait: stuck
            idle_steps = 0 if outputs or scheduler.running else idle_steps + 1
            if idle_steps > 3:
                raise RuntimeError(
                    f"vLLM stopped making progress with {running} requests waiting: the KV cache cannot hold every "
                    f"sample's session ({len(self.held)} held); give the engine more KV cache or set "
                    f"kv_sessions=False")
            for out in outputs:
                turn = turns.get(out.request_id)
                if turn is None:
                    continue
                if turn.cached is None and out.num_cached_tokens is not None:
                    turn.cached = out.num_cached_tokens
                completion = out.outputs[0]
                ids, logprobs = sampled_tokens(completion, params.logprobs)
                turn.token_ids += ids
                turn.logprobs += logprobs
                finish = completion.finish_reason
                if finish is None:
                    continue
                check_finish(finish, "a session request")
                stop_reason = completion.stop_reason if finish == "stop" else None
                if finish == "stop" and stop_reason not in real_stop_ids:
                    text = tok.decode(turn.token_ids[-window:], skip_special_tokens=False)
                    stop_reason = next((st for st in stops if st in text), None)
                    if stop_reason is None:  # a candidate that completed no stop string: go on where it paused
                        left = params.max_tokens - len(turn.token_ids)
                        if left > 0:
                            self.pauses += 1
                            self._send(turn.session, turn.token_ids[-1:],
                                       self._sampling_params(params, turn.index, max_tokens=left,
                                                             session_stop_ids=stop_ids), new=False)
                            continue
                        finish = "length"
                turn.session.tokens = turn.session.tokens + turn.token_ids
                gens[turn.index] = Generation(token_ids=turn.token_ids, logprobs=turn.logprobs, finish_reason=finish,
                                              stop_reason=stop_reason, num_cached_tokens=turn.cached or 0)
                running -= 1
        return gens  # type: ignore[return-value]

    def end(self, keys: Optional[Iterable[Hashable]] = None) -> None:
        """Free the KV cache of these sessions (all without keys); their blocks stay in the prefix cache."""
        keys = list(self.held) if keys is None else [k for k in keys if k in self.held]
        if not keys:
            return
        ids = [self.held.pop(k).request_id for k in keys]
        self.llm.llm_engine.abort_request(ids, internal=True)
