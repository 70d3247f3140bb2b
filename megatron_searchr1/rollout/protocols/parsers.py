"""Tool-call parsers: the calls a model wrote in its own format, read from the text of one generated turn.

    parser = get_parser("hermes")
    content, calls = parser.parse('<think> x </think>\n<tool_call>\n{"name": "search", "arguments": {"query": "q"}}\n'
                                  '</tool_call>')

One parser per format behind one interface (`ToolCallParser`): `call_end` is the string that closes one call (the
rollout may stop generation there), `parse` returns the turn's text outside the calls and the calls in order. A
call that cannot be read (broken JSON, no name, arguments that are not an object) comes back as a `ToolCall` with
`error` set, so the rollout answers it with an error observation instead of dropping it. The parser reads only text
the model generated; its ids are never re-tokenized.

Formats:
- ``hermes``: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call (Qwen2.5, Qwen3, Hermes
  and most open models whose chat template says "return a json object ... within <tool_call></tool_call>").
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class ToolCall:
    """One call as the model wrote it."""

    name: str = ""
    """The tool's name ("" when it could not be read)."""
    arguments: Optional[dict] = None
    """The arguments object; None when the call could not be read."""
    error: Optional[str] = None
    """Why the call cannot run (set by the parser for unreadable calls, by the tool box for unknown tools or bad
    arguments); None for a call that can run."""
    raw: str = ""
    """The call's text as generated."""
    extra: dict = field(default_factory=dict)


class ToolCallParser:
    """The interface: `call_start` / `call_end` delimit one call in the generated text."""

    name = "base"
    call_start = ""
    call_end = ""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(the text outside the calls, the calls in order)."""
        raise NotImplementedError

    def render_call(self, name: str, arguments: dict) -> str:
        """The text of one call as the format writes it (for demonstrations and tests)."""
        raise NotImplementedError


class HermesParser(ToolCallParser):
    """`<tool_call>` JSON `</tool_call>` blocks.

    >>> content, calls = HermesParser().parse('ok <tool_call>\\n{"name": "open", "arguments": {"doc_id": "7"}}\\n'
    ...                                         '</tool_call>')
    >>> content, calls[0].name, calls[0].arguments, calls[0].error
    ('ok', 'open', {'doc_id': '7'}, None)
    >>> HermesParser().parse('<tool_call>{"name": "open", "arguments": {"doc_id": </tool_call>')[1][0].error[:22]
    'the call is not JSON: '
    """

    name = "hermes"
    call_start = "<tool_call>"
    call_end = "</tool_call>"
    _block = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls = []
        for m in self._block.finditer(text):
            body = m.group(1).strip()
            if not m.group(2):
                calls.append(ToolCall(raw=m.group(0), error="the call is not closed with </tool_call>"))
                continue
            calls.append(_json_call(body, m.group(0)))
        content = self._block.sub("", text).strip()
        return content, calls

    def render_call(self, name: str, arguments: dict) -> str:
        return f'{self.call_start}\n{json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)}\n' \
               f'{self.call_end}'


def _json_call(body: str, raw: str) -> ToolCall:
    """A call from its JSON object `{"name": str, "arguments": object or JSON string of one}`."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(raw=raw, error=f"the call is not JSON: {e.msg} at character {e.pos}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall(raw=raw, error='the call must be a JSON object {"name": "<tool>", "arguments": {...}}')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string, as OpenAI's API carries them
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return ToolCall(name=obj["name"], raw=raw, error="the arguments are not a JSON object")
    if not isinstance(args, dict):
        return ToolCall(name=obj["name"], raw=raw, error="the arguments must be a JSON object")
    return ToolCall(name=obj["name"], arguments=args, raw=raw)


PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser}


def get_parser(name: str) -> ToolCallParser:
    """The parser for format `name` (rollout.tool_parser)."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(PARSERS)}")
    return PARSERS[name]()
