"""Tool-call parsers: the calls a model wrote in its own format, read from the text of one generated turn.

    parser = get_parser("hermes")
    content, calls = parser.parse('<think> x </think>\n<tool_call>\n{"name": "search", "arguments": {"query": "q"}}\n'
                                  '</tool_call>')

One parser per format behind one interface (`ToolCallParser`): `call_end` is the string that closes one call (the
rollout may stop generation there), `parse` returns the turn's text outside the calls and the calls in order. A
call that cannot be read (broken JSON, no name, arguments that are not an object) comes back as a `ToolCall` with
`error` set, so the rollout answers it with an error observation instead of dropping it. The parser reads only text
the model generated; its ids are never re-tokenized.

Formats (`rollout.tool_parser`; `auto` picks one from the chat template's text, `detect_parser`):
- ``hermes``: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call (Qwen2.5, Qwen3, Hermes
  and most open models whose chat template says "return a json object ... within <tool_call></tool_call>").
- ``qwen3_coder``: `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>` (Qwen3-Coder,
  Qwen3.5): values are raw text, typed by the tool's JSON schema (integer, number, boolean, object, array).
- ``llama3_json``: a bare `{"name": ..., "parameters": {...}}` as the whole turn (several joined by `;`), optionally
  after `<|python_tag|>`, ending at the end of the turn (`<|eot_id|>`; `<|eom_id|>` too, which the templates never
  write after a JSON call: its tool message follows as after `<|eot_id|>`). Llama 3.1 / 3.2 / 3.3.
- ``glm45``: `<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n...</tool_call>` (GLM-4.5 / 4.6 /
  4.7): values are raw text unless JSON, typed by the tool's schema as qwen3_coder's.
- ``mistral``: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (v3 tokenizers: Mistral-7B-v0.3, Nemo) or
  `[TOOL_CALLS]NAME[ARGS]{...}` per call (v11+ tokenizers), ending at the eos.

The rollout stops a turn at `call_end` when the format has one (hermes, qwen3_coder); the others end calls at the end
of the turn, so a turn holds its calls and nothing after them.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Optional, Sequence


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
    """The interface: `call_start` / `call_end` delimit one call in the generated text (`call_end` "" for formats whose
    calls end with the turn); `stop_tokens` maps special tokens that end a calling turn besides the eos to the text
    the chat template writes in their place (whose tool-message delta follows them). `schemas`: the tools' function
    schemas, for formats that type raw argument text by them."""

    name = "base"
    call_start = ""
    call_end = ""
    stop_tokens: dict = {}

    def __init__(self, schemas: Sequence[dict] = ()):
        self.params = {s["function"]["name"]: s["function"].get("parameters") or {} for s in schemas
                       if isinstance(s, dict) and "function" in s}

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


def _json_calls(text: str, raw: str) -> list[ToolCall]:
    """Calls from JSON objects written one after the other (`{..}; {..}` or `{..}\n{..}`)."""
    dec, calls, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            obj, end = dec.raw_decode(text, at)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(raw=raw, error=f"the call is not JSON: {e.msg} at character {e.pos}"))
            return calls
        calls.append(_json_call(json.dumps(obj), json.dumps(obj, ensure_ascii=False)))
        at = end
        while at < len(text) and text[at] in " \t\n\r;,":
            at += 1
    return calls


def _strip_one_newline(value: str) -> str:
    """A value written on its own lines (`<parameter=k>\nVALUE\n</parameter>`) without the newline on each side."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _typed_args(params: dict, name: str, pairs) -> dict:
    """(key, raw text) pairs of one call to tool `name` as its arguments, each typed by the tool's schema."""
    props = (params.get(name) or {}).get("properties") or {}
    return {k.strip(): _typed(v, props.get(k.strip(), {})) for k, v in pairs}


def _typed(value: str, schema: dict):
    """Raw parameter text as its schema's type (kept as text when it does not convert: the schema check then says
    what is wrong with it).

    >>> _typed("3", {"type": "integer"}), _typed("true", {"type": "boolean"}), _typed('{"a": 1}', {"type": "object"})
    (3, True, {'a': 1})
    >>> _typed("three", {"type": "integer"}), _typed("007", {"type": "string"})
    ('three', '007')
    """
    kind = schema.get("type") if isinstance(schema, dict) else None
    kinds = kind if isinstance(kind, list) else [kind]
    if "string" in kinds or not kind:
        return value if "string" in kinds or not value.strip() else _loads_or(value)
    v = value.strip()
    if "boolean" in kinds and v.lower() in ("true", "false"):
        return v.lower() == "true"
    if "integer" in kinds and re.fullmatch(r"[+-]?\d+", v):
        return int(v)
    if "number" in kinds:
        try:
            return int(v) if re.fullmatch(r"[+-]?\d+", v) else float(v)
        except ValueError:
            return value
    if "null" in kinds and v.lower() in ("null", "none"):
        return None
    return _loads_or(value) if {"object", "array"} & set(kinds) else value


def _loads_or(value: str):
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


class Qwen3CoderParser(ToolCallParser):
    """`<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>`, values typed by the
    tool's schema.

    >>> schema = {"type": "function", "function": {"name": "open", "parameters": {"type": "object", "properties": {
    ...     "doc_id": {"type": "string"}, "offset": {"type": "integer"}}}}}
    >>> p = Qwen3CoderParser([schema])
    >>> text = p.render_call("open", {"doc_id": "7", "offset": 40})
    >>> print(text)
    <tool_call>
    <function=open>
    <parameter=doc_id>
    7
    </parameter>
    <parameter=offset>
    40
    </parameter>
    </function>
    </tool_call>
    >>> content, calls = p.parse("I read it.\\n\\n" + text)
    >>> content, calls[0].name, calls[0].arguments, calls[0].error
    ('I read it.', 'open', {'doc_id': '7', 'offset': 40}, None)
    """

    name = "qwen3_coder"
    call_start = "<tool_call>"
    call_end = "</tool_call>"
    _block = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
    _function = re.compile(r"^\s*<function=([^>\n]*)>(.*?)(</function>\s*$|$)", re.DOTALL)
    _param = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls = []
        for m in self._block.finditer(text):
            if not m.group(2):
                calls.append(ToolCall(raw=m.group(0), error="the call is not closed with </tool_call>"))
                continue
            f = self._function.match(m.group(1))
            if f is None or not f.group(1).strip():
                calls.append(ToolCall(raw=m.group(0), error="the call must be <tool_call>\n<function=NAME>\n"
                                                            "<parameter=KEY>\nVALUE\n</parameter>\n</function>\n"
                                                            "</tool_call>"))
                continue
            name = f.group(1).strip()
            if not f.group(3):
                calls.append(ToolCall(name=name, raw=m.group(0), error="the call is not closed with </function>"))
                continue
            args = _typed_args(self.params, name, ((p.group(1), _strip_one_newline(p.group(2)))
                                                   for p in self._param.finditer(f.group(2))))
            calls.append(ToolCall(name=name, arguments=args, raw=m.group(0)))
        return self._block.sub("", text).strip(), calls

    def render_call(self, name: str, arguments: dict) -> str:
        params = "".join(f"<parameter={k}>\n"
                         f"{json.dumps(v, ensure_ascii=False) if isinstance(v, (dict, list)) else v}\n</parameter>\n"
                         for k, v in arguments.items())
        return f"{self.call_start}\n<function={name}>\n{params}</function>\n{self.call_end}"


class Glm45Parser(ToolCallParser):
    """`<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>`, values typed by the tool's
    schema.

    >>> schema = {"type": "function", "function": {"name": "open", "parameters": {"type": "object", "properties": {
    ...     "doc_id": {"type": "string"}, "offset": {"type": "integer"}}}}}
    >>> p = Glm45Parser([schema])
    >>> print(p.render_call("open", {"doc_id": "7", "offset": 40}))
    <tool_call>open
    <arg_key>doc_id</arg_key>
    <arg_value>7</arg_value>
    <arg_key>offset</arg_key>
    <arg_value>40</arg_value>
    </tool_call>
    >>> content, calls = p.parse("Reading.<tool_call>open<arg_key>doc_id</arg_key><arg_value>7</arg_value></tool_call>")
    >>> content, calls[0].name, calls[0].arguments, calls[0].error
    ('Reading.', 'open', {'doc_id': '7'}, None)
    """

    name = "glm45"
    call_start = "<tool_call>"
    call_end = "</tool_call>"
    _block = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
    _arg = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls = []
        for m in self._block.finditer(text):
            if not m.group(2):
                calls.append(ToolCall(raw=m.group(0), error="the call is not closed with </tool_call>"))
                continue
            body = m.group(1)
            name = body.split("<arg_key>", 1)[0].strip()
            rest = body[len(body.split("<arg_key>", 1)[0]):]
            if not name or "\n" in name or self._arg.sub("", rest).strip():
                calls.append(ToolCall(name=name if "\n" not in name else "", raw=m.group(0), error=(
                    "the call must be <tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n"
                    "</tool_call>")))
                continue
            args = _typed_args(self.params, name, ((a.group(1), a.group(2)) for a in self._arg.finditer(rest)))
            calls.append(ToolCall(name=name, arguments=args, raw=m.group(0)))
        return self._block.sub("", text).strip(), calls

    def render_call(self, name: str, arguments: dict) -> str:
        args = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>"
                       f"{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}</arg_value>\n"
                       for k, v in arguments.items())
        return f"{self.call_start}{name}\n{args}{self.call_end}"


class Llama3JsonParser(ToolCallParser):
    """A turn that is a JSON call (or several joined by `;`): `{"name": ..., "parameters": {...}}`.

    >>> content, calls = Llama3JsonParser().parse('<|python_tag|>{"name": "search", "parameters": {"query": "q"}}')
    >>> content, calls[0].name, calls[0].arguments
    ('', 'search', {'query': 'q'})
    >>> Llama3JsonParser().parse("Paris is the capital.")
    ('Paris is the capital.', [])
    """

    name = "llama3_json"
    call_start = "<|python_tag|>"
    stop_tokens = {"<|eom_id|>": "<|eot_id|>"}

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip()
        tagged = body.startswith(self.call_start)
        if tagged:
            body = body[len(self.call_start):].strip()
        if not (tagged or body.startswith("{")):
            return text.strip(), []
        if not body.startswith("{"):
            return "", [ToolCall(raw=text, error='the call must be a JSON object {"name": "<tool>", "parameters": '
                                                  '{...}}')]
        return "", _json_calls(body, text)

    def render_call(self, name: str, arguments: dict) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)


class MistralParser(ToolCallParser):
    """`[TOOL_CALLS]` then the calls: a JSON list (v3 tokenizers) or `NAME[ARGS]{...}` per call (v11+).

    >>> content, calls = MistralParser().parse('[TOOL_CALLS] [{"name": "open", "arguments": {"doc_id": "7"}, '
    ...                                        '"id": "a1b2c3d4e"}]')
    >>> content, [(c.name, c.arguments) for c in calls]
    ('', [('open', {'doc_id': '7'})])
    >>> [(c.name, c.arguments) for c in MistralParser().parse('[TOOL_CALLS]search[ARGS]{"query": "q"}')[1]]
    [('search', {'query': 'q'})]
    """

    name = "mistral"
    call_start = "[TOOL_CALLS]"
    _v11 = re.compile(r"^\s*([^\[\]{}\s]+)\s*(?:\[CALL_ID\]\s*\S+?\s*)?\[ARGS\](.*)$", re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        at = text.find(self.call_start)
        if at < 0:
            return text.strip(), []
        content, rest = text[:at].strip(), text[at + len(self.call_start):]
        if rest.lstrip().startswith("["):
            try:
                obj, _ = json.JSONDecoder().raw_decode(rest.lstrip())
            except json.JSONDecodeError as e:
                return content, [ToolCall(raw=text[at:], error=f"the call is not JSON: {e.msg} at character {e.pos}")]
            if not isinstance(obj, list):
                obj = [obj]
            return content, [_json_call(json.dumps(o), json.dumps(o, ensure_ascii=False)) for o in obj]
        calls = []
        for piece in rest.split(self.call_start):
            m = self._v11.match(piece)
            if m is None:
                calls.append(ToolCall(raw=self.call_start + piece, error="the call must be [TOOL_CALLS] followed by "
                                                                         'a JSON list [{"name": ..., "arguments": '
                                                                         "{...}}]"))
                continue
            calls.append(_json_call(json.dumps({"name": m.group(1), "arguments": _loads_or(m.group(2).strip())}),
                                    self.call_start + piece))
        return content, calls

    def render_call(self, name: str, arguments: dict) -> str:
        return f"{self.call_start} {json.dumps([{'name': name, 'arguments': arguments}], ensure_ascii=False)}"


PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "qwen3_coder": Qwen3CoderParser,
                                            "glm45": Glm45Parser, "llama3_json": Llama3JsonParser,
                                            "mistral": MistralParser}


def get_parser(name: str, schemas: Sequence[dict] = ()) -> ToolCallParser:
    """The parser for format `name` (rollout.tool_parser); `schemas`: the tools' function schemas."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(PARSERS)}")
    return PARSERS[name](schemas)


def detect_parser(template: str) -> Optional[str]:
    """The call format a chat template writes its assistant tool calls in (rollout.tool_parser=auto), or None.

    >>> detect_parser("{{- '<tool_call>\\n<function=' + name + '>\\n' }}{{- '<parameter=' + key + '>\\n' }}")
    'qwen3_coder'
    >>> detect_parser("{{- '<|start_header_id|>ipython<|end_header_id|>' }}{{- 'parameters: ' }}")
    'llama3_json'
    """
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    if "<arg_key>" in template and "<arg_value>" in template:
        return "glm45"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("ipython" in template and "parameters" in template):
        return "llama3_json"
    return None
