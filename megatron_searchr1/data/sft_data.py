"""SFT data: LLaMA-Factory-style `dataset_info.json` -> token ids + loss mask, exactly as the rollout tokenises.

    examples = load_sft_dataset("world/sft", ["synthetic_sft_train"], tokenizer, max_length=1024)
    examples[0].input_ids, examples[0].loss_mask      # equal lengths; loss_mask 1 = a token the model wrote
    examples.dropped_too_long                         # {dataset name: examples over max_length, not truncated}

`dataset_info.json` maps a dataset name to an entry (LLaMA-Factory's keys and defaults):

    "name": {"file_name": "train.jsonl",            # JSON (a list of records) or JSONL, or a folder of them
             "formatting": "alpaca" | "sharegpt",   # default alpaca
             "columns": {...},                      # alpaca: prompt=instruction, query=input, response=output,
                                                    #   system=None, history=None
                                                    # sharegpt: messages=conversations, system=None, tools=None
             "tags": {...}}                         # sharegpt only: role_tag=from, content_tag=value,
                                                    #   user_tag=human, assistant_tag=gpt, observation_tag=observation,
                                                    #   function_tag=function_call, system_tag=system

Every record becomes a list of messages with roles system / user / assistant / observation (a sharegpt
`function_call` message is the model's own output, so it counts as assistant; a leading `system` message or the
`system` column gives the system prompt; alpaca's `history` pairs become earlier user/assistant turns), and is then
tokenised in one of two layouts:

1. **Rollout layout** (one user message, then assistant turns with observations between them; Search-R1's
   format and the synthetic world's gold trajectories). The tokens are exactly what rollout/loop.py produces for
   the same trajectory: `tok(render_prompt(prompt_messages))`, then each assistant text and each observation text
   tokenised ON ITS OWN (`add_special_tokens=False`) and concatenated. No chat-template tool turns between them and
   no eos after the final answer: the engine stops right after `</search>` / `</answer>` and the observation
   (already the `format_observation` text, `<information>` block included) is appended inline. Tokenising the
   joined text instead would let BPE merge across a boundary and teach ids the rollout never produces.
   Alpaca records without history are this layout too: prompt = instruction (+ "\\n" + input), one assistant turn.
2. **Chat layout** (several user turns, plain chat data): the conversation is rendered with the tokenizer's chat
   template. For assistant turn k the masked span is the text that `apply_chat_template(messages[:k+1])` adds to
   `apply_chat_template(messages[:k], add_generation_prompt=True)` (its content and the template's end-of-turn
   marker); the rest (system, user turns, the assistant header) is unmasked. Each piece is tokenised on its own, so
   the prefix before turn k tokenises as it would when the model is prompted with it. Observations are refused in
   this layout: the search loop has a single question, and a chat template's tool turn is a format RL never sees.

3. **Tool-calling layout** (a sharegpt record with a `tools` column: LLaMA-Factory's tool data, `function_call` and
   `observation` turns): exactly what the rollout's tool_calls protocol produces (rollout/protocols/tool_calls.py)
   with the same settings (`tool_parser`, `stop_at_call_end`, `chat_template_kwargs`: the SFT config's data.* copies
   of the rollout.* fields): the prompt rendered once by the chat template with the record's tools and the kwargs,
   each `function_call` (LLaMA-Factory's JSON: `{"name", "arguments"}` or a list of them) written in the parser's
   call format (after the turn's thought when the content starts with one: LLaMA-Factory's `<think>...</think>`
   block, kept verbatim and followed by "\n" as a chat template renders an assistant message's content before its
   calls, mask 1: the model writes it), ended as the engine ends it (at the closing string, e.g. hermes'
   `</tool_call>`, when the rollout stops there; else with the token that ends the turn: the format's own
   end-of-call token when the tokenizer has one, Llama's `<|eom_id|>`, else the eos), the following `observation`
   appended as the template's tool-message delta after that end (mask 0), the final answer closed by the eos (mask 1, as the engine generates it). Each turn
   is read back by the rollout's own reader, so a turn the rollout would not follow (an answer that parses as a
   call, two calls where the template renders one) is refused. One call per turn when the rollout stops at the end
   of a call (`stop_at_call_end=True` with a closing string).

`loss_mask[i]` is aligned with `input_ids[i]`: 1 when token i is one the model must learn to produce (the trainer
shifts it against the logits). Examples longer than `max_length` are dropped and counted, never truncated: a cut
prompt loses the question, a cut response teaches an unfinished trajectory.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterator

from megatron_searchr1.data.prompts import THINK_END, THINK_START, render_prompt

DATASET_INFO = "dataset_info.json"
FORMATS = ("alpaca", "sharegpt")
ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output", "system": None, "history": None}
SHAREGPT_COLUMNS = {"messages": "conversations", "system": None, "tools": None}
SHAREGPT_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                 "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"}
# LLaMA-Factory keys that point at data we cannot read from a local directory.
_REMOTE_KEYS = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
ROLES = ("system", "user", "assistant", "observation")


class SFTDataError(ValueError):
    """The dataset description or a record is not usable; the message says which and what to change."""


@dataclass
class SFTExample:
    """One tokenised conversation."""

    input_ids: list[int]
    """Token ids of prompt and response, exactly as the rollout would produce them."""
    loss_mask: list[int]
    """1 on tokens the model wrote (assistant turns), 0 on prompt, user turns and observations; same length."""
    source: str
    """`<dataset name>:<record index>`, to trace an example back to its file."""


class SFTDataset(list):
    """A `list[SFTExample]` that also says what loading left out."""

    dropped_too_long: dict[str, int]
    """Dataset name -> number of examples longer than max_length (dropped, not truncated)."""

    def __init__(self, examples=(), dropped_too_long: dict[str, int] | None = None):
        super().__init__(examples)
        self.dropped_too_long = dict(dropped_too_long or {})


# ----------------------------------------------------------------------------------------------------------------
# dataset_info.json and files
# ----------------------------------------------------------------------------------------------------------------
def read_dataset_info(dataset_info_dir: str) -> dict[str, dict]:
    """The parsed `<dir>/dataset_info.json` (name -> entry)."""
    path = os.path.join(dataset_info_dir, DATASET_INFO)
    if not os.path.isfile(path):
        raise SFTDataError(f"{path} does not exist: pass the directory that holds the dataset_info.json "
                           "(the synthetic world writes one under <world>/sft)")
    with open(path, encoding="utf-8") as f:
        try:
            info = json.load(f)
        except json.JSONDecodeError as e:
            raise SFTDataError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(info, dict):
        raise SFTDataError(f"{path} must hold a JSON object mapping dataset names to entries")
    return info


def _entry_spec(name: str, entry: dict) -> tuple[str, dict, dict]:
    """(formatting, columns, tags) of one entry, LLaMA-Factory defaults filled in, unknown keys refused."""
    if not isinstance(entry, dict):
        raise SFTDataError(f"dataset {name!r}: entry must be a JSON object")
    if entry.get("ranking"):
        raise SFTDataError(f"dataset {name!r} is a preference (ranking) dataset; SFT needs plain conversations")
    fmt = entry.get("formatting", "alpaca")
    if fmt not in FORMATS:
        raise SFTDataError(f"dataset {name!r}: formatting {fmt!r} is not supported; use one of {FORMATS}")
    defaults = ALPACA_COLUMNS if fmt == "alpaca" else SHAREGPT_COLUMNS
    columns = dict(entry.get("columns") or {})
    unknown = sorted(set(columns) - set(defaults))
    if unknown:
        raise SFTDataError(f"dataset {name!r}: columns {unknown} do not apply to {fmt} data; "
                           f"known columns: {sorted(defaults)}")
    columns = {**defaults, **columns}
    tags = dict(entry.get("tags") or {})
    unknown = sorted(set(tags) - set(SHAREGPT_TAGS))
    if unknown:
        raise SFTDataError(f"dataset {name!r}: unknown tags {unknown}; known tags: {sorted(SHAREGPT_TAGS)}")
    return fmt, columns, {**SHAREGPT_TAGS, **tags}


def _data_files(dataset_info_dir: str, name: str, entry: dict) -> list[str]:
    file_name = entry.get("file_name")
    if not file_name:
        remote = [k for k in _REMOTE_KEYS if entry.get(k)]
        where = f" (it names {remote[0]}: only local files are supported)" if remote else ""
        raise SFTDataError(f"dataset {name!r} has no file_name{where}; add \"file_name\": \"<file>.jsonl\"")
    path = os.path.join(dataset_info_dir, file_name)
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith((".json", ".jsonl")))
        if not files:
            raise SFTDataError(f"dataset {name!r}: folder {path} holds no .json or .jsonl file")
        return files
    if not os.path.isfile(path):
        raise SFTDataError(f"dataset {name!r}: file {path} does not exist (file_name is relative to the "
                           f"directory of {DATASET_INFO})")
    if not path.endswith((".json", ".jsonl")):
        raise SFTDataError(f"dataset {name!r}: {path} is neither .json nor .jsonl; convert it to JSON lines")
    return [path]


def _read_records(path: str) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        if path.endswith(".jsonl"):
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise SFTDataError(f"{path}:{lineno}: not valid JSON: {e}") from None
            return
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise SFTDataError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(data, list):
        raise SFTDataError(f"{path}: a .json dataset must hold a list of records (use .jsonl for one per line)")
    yield from data


# ----------------------------------------------------------------------------------------------------------------
# Records -> messages
# ----------------------------------------------------------------------------------------------------------------
def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise SFTDataError(f"{what} must be a string, got {type(value).__name__}")
    return value


def _column(record: dict, column: str, where: str, required: bool = True) -> Any:
    if column not in record:
        if required:
            raise SFTDataError(f"{where}: column {column!r} is missing (record keys: {sorted(record)}); fix the "
                               f"record or map the column in dataset_info.json's \"columns\"")
        return None
    return record[column]


def alpaca_messages(record: dict, columns: dict, where: str) -> list[dict]:
    """instruction (+ "\\n" + input) as the user message, output as the assistant message; system and history
    (a list of [query, response] pairs before it) when their columns are set."""
    messages = []
    if columns["system"]:
        system = _column(record, columns["system"], where, required=False)
        if system:
            messages.append({"role": "system", "content": _text(system, f"{where}: system")})
    if columns["history"]:
        for i, pair in enumerate(_column(record, columns["history"], where, required=False) or []):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise SFTDataError(f"{where}: history[{i}] must be a [query, response] pair")
            messages.append({"role": "user", "content": _text(pair[0], f"{where}: history[{i}][0]")})
            messages.append({"role": "assistant", "content": _text(pair[1], f"{where}: history[{i}][1]")})
    prompt = _text(_column(record, columns["prompt"], where), f"{where}: {columns['prompt']}")
    query = _column(record, columns["query"], where, required=False) if columns["query"] else None
    if query:
        prompt = prompt + "\n" + _text(query, f"{where}: {columns['query']}")
    messages.append({"role": "user", "content": prompt})
    messages.append({"role": "assistant",
                     "content": _text(_column(record, columns["response"], where), f"{where}: {columns['response']}")})
    return messages


def sharegpt_messages(record: dict, columns: dict, tags: dict, where: str) -> list[dict]:
    """The message list with roles mapped through `tags` (function_call counts as assistant)."""
    raw = _column(record, columns["messages"], where)
    if not isinstance(raw, list) or not raw:
        raise SFTDataError(f"{where}: column {columns['messages']!r} must be a non-empty list of messages")
    role_of = {tags["user_tag"]: "user", tags["assistant_tag"]: "assistant", tags["observation_tag"]: "observation",
               tags["function_tag"]: "assistant", tags["system_tag"]: "system"}
    messages = []
    if columns["system"]:
        system = _column(record, columns["system"], where, required=False)
        if system:
            messages.append({"role": "system", "content": _text(system, f"{where}: system")})
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or tags["role_tag"] not in m or tags["content_tag"] not in m:
            raise SFTDataError(f"{where}: message {i} must be an object with keys {tags['role_tag']!r} and "
                               f"{tags['content_tag']!r} (set role_tag/content_tag in dataset_info.json's \"tags\")")
        role = m[tags["role_tag"]]
        if role not in role_of:
            raise SFTDataError(f"{where}: message {i} has unknown role {role!r}; known roles: "
                               f"{sorted(role_of)} (map it with user_tag/assistant_tag/observation_tag/"
                               "function_tag/system_tag in dataset_info.json's \"tags\")")
        if role_of[role] == "system" and i != 0:
            raise SFTDataError(f"{where}: a system message may only come first (message {i})")
        messages.append({"role": role_of[role], "content": _text(m[tags["content_tag"]], f"{where}: message {i}")})
        if role == tags["function_tag"]:
            messages[-1]["function_call"] = True
    if sum(m["role"] == "system" for m in messages) > 1:
        raise SFTDataError(f"{where}: both the system column and a leading system message are set; keep one")
    return messages


def sharegpt_tools(record: dict, columns: dict, where: str) -> list[dict] | None:
    """The record's tools (LLaMA-Factory's `tools` column: a JSON list, or its string, of `{"name", "description",
    "parameters"}` or OpenAI's `{"type": "function", "function": {...}}`), or None when it has none."""
    raw = _column(record, columns["tools"], where, required=False) if columns["tools"] else None
    if not raw:
        return None
    try:
        tools = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError as e:
        raise SFTDataError(f"{where}: column {columns['tools']!r} is not JSON ({e.msg})") from None
    tools = [t.get("function", t) if isinstance(t, dict) else t for t in (tools if isinstance(tools, list) else [tools])]
    if not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in tools):
        raise SFTDataError(f"{where}: column {columns['tools']!r} must list tools as {{\"name\", \"description\", "
                           "\"parameters\"}")
    return tools


# ----------------------------------------------------------------------------------------------------------------
# Messages -> token ids + loss mask
# ----------------------------------------------------------------------------------------------------------------
def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _check_order(messages: list[dict], where: str) -> None:
    body = messages[1:] if messages and messages[0]["role"] == "system" else messages
    if not body or body[0]["role"] != "user":
        raise SFTDataError(f"{where}: the conversation must start with a user message (after an optional system one)")
    if body[-1]["role"] != "assistant":
        raise SFTDataError(f"{where}: the conversation must end with an assistant message (nothing to learn after it)")
    allowed_next = {"user": ("assistant",), "assistant": ("user", "observation"), "observation": ("assistant",)}
    for a, b in zip(body, body[1:]):
        if b["role"] not in allowed_next[a["role"]]:
            raise SFTDataError(f"{where}: a {a['role']} message cannot be followed by a {b['role']} message "
                               f"(expected {' or '.join(allowed_next[a['role']])})")


def tokenize_rollout(messages: list[dict], tokenizer) -> tuple[list[int], list[int]]:
    """Rollout layout: `tok(render_prompt(prompt))` + tok(assistant_1) + tok(observation_1) + ... + tok(assistant_n).

    messages: [system?, user, assistant, (observation, assistant)*]. Mask 1 exactly on the assistant segments.
    """
    n_prompt = 2 if messages[0]["role"] == "system" else 1
    ids = _ids(tokenizer, render_prompt(messages[:n_prompt], tokenizer))
    mask = [0] * len(ids)
    for m in messages[n_prompt:]:
        seg = _ids(tokenizer, m["content"])
        ids += seg
        mask += [int(m["role"] == "assistant")] * len(seg)
    return ids, mask


def tokenize_chat(messages: list[dict], tokenizer, where: str = "conversation", render=None
                  ) -> tuple[list[int], list[int]]:
    """Chat layout: the conversation through the chat template, masked on each assistant turn's added text.

    Pieces: render(messages[:k], generation prompt) is the prompt before assistant turn k; the text that
    render(messages[:k+1]) adds to it is the turn (mask 1); the text between the end of turn k and the next prompt
    (user turn, assistant header) is mask 0. `render(messages, add_generation_prompt)`: a LLaMA-Factory template
    (data/templates.py); default the tokenizer's chat template. Needs a template whose rendering of a prefix is a prefix of the
    rendering of the whole (templates that rewrite earlier turns, e.g. drop old reasoning, are refused).
    """
    if render is None:
        if not getattr(tokenizer, "chat_template", None):
            raise SFTDataError(f"{where}: a multi-turn chat needs a tokenizer with a chat_template")

        def render(msgs: list[dict], gen: bool) -> str:
            return tokenizer.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)

    ids: list[int] = []
    mask: list[int] = []
    done = ""  # text already tokenised
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt, full = render(messages[:k], True), render(messages[:k + 1], False)
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise SFTDataError(f"{where}: the chat template does not render the conversation prefix by prefix "
                               "(it rewrites earlier turns); convert the data to the single-question rollout layout")
        for piece, bit in ((prompt[len(done):], 0), (full[len(prompt):], 1)):
            seg = _ids(tokenizer, piece) if piece else []
            ids += seg
            mask += [bit] * len(seg)
        done = full
    return ids, mask


def split_thought(content: str, where: str = "conversation") -> tuple[str, str]:
    """(thought block, JSON) of a function_call turn's content: LLaMA-Factory's convention, an optional leading
    `<think>...</think>` block (kept verbatim, "" when absent) and then the call's JSON. Any other text is refused.

    >>> split_thought('<think> I need X. </think>\\n{"name": "search", "arguments": {}}')
    ('<think> I need X. </think>', '{"name": "search", "arguments": {}}')
    >>> split_thought('{"name": "search", "arguments": {}}')
    ('', '{"name": "search", "arguments": {}}')
    """
    text = content.strip()
    thought = ""
    if text.startswith(THINK_START):
        end = text.find(THINK_END)
        if end < 0:
            raise SFTDataError(f"{where}: a function_call's thought opens with {THINK_START} but never closes with "
                               f"{THINK_END}: close it before the JSON call")
        thought, text = text[:end + len(THINK_END)], text[end + len(THINK_END):].strip()
    if not text.startswith(("{", "[")):
        raise SFTDataError(f"{where}: a function_call's content is the JSON call ({{\"name\", \"arguments\"}} or a "
                           f"list of them), optionally after one {THINK_START}...{THINK_END} thought; it has other "
                           f"text: {text[:60]!r}: put that text inside the thought block or drop it")
    return thought, text


def _call_stop_token(proto, tokenizer) -> int:
    """The token a turn of calls ends with when no closing string stops it: the format's own end-of-call token when
    the tokenizer has one (Llama's `<|eom_id|>`: the template writes `<|eot_id|>` in its place, and the rollout
    follows it with the delta after that text), else the eos."""
    vocab = tokenizer.get_vocab()
    for token in proto.parser.stop_tokens:
        if token in vocab:
            return vocab[token]
    return tokenizer.eos_token_id


def tokenize_tool_calls(messages: list[dict], tokenizer, tools: list[dict], where: str = "conversation",
                        tool_parser: str = "hermes", stop_at_call_end: bool = True,
                        chat_template_kwargs: dict | None = None) -> tuple[list[int], list[int]]:
    """Tool-calling layout (module doc): the ids the tool_calls rollout produces for this conversation.

    `tool_parser`, `stop_at_call_end`, `chat_template_kwargs`: the rollout's settings (rollout.tool_parser, ...);
    each generated turn goes through the rollout's own reader (`Protocol.read`), so a turn the rollout would read
    otherwise (an answer that parses as a call, calls the template cannot follow) is refused, not trained on."""
    from megatron_searchr1.rollout.protocols import ProtocolSpec, build_protocol
    from megatron_searchr1.rollout.protocols.tools import ToolSpec

    _check_order(messages, where)
    if sum(m["role"] == "user" for m in messages) != 1:
        raise SFTDataError(f"{where}: a tool-calling conversation has one user message (the question)")
    specs = tuple(ToolSpec(t["name"], t.get("description", ""), t.get("parameters") or {"type": "object",
                                                                                         "properties": {}})
                  for t in tools)
    kwargs = tuple(sorted((chat_template_kwargs or {}).items()))
    try:
        proto = build_protocol(ProtocolSpec("tool_calls", tool_parser=tool_parser, tools=specs,
                                            stop_at_call_end=stop_at_call_end, chat_template_kwargs=kwargs), tokenizer)
    except ValueError as e:
        raise SFTDataError(f"{where}: {e}") from None
    eos = tokenizer.eos_token_id
    if not isinstance(eos, int):
        raise SFTDataError(f"{where}: the tokenizer has no eos token, which ends the final answer's turn")
    parser = proto.parser
    by_string = stop_at_call_end and bool(parser.call_end)  # the engine stops at the call's closing string
    call_stop = _call_stop_token(proto, tokenizer)
    n_prompt = 2 if messages[0]["role"] == "system" else 1
    ids = proto.prompt_ids(messages[:n_prompt])
    mask = [0] * len(ids)
    body = messages[n_prompt:]
    for k, m in enumerate(body):
        if m["role"] == "observation":
            continue  # appended with the call before it
        if not m.get("function_call"):
            if k != len(body) - 1:
                raise SFTDataError(f"{where}: an assistant message that calls no tool must be the last (the answer)")
            seg = _ids(tokenizer, m["content"]) + [eos]
            action = proto.read(seg, eos, proto.stop_token_ids)
            if action.kind != "answer":
                raise SFTDataError(f"{where}: the rollout reads the final message as {action.kind} in the "
                                   f"{parser.name} format, not as the answer: rewrite it (or make it a function_call)")
            ids, mask = ids + seg, mask + [1] * len(seg)
            continue
        thought, call_json = split_thought(m["content"], where)
        try:
            calls = json.loads(call_json)
        except json.JSONDecodeError as e:
            raise SFTDataError(f"{where}: a function_call must be JSON {{\"name\", \"arguments\"}}, optionally after "
                               f"a {THINK_START}...{THINK_END} thought ({e.msg})") from None
        calls = calls if isinstance(calls, list) else [calls]
        if by_string and len(calls) != 1:
            raise SFTDataError(f"{where}: {len(calls)} calls in one turn, but the rollout stops at the end of a call "
                               "(rollout.stop_at_call_end): one call per function_call turn")
        if not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
            raise SFTDataError(f"{where}: a function_call is {{\"name\": ..., \"arguments\": {{...}}}} or a list of "
                               "them")
        args = [json.loads(c["arguments"]) if isinstance(c.get("arguments"), str) else c.get("arguments", {})
                for c in calls]
        text = "\n".join(parser.render_call(c["name"], a) for c, a in zip(calls, args))
        if thought:  # the model's text before its calls, as a chat template renders content before them
            text = f"{thought}\n{text}"
        # what the engine generates: the calls up to the closing string it stops at, or the calls and the token that
        # ends the turn (formats whose calls end with the turn: Llama's <|eom_id|>, Mistral's eos)
        seg = _ids(tokenizer, text) + ([] if by_string else [call_stop])
        action = proto.read(seg, parser.call_end if by_string else call_stop, proto.stop_token_ids)
        bad = [c.error for c in action.calls if c.error]
        if action.kind != "calls" or len(action.calls) != len(calls) or bad:
            why = bad[0] if bad else (f"it reads {len(action.calls)} calls" if action.kind == "calls" else
                                      f"it reads the turn as {action.kind}: the chat template cannot follow "
                                      f"{len(calls)} call(s) in one turn ended by "
                                      f"{tokenizer.convert_ids_to_tokens(seg[-1])!r}")
            raise SFTDataError(f"{where}: the rollout cannot follow this function_call written in the {parser.name} "
                               f"format ({why}); data.tool_parser must be the format of the model's template")
        ids, mask = ids + seg, mask + [1] * len(seg)
        obs = body[k + 1]["content"]
        try:
            results = [obs] if len(calls) == 1 else json.loads(obs)
        except json.JSONDecodeError:
            results = None
        if not isinstance(results, list) or len(results) != len(calls):
            raise SFTDataError(f"{where}: {len(calls)} calls need a JSON list of {len(calls)} results in the "
                               "observation after them")
        delta = proto.observation_ids(action, [str(r) for r in results], 1 << 30, 1 << 30)
        ids, mask = ids + delta, mask + [0] * len(delta)
    return ids, mask


def tokenize_messages(messages: list[dict], tokenizer, where: str = "conversation") -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of one normalised conversation: rollout layout for a single question (with or without
    observations), chat layout for several user turns."""
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES:
            raise SFTDataError(f"{where}: message {i} has role {m.get('role')!r}; expected one of {ROLES}")
    _check_order(messages, where)
    n_user = sum(m["role"] == "user" for m in messages)
    if n_user == 1:
        return tokenize_rollout(messages, tokenizer)
    if any(m["role"] == "observation" for m in messages):
        raise SFTDataError(f"{where}: observations are supported only in single-question conversations (one user "
                           f"message, then assistant turns with observations between them); this one has {n_user} "
                           "user messages")
    return tokenize_chat(messages, tokenizer, where)


# ----------------------------------------------------------------------------------------------------------------
# The loader
# ----------------------------------------------------------------------------------------------------------------
def check_sft_datasets(dataset_info_dir: str, names: list[str], field: str = "data.datasets") -> dict[str, dict]:
    """The parsed dataset_info.json after checking that every name in `names` has a readable entry with existing
    files (no record is read): cheap, so the SFT entry runs it before torch loads. SFTDataError otherwise."""
    info = read_dataset_info(dataset_info_dir)
    unknown = [n for n in names if n not in info]
    if unknown:
        path = os.path.join(dataset_info_dir, DATASET_INFO)
        raise SFTDataError(f"{field}: unknown SFT dataset(s) {', '.join(map(repr, unknown))}; {path} defines "
                           f"{', '.join(map(repr, sorted(info))) or 'none'}: use one of those names or add an "
                           f"entry for it to {path}")
    for name in names:
        _entry_spec(name, info[name])
        _data_files(dataset_info_dir, name, info[name])
    return info


def load_sft_dataset(dataset_info_dir: str, names: list[str], tokenizer, max_length: int, template: str = "",
                     max_samples: int | None = None, tool_parser: str = "hermes", stop_at_call_end: bool = True,
                     chat_template_kwargs: dict | None = None) -> SFTDataset:
    """Tokenised examples of the named datasets, in order (dataset by dataset, record by record).

    Examples with more than `max_length` tokens are dropped, counted in `.dropped_too_long` per dataset.
    `template`: a LLaMA-Factory template name (data/templates.py): every conversation in the chat layout rendered
    with it (what LLaMA-Factory trains on); empty: the layouts above. Tool records (layout 3) always use the
    tokenizer's own chat template, the one the tool_calls rollout renders, so a LLaMA-Factory YAML's `template`
    (it names the model family) does not change them; `tool_parser`, `stop_at_call_end` and `chat_template_kwargs`
    do, and must be the rollout's (rollout.tool_parser, ...: the SFT config's data.tool_parser, ...).
    `max_samples`: the first N records of each dataset.
    """
    render = None
    if template:
        from megatron_searchr1.data.templates import template_renderer

        try:
            render = template_renderer(template, tokenizer)
        except ValueError as e:
            raise SFTDataError(str(e)) from None
    if max_length <= 0:
        raise SFTDataError(f"max_length must be positive, got {max_length}")
    if isinstance(names, str):
        names = [names]
    if not names:
        raise SFTDataError("no SFT dataset named: pass at least one name from dataset_info.json")
    info = check_sft_datasets(dataset_info_dir, names)
    out = SFTDataset()
    for name in names:
        fmt, columns, tags = _entry_spec(name, info[name])
        out.dropped_too_long[name] = 0
        index = 0
        for path in _data_files(dataset_info_dir, name, info[name]):
            for record in _read_records(path):
                if max_samples is not None and index >= max_samples:
                    break
                where = f"dataset {name!r} ({os.path.basename(path)} record {index})"
                if not isinstance(record, dict):
                    raise SFTDataError(f"{where}: a record must be a JSON object")
                messages = (alpaca_messages(record, columns, where) if fmt == "alpaca"
                            else sharegpt_messages(record, columns, tags, where))
                tools = sharegpt_tools(record, columns, where) if fmt == "sharegpt" else None
                if tools:  # the tokenizer's own template, whatever `template` says: what the rollout renders
                    ids, mask = tokenize_tool_calls(messages, tokenizer, tools, where, tool_parser, stop_at_call_end,
                                                    chat_template_kwargs)
                elif render is None:
                    ids, mask = tokenize_messages(messages, tokenizer, where)
                else:
                    if any(m["role"] == "observation" for m in messages):
                        raise SFTDataError(f"{where}: observation turns are not rendered with data.template={template}"
                                           " (RL never sees a template's tool turn): leave data.template empty")
                    _check_order(messages, where)
                    ids, mask = tokenize_chat(messages, tokenizer, where, render=render)
                if len(ids) > max_length:
                    out.dropped_too_long[name] += 1
                else:
                    out.append(SFTExample(input_ids=ids, loss_mask=mask, source=f"{name}:{index}"))
                index += 1
    return out
