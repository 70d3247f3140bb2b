"""How the policy talks to its tools, one implementation per protocol behind one small interface.

    spec = ProtocolSpec("tool_calls", tools=tool_specs(["search", "open"]))   # config.rollout -> settings_from_config
    proto = build_protocol(spec, tokenizer)
    prompt_ids = proto.prompt_ids([{"role": "user", "content": "Question: ..."}])
    action = proto.read(turn_ids, stop_reason, stop_ids)   # answer | calls | invalid
    ids = proto.observation_ids(action, [result, ...], room, max_obs)

What differs between protocols, and only that, lives here (the rollout's state machine, rollout/loop.py, is shared):
- ``search_r1`` (search_r1.py, the default): Search-R1's tags. The prompt is rendered by the data pipeline
  (data/prompts.py); generation stops at `</search>` / `</answer>`; `<search> q </search>` is one call of the search
  tool; the observation is an `<information>` block tokenized on its own; a turn with neither tag gets Search-R1's
  invalid-action text. Token for token what the loop did before protocols existed.
- ``tool_calls`` (tool_calls.py): the model's own chat template rendered once with the tools' JSON schemas;
  generation stops at the end of a call or of the assistant turn; calls are read by a parser per format
  (parsers.py); every tool result is appended as the template's tool message, as a token delta derived from the
  template once (never a re-render of the real history), so the trained ids are the generated ids plus the deltas.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from megatron_searchr1.rollout.protocols.parsers import ToolCall
from megatron_searchr1.rollout.protocols.tools import ToolSpec

PROTOCOLS = ("search_r1", "tool_calls")


@dataclass(frozen=True)
class ProtocolSpec:
    """What the config says about the protocol (hashable: LoopSettings carries it; `build_protocol` makes the
    working object for a tokenizer)."""

    name: str = "search_r1"
    """search_r1 | tool_calls."""
    tool_parser: str = "hermes"
    """tool_calls: the format calls are written in (parsers.py; auto: picked from the chat template)."""
    tools: tuple[ToolSpec, ...] = ()
    """tool_calls: the tools, in the order the prompt lists them."""
    max_invalid_calls: int = 3
    """tool_calls: consecutive invalid calls after which a trajectory ends `invalid_calls`."""
    stop_at_call_end: bool = True
    """tool_calls: stop generating at the end of a call (the parser's closing string), not only at the turn's end."""
    tools_url: Optional[str] = None
    """Where `/path` tool endpoints live (the retrieval server's root)."""
    tool_timeout: float = 60.0
    """Seconds per tool request."""
    chat_template_kwargs: tuple = ()
    """tool_calls: (key, value) pairs passed to every render of the chat template, the prompt's and the deltas'
    (e.g. (("enable_thinking", False),) for Qwen3)."""


@dataclass
class Action:
    """What one generated turn asks for."""

    kind: str
    """answer | calls | invalid (neither: Search-R1's feedback, or the end of a tool-calling trajectory)."""
    answer: Optional[str] = None
    calls: list[ToolCall] = field(default_factory=list)
    stop: object = None
    """How the turn ended (the engine's stop string or stop token id; None at the length limit)."""


class Protocol:
    """The interface the rollout loop drives (module doc)."""

    name = "base"
    stop_strings: tuple[str, ...] = ()
    """Generation stops at these (kept in the output)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a turn besides LoopSettings.stop_token_ids."""

    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        """The prompt, rendered once and tokenized."""
        raise NotImplementedError

    def read(self, turn_ids: Sequence[int], stop, stop_ids: Sequence[int] = ()) -> Action:
        """The action of one generated turn: its ids as generated, `stop` as the engine reported it (the stop
        string or token id), `stop_ids` the token ids that end a turn."""
        raise NotImplementedError

    def observation_ids(self, action: Action, results: Sequence[str], room: int, max_obs: int) -> Optional[list[int]]:
        """Ids to append after a `calls` turn, given one result text per call: at most `room` in all and `max_obs` per
        result (cut); None when they cannot fit (the trajectory ends `length`)."""
        raise NotImplementedError

    def feedback_ids(self, budget: int) -> Optional[list[int]]:
        """Ids appended after an invalid turn, or None: the trajectory ends `invalid`."""
        raise NotImplementedError

    def run(self, calls: Sequence[ToolCall], search) -> list:
        """One tools.Outcome per call (all of a turn's calls, every trajectory's, at once); `search` is the rollout's
        searcher, which the `search` tool goes through."""
        return self.box.run(calls, search)


_BUILT: dict = {}


def build_protocol(spec: ProtocolSpec, tokenizer) -> Protocol:
    """The protocol object of `spec` for `tokenizer` (built once per pair: a template's deltas are derived once)."""
    key = (spec, id(tokenizer))
    hit = _BUILT.get(key)
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    if spec.name == "search_r1":
        from megatron_searchr1.rollout.protocols.search_r1 import SearchR1Protocol

        proto = SearchR1Protocol(tokenizer)
    elif spec.name == "tool_calls":
        from megatron_searchr1.rollout.protocols.tool_calls import ToolCallsProtocol

        proto = ToolCallsProtocol(tokenizer, spec)
    else:
        raise ValueError(f"unknown rollout.protocol {spec.name!r}; choose one of {', '.join(PROTOCOLS)}")
    _BUILT[key] = (tokenizer, proto)
    return proto
