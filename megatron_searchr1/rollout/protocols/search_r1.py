"""Search-R1's protocol: `<search> q </search>` -> `<information> docs </information>` ... `<answer> a </answer>`.

The prompt is rendered by the data pipeline (data/prompts.py render_prompt, the same call the SFT data makes). A turn
is read by its first complete tag pair (`parse_action`); a search is one call of the `search` tool; its observation
is `format_observation(docs)` tokenized on its own (so rollouts and the SFT data agree byte for byte), cut to the
budget keeping the closing tag; a turn with neither tag gets Search-R1's invalid-action text.
"""
from __future__ import annotations

import re
from typing import Optional, Sequence

from megatron_searchr1.data.prompts import (
    ANSWER_END, ANSWER_START, INFO_END, INVALID_ACTION_FEEDBACK, SEARCH_END, SEARCH_START, STOP_STRINGS,
    format_observation, render_prompt,
)
from megatron_searchr1.rollout.protocols import Action, Protocol
from megatron_searchr1.rollout.protocols.parsers import ToolCall
from megatron_searchr1.rollout.protocols.tools import BUILTIN, ToolBox

_ACTION = re.compile(rf"{re.escape(SEARCH_START)}(.*?){re.escape(SEARCH_END)}|"
                     rf"{re.escape(ANSWER_START)}(.*?){re.escape(ANSWER_END)}", re.DOTALL)


def parse_action(turn_text: str) -> tuple[str, Optional[str]]:
    """('search', query) | ('answer', answer) | ('invalid', None) for the text of ONE generated turn.

    The first complete tag pair decides (generation stops at the first closing tag anyway).

    >>> parse_action("<think> x </think>\\n<search> who founded Acme? </search>")
    ('search', 'who founded Acme?')
    >>> parse_action("<think> done </think>\\n<answer> 1856 </answer>")
    ('answer', '1856')
    >>> parse_action("<think> I will search for </think>")
    ('invalid', None)
    """
    m = _ACTION.search(turn_text)
    if m is None:
        return "invalid", None
    if m.group(1) is not None:
        return "search", m.group(1).strip()
    return "answer", m.group(2).strip()


def observation_ids(tokenizer, docs_text: str, budget: int) -> list[int]:
    """Token ids of `format_observation(docs_text)`, at most `budget` of them, the closing tag kept when cut."""
    ids = tokenizer.encode(format_observation(docs_text), add_special_tokens=False)
    if len(ids) <= budget:
        return ids
    tail = tokenizer.encode(f"{INFO_END}\n\n", add_special_tokens=False)
    return ids[: max(budget - len(tail), 0)] + tail[:budget]


class SearchR1Protocol(Protocol):
    name = "search_r1"
    stop_strings = STOP_STRINGS

    def __init__(self, tokenizer, chat_template: str = "auto"):
        self.tokenizer, self.chat_template = tokenizer, chat_template
        self.invalid_ids = tokenizer.encode(INVALID_ACTION_FEEDBACK, add_special_tokens=False)
        self.box = ToolBox([BUILTIN["search"]])  # a search is a call of the search tool: the rollout's searcher

    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        return self.tokenizer.encode(render_prompt(list(messages), self.tokenizer, self.chat_template),
                                     add_special_tokens=False)

    def read(self, turn_ids: Sequence[int], stop, stop_ids: Sequence[int] = ()) -> Action:
        kind, content = parse_action(self.tokenizer.decode(list(turn_ids), skip_special_tokens=False))
        if kind == "search":
            return Action("calls", calls=[ToolCall("search", {"query": content})], stop=stop)
        if kind == "answer":
            return Action("answer", answer=content, stop=stop)
        return Action("invalid", stop=stop)

    def observation_ids(self, action: Action, results: Sequence[str], room: int, max_obs: int) -> Optional[list[int]]:
        (docs,) = results
        return observation_ids(self.tokenizer, docs, min(max_obs, room))

    def feedback_ids(self, budget: int) -> Optional[list[int]]:
        return self.invalid_ids[:budget]
