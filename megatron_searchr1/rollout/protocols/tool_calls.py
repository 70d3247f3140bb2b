"""The model's own tool-calling format: its chat template with the tools' JSON schemas, calls in its own syntax, tool
results as the template's tool messages appended as token deltas.

    proto = ToolCallsProtocol(tokenizer, ProtocolSpec("tool_calls", tools=tool_specs(["search", "open"])))
    prompt_ids = proto.prompt_ids(tool_calls_messages("Who founded Acme?"))

The prompt is rendered ONCE (`apply_chat_template(messages, tools=schemas, add_generation_prompt=True)`). After
that nothing is rendered from the real history again: each turn appends what the engine generated, and each tool
round appends a delta, the text the chat template adds for the tool messages, derived once per template from a
fixed dummy history:

    p0 = render([user, assistant-stub with k calls])                             # no generation prompt
    p1 = render([user, assistant-stub with k calls, tool(R1), ..., tool(Rk)], add_generation_prompt=True)
    cut = p0.rfind(END) + len(END)        # END: where generation stopped (the call's closing string or the eos)
    p1[:cut] == p0[:cut]                  # else refused: the tool message would rewrite what came before it
    delta = p1[cut:] = seg0 R1 seg1 ... Rk segk

The delta must be the same after a longer dummy history (a stub, a tool result, another stub), and the result
markers must appear verbatim (or JSON-escaped, for templates that `tojson` the content); a template where any of
this fails is refused with a message, never guessed at. The delta's ids are `encode(seg0) + encode(R1) + ...`: the
template's glue and each result tokenized on their own, so the trained ids are exactly the generated ids plus the
deltas, also for templates that rewrite history when re-rendered (Qwen3 drops earlier turns' `<think>` blocks: a
re-render would train on tokens the policy never generated; we never re-render).

A turn is read by the parser (parsers.py): calls -> they run (tools.py) and their results come back as one delta;
no call and the turn ended at the eos -> the final answer (`<answer> ... </answer>` inside it when present, else its
text after any `</think>`); a turn cut at the length limit asks for nothing the template can close, and ends the
trajectory `invalid`.
"""
from __future__ import annotations

import json
import re
from typing import Callable, Optional, Sequence

from megatron_searchr1.data.prompts import ANSWER_END, ANSWER_START, THINK_END
from megatron_searchr1.rollout.protocols import Action, Protocol, ProtocolSpec
from megatron_searchr1.rollout.protocols.parsers import PARSERS, ToolCall, detect_parser, get_parser
from megatron_searchr1.rollout.protocols.tools import ToolBox

TOOL_INSTRUCTION = (
    "Answer the given question. Call the tools to find what you need, as often as you need. When you know the "
    "answer, give it inside <answer> and </answer>, without detailed illustrations. For example, "
    "<answer> Beijing </answer>."
)


def tool_calls_messages(question: str, system: str = TOOL_INSTRUCTION) -> list[dict]:
    """The prompt messages of one question under the tool_calls protocol (the tools go in through the template)."""
    return [{"role": "system", "content": system}, {"role": "user", "content": f"Question: {question}"}]


class TemplateError(ValueError):
    """The tokenizer's chat template cannot carry this protocol (the message says why and what to do)."""


_MARK = "ToolResultMarker{}Z"  # letters and digits: a template passes it through (or JSON-quotes it)
_QUESTION = "Which probe question is this?"


def _history() -> list[dict]:
    """The dummy prompt the deltas are derived after: shaped like a real one (tool_calls_messages), a system message
    and a question, so a template that moves the system message or the tools block once the conversation goes on is
    caught."""
    return [{"role": "system", "content": "Probe instruction."}, {"role": "user", "content": _QUESTION}]

# Assistant stubs tried in order: templates that drop reasoning from turns before the last query render a stub
# without reasoning differently once a tool message follows it (Qwen3), a stub with reasoning alike.
_STUBS = ("<think>\nprobe reasoning\n</think>\n\nprobe text", "probe text", "")
_ANSWER = re.compile(rf"{re.escape(ANSWER_START)}(.*?){re.escape(ANSWER_END)}", re.DOTALL)


def final_answer(content: str) -> str:
    """The answer in a final assistant message: inside <answer> tags when present, else the text after any
    </think>.

    >>> final_answer("<think> a </think>\\n\\n<answer> Paris </answer>")
    'Paris'
    >>> final_answer("<think> a </think>\\n\\nParis")
    'Paris'
    """
    if THINK_END in content:
        content = content.split(THINK_END)[-1]
    m = _ANSWER.search(content)
    return (m.group(1) if m else content).strip()


class ToolCallsProtocol(Protocol):
    name = "tool_calls"

    def __init__(self, tokenizer, spec: ProtocolSpec):
        self.tokenizer, self.spec = tokenizer, spec
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("rollout.protocol=tool_calls needs a tokenizer with a chat template that renders tools "
                                "(tokenizer_config.json `chat_template`, or chat_template.jinja); this one has none: "
                                "use rollout.protocol=search_r1, or give the tokenizer its model's tool-calling template")
        if not spec.tools:
            raise TemplateError("rollout.protocol=tool_calls needs at least one tool in rollout.tools")
        self.template_kwargs = dict(spec.chat_template_kwargs)
        parser = spec.tool_parser
        if parser == "auto":
            text = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else str(tokenizer.chat_template)
            parser = detect_parser(text)
            if parser is None:
                raise TemplateError("rollout.tool_parser=auto: the chat template writes tool calls in none of the "
                                    f"known formats ({', '.join(PARSERS)}); name the format with rollout.tool_parser")
        self.box = ToolBox(spec.tools, spec.tools_url, spec.tool_timeout)
        self.schemas = self.box.schemas()
        self.parser = get_parser(parser, self.schemas)
        self.stop_strings = (self.parser.call_end,) if spec.stop_at_call_end and self.parser.call_end else ()
        eos = tokenizer.eos_token_id
        vocab = tokenizer.get_vocab()
        self.stop_token_ids = ((eos,) if isinstance(eos, int) else ()) + tuple(
            vocab[t] for t in self.parser.stop_tokens if t in vocab and vocab[t] != eos)
        probe = self._render(_history(), True)
        missing = [s.name for s in spec.tools if s.name not in probe]
        if missing:
            raise TemplateError(f"the tokenizer's chat template does not render tools (rendered with tools=..., the "
                                f"prompt never names {', '.join(missing)}): it is no tool-calling template; use "
                                "rollout.protocol=search_r1, or give the tokenizer its model's tool-calling template")
        self._escape = self._content_escape()
        self._deltas: dict[tuple[int, str], object] = {}  # segments, or the TemplateError that refused them
        ends = [self.parser.call_end] if spec.stop_at_call_end and self.parser.call_end else []
        if isinstance(tokenizer.eos_token, str):
            ends.append(tokenizer.eos_token)
        for end in ends:  # refuse a template now, not in the middle of a run
            self.delta(1, end)

    # -- rendering (the prompt and the dummy histories only) ----------------------------------------------------
    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=self.schemas, tokenize=False,
                                                      add_generation_prompt=generation_prompt, **self.template_kwargs)
        except Exception as e:  # noqa: BLE001 - jinja raises its own classes (TemplateError, UndefinedError, ...)
            raise TemplateError(f"the tokenizer's chat template fails on a tool-calling conversation "
                                f"({type(e).__name__}: {e}); use rollout.protocol=search_r1 or a template with tool "
                                "calling") from None

    def render_prompt(self, messages: Sequence[dict]) -> str:
        """The prompt text: the chat template with the tools' schemas and the generation prompt."""
        return self._render([dict(m) for m in messages], True)

    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        return self.tokenizer.encode(self.render_prompt(messages), add_special_tokens=False)

    def _stub(self, content: str, k: int) -> tuple[dict, list[dict]]:
        name = self.spec.tools[0].name
        ids = [f"call{i:05d}" for i in range(k)]  # 9 alphanumeric characters: what the strictest templates accept
        stub = {"role": "assistant", "content": content,
                "tool_calls": [{"id": i, "type": "function", "function": {"name": name, "arguments": {}}}
                               for i in ids]}
        return stub, [{"role": "tool", "tool_call_id": i, "name": name, "content": _MARK.format(n)}
                      for n, i in enumerate(ids)]

    def _content_escape(self) -> Callable[[str], str]:
        """How the template writes a tool message's content: verbatim, or JSON-escaped (templates that `tojson` it)."""
        text = 'line "one"\nline two'
        stub, tools = self._stub(_STUBS[1], 1)
        tools[0]["content"] = text
        rendered = self._render(_history() + [stub, *tools], True)
        if text in rendered:
            return lambda s: s
        if json.dumps(text)[1:-1] in rendered:
            return lambda s: json.dumps(s, ensure_ascii=False)[1:-1]
        raise TemplateError("the chat template neither writes a tool message's content as it is nor JSON-escaped: "
                            "its tool results cannot be appended as tokens; use rollout.protocol=search_r1")

    def delta(self, k: int, end: str) -> tuple[str, ...]:
        """The k+1 text segments around k tool results, after a turn that ended with the text `end` (module doc)."""
        key = (k, end)
        if key not in self._deltas:
            try:
                self._deltas[key] = self._derive(k, end)
            except TemplateError as e:  # derived once either way: a refused end is refused again without renders
                self._deltas[key] = e
        got = self._deltas[key]
        if isinstance(got, TemplateError):
            raise got
        return got

    def _derive(self, k: int, end: str) -> tuple[str, ...]:
        why = []
        for content in _STUBS:
            try:
                short = self._delta_after(_history(), content, k, end)
                earlier_stub, earlier_tools = self._stub(content, 1)
                earlier_tools[0]["content"] = "earlier result"
                longer = self._delta_after(_history() + [earlier_stub, *earlier_tools], content, k, end)
            except TemplateError as e:
                why.append(str(e))
                continue
            if short != longer:
                why.append("the tool message renders differently after a longer history")
                continue
            return short
        raise TemplateError(f"the chat template's tool message is not a clean suffix of the conversation, so tool "
                            f"results cannot be appended as tokens without re-rendering the history ({why[0]}); use "
                            "rollout.protocol=search_r1 or another template")

    def _delta_after(self, history: list[dict], content: str, k: int, end: str) -> tuple[str, ...]:
        stub, tools = self._stub(content, k)
        before = self._render(history, False)
        p0 = self._render(history + [stub], False)
        if not p0.startswith(before):
            raise TemplateError("the conversation before an assistant turn renders differently once the turn follows "
                                "it (the template moves text, e.g. the system message or the tools block, to the last "
                                "user message), so the prompt generation started from is not what the template puts "
                                "before the calls")
        p1 = self._render(history + [stub] + tools, True)
        at = p0.rfind(end)
        if at < 0:
            raise TemplateError(f"the template's assistant turn never writes {end!r}, where generation stops")
        cut = at + len(end)
        if p1[:cut] != p0[:cut]:
            raise TemplateError("adding a tool message changes the text rendered before it")
        rest, segs = p1[cut:], []
        for n in range(k):
            mark = self._escape(_MARK.format(n))
            j = rest.find(mark)
            if j < 0:
                raise TemplateError("the tool result does not appear in the template's tool message")
            segs.append(rest[:j])
            rest = rest[j + len(mark):]
        return tuple(segs) + (rest,)

    # -- the loop's hooks -----------------------------------------------------------------------------------------
    def _end_text(self, turn_ids: Sequence[int], stop, stop_ids: Sequence[int]) -> Optional[str]:
        """The text the turn ended with: the stop string, or the stop token's text; None when it was cut."""
        if isinstance(stop, str):
            return stop
        if turn_ids and turn_ids[-1] in stop_ids:
            return self.tokenizer.decode([turn_ids[-1]], skip_special_tokens=False)
        return None

    def read(self, turn_ids: Sequence[int], stop, stop_ids: Sequence[int] = ()) -> Action:
        end = self._end_text(turn_ids, stop, tuple(stop_ids) + self.stop_token_ids)
        body = list(turn_ids[:-1]) if end is not None and not isinstance(stop, str) else list(turn_ids)
        text = self.tokenizer.decode(body, skip_special_tokens=False)
        content, calls = self.parser.parse(text)
        if end is None:  # cut at the length limit: nothing the template can close
            return Action("invalid", calls=calls, stop=None)
        if calls:
            # a stop token the template writes as another text (Llama's <|eom_id|>) is followed as that text is
            for e in filter(None, (end, self.parser.stop_tokens.get(end))):
                try:
                    self.delta(len(calls), e)
                    return Action("calls", calls=calls, stop=e)
                except TemplateError:  # a turn closed by a token the template never ends a turn with (or more
                    continue           # calls than it renders in a turn) cannot be followed
            return Action("invalid", calls=calls, stop=None)
        if self.parser.call_end and end == self.parser.call_end:  # a closing string without a call before it
            return Action("calls", calls=[ToolCall(raw=text, error=f"{end} without {self.parser.call_start}")],
                          stop=end)
        return Action("answer", answer=final_answer(content), stop=end)

    def observation_ids(self, action: Action, results: Sequence[str], room: int, max_obs: int) -> Optional[list[int]]:
        segs = self.delta(len(results), action.stop)
        enc = self._encode
        ids = enc(segs[0])
        for result, seg in zip(results, segs[1:]):
            ids += enc(self._escape(result.strip()))[:max_obs] + enc(seg)
        return ids if len(ids) <= room else None

    def feedback_ids(self, budget: int) -> Optional[list[int]]:
        return None

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []
