"""The tool_calls protocol on chat templates outside the Qwen2.5/3 hermes family, each with its own call format:
Llama 3.1's (JSON calls, the `ipython` role, `<|eot_id|>` / `<|eom_id|>`), Qwen3.5's XML-ish calls (qwen3_coder),
Mistral v0.3's (refused: it moves the system message once the conversation goes on), Qwen3's with
chat_template_kwargs, and a tool declared only here (enum, nested object) called in a multi-turn trajectory. The
templates are the models' own (tokenizer_config.json), in templates/; the tokenizer is the tiny one with each
family's special tokens added."""
import copy
import json
import pathlib

import pytest

from megatron_searchr1.rollout.loop import LoopSettings, Trajectory, run_rollout
from megatron_searchr1.rollout.protocols import ProtocolSpec, build_protocol
from megatron_searchr1.rollout.protocols.parsers import get_parser
from megatron_searchr1.rollout.protocols.tool_calls import TemplateError, ToolCallsProtocol, tool_calls_messages
from megatron_searchr1.rollout.protocols.tools import tool_specs
from tests.rollout.protocols.test_tool_calls import DOCS, PAGES, Recorder, Searcher

TEMPLATES = pathlib.Path(__file__).parent / "templates"
ROUTES = []


def route(city, mode, where=None):
    """A tool of this test only (python: endpoint): it records its calls."""
    ROUTES.append((city, mode, where))
    return f"{city} by {mode}: 3 stops" + (f" near {where['near']} ({where['radius_km']} km)" if where else "")


ROUTE = {"name": "route", "description": "Plan a trip to a city.", "endpoint": f"python:{__name__}:route",
         "parameters": {"type": "object", "required": ["city", "mode"], "additionalProperties": False, "properties": {
             "city": {"type": "string"},
             "mode": {"type": "string", "enum": ["walk", "train"]},
             "where": {"type": "object", "required": ["near"], "properties": {
                 "near": {"type": "string"}, "radius_km": {"type": "integer", "minimum": 1}}}}}}
TOOLS = tool_specs(["search", {"name": "open", "endpoint": "python:tests.rollout.protocols.test_tool_calls:fake_open"},
                    ROUTE])
LLAMA_SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                 "<|python_tag|>"]


@pytest.fixture(scope="module")
def base_tok(tmp_path_factory):
    from megatron_searchr1.models.tiny import TinyModelConfig, train_tokenizer

    return train_tokenizer(TinyModelConfig(output_dir=str(tmp_path_factory.mktemp("tok")), vocab_size=400))


def family(base, template, special=(), bos=None, eos=None):
    tok = copy.deepcopy(base)
    if special:
        tok.add_special_tokens({"additional_special_tokens": list(special)})
    if bos:
        tok.bos_token = bos
    if eos:
        tok.eos_token = eos
    tok.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    return tok


def rollout(tok, turns, spec, stop):
    proto = build_protocol(spec, tok)
    prompt = proto.prompt_ids(tool_calls_messages("Who founded Acme?"))
    engine = Recorder(tok, {tuple(prompt): turns})
    t = Trajectory(prompt_ids=prompt, uid="q")
    run_rollout(engine, tok, Searcher(), [t], LoopSettings(
        max_turns=5, max_tokens_per_turn=200, max_response_length=3000, stop_token_ids=(stop,), protocol_spec=spec))
    assert len(t.response_ids) == len(t.loss_mask) == len(t.logprobs)
    # turn by turn: each request is the last one + what was generated + the delta; the trained ids are all of it
    for (p, g), (nxt, _) in zip(engine.requests, engine.requests[1:]):
        assert nxt[:len(p) + len(g)] == p + g
    last_p, last_g = engine.requests[-1]
    assert t.prompt_ids + t.response_ids == last_p + last_g
    gen = [i for i, m in zip(t.response_ids, t.loss_mask) if m]
    assert gen == sum((g for _, g in engine.requests), [])
    return t, engine


def deltas(tok, engine):
    return [tok.decode(nxt[len(p) + len(g):], skip_special_tokens=False)
            for (p, g), (nxt, _) in zip(engine.requests, engine.requests[1:])]


def test_llama3_1_json_calls_ipython_results_and_eom(base_tok):
    tok = family(base_tok, "llama3_1", LLAMA_SPECIAL, bos="<|begin_of_text|>", eos="<|eot_id|>")
    spec = ProtocolSpec("tool_calls", tool_parser="auto", tools=TOOLS)
    proto = build_protocol(spec, tok)
    assert proto.parser.name == "llama3_json" and proto.stop_strings == ()
    assert proto.stop_token_ids == (tok.convert_tokens_to_ids("<|eot_id|>"), tok.convert_tokens_to_ids("<|eom_id|>"))
    where = {"near": "the harbour", "radius_km": 2}
    turns = ['{"name": "search", "parameters": {"query": "who founded acme?"}}<|eot_id|>',
             '<|python_tag|>{"name": "open", "parameters": {"doc_id": "7"}}<|eom_id|>',  # ipython mode's end
             '{"name": "route", "parameters": {"city": "Oslo", "mode": "plane"}}<|eot_id|>',   # off the enum
             json.dumps({"name": "route", "parameters": {"city": "Oslo", "mode": "train", "where": where}})
             + "<|eot_id|>",
             "<answer> Bo Lund </answer><|eot_id|>"]
    ROUTES.clear()
    t, engine = rollout(tok, turns, spec, tok.convert_tokens_to_ids("<|eot_id|>"))
    assert (t.finish_reason, t.answer, t.n_tool_calls, t.n_invalid_calls) == ("answer", "Bo Lund", 4, 1)
    assert ROUTES == [("Oslo", "train", where)]  # the nested object reached the tool as an object
    head = "<|start_header_id|>ipython<|end_header_id|>\n\n"
    tail = "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    d = deltas(tok, engine)
    assert d[0] == head + json.dumps(DOCS["who founded acme?"].strip()) + tail  # the template tojson's a result
    assert d[1] == head + json.dumps(PAGES["7"]) + tail  # after <|eom_id|>: the same tool message as after eot
    assert d[2] == head + json.dumps("Error: argument 'mode' must be one of ['walk', 'train'], got \"plane\"") + tail
    assert d[3] == head + '"Oslo by train: 3 stops near the harbour (2 km)"' + tail
    # Llama 3.1 does not rewrite history: the first round re-rendered as messages is the same text
    msgs = tool_calls_messages("Who founded Acme?") + [
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {
            "name": "search", "arguments": {"query": "who founded acme?"}}}]},
        {"role": "tool", "content": DOCS["who founded acme?"].strip()}]
    p2 = engine.requests[1][0]
    assert tok.decode(p2, skip_special_tokens=False) == tok.apply_chat_template(
        msgs, tools=proto.schemas, tokenize=False, add_generation_prompt=True)


def test_llama3_1_two_calls_in_one_turn_are_invalid_as_its_template_renders_one(base_tok):
    tok = family(base_tok, "llama3_1", LLAMA_SPECIAL, bos="<|begin_of_text|>", eos="<|eot_id|>")
    spec = ProtocolSpec("tool_calls", tool_parser="llama3_json", tools=TOOLS)
    two = '{"name": "search", "parameters": {"query": "a"}}; {"name": "search", "parameters": {"query": "b"}}'
    t, _ = rollout(tok, [two + "<|eot_id|>"], spec, tok.convert_tokens_to_ids("<|eot_id|>"))
    assert t.finish_reason == "invalid" and t.n_tool_calls == 0


@pytest.mark.parametrize("thinking", [None, False])
def test_qwen3_coder_calls_and_chat_template_kwargs_reach_every_render(base_tok, thinking):
    tok = family(base_tok, "qwen3_5_text")
    kwargs = () if thinking is None else (("enable_thinking", thinking),)
    spec = ProtocolSpec("tool_calls", tool_parser="auto", tools=TOOLS, chat_template_kwargs=kwargs)
    proto = build_protocol(spec, tok)
    assert proto.parser.name == "qwen3_coder" and proto.stop_strings == ("</tool_call>",)
    coder = get_parser("qwen3_coder", proto.schemas)
    opener = "<think>\n" if thinking is None else "<think>\n\n</think>\n\n"
    prompt = tok.decode(proto.prompt_ids(tool_calls_messages("Who founded Acme?")))
    assert prompt.endswith("<|im_start|>assistant\n" + opener)
    think = "I search.\n</think>\n\n" if thinking is None else ""
    turns = [think + coder.render_call("search", {"query": "who founded acme?"}),
             think + coder.render_call("route", {"city": "Oslo", "mode": "walk",
                                                 "where": {"near": "the harbour", "radius_km": 2}}),
             think + "<answer> Bo Lund </answer><|im_end|>"]
    ROUTES.clear()
    t, engine = rollout(tok, turns, spec, tok.convert_tokens_to_ids("<|im_end|>"))
    assert (t.finish_reason, t.answer, t.n_tool_calls, t.n_invalid_calls) == ("answer", "Bo Lund", 2, 0)
    assert ROUTES == [("Oslo", "walk", {"near": "the harbour", "radius_km": 2})]  # typed by the schema
    # each result is the template's tool message, and the next turn opens as the prompt did (enable_thinking=false:
    # with the empty think block, rendered with the kwargs like the prompt)
    assert deltas(tok, engine)[0] == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n"
                                      + DOCS["who founded acme?"].strip()
                                      + "\n</tool_response><|im_end|>\n<|im_start|>assistant\n" + opener)


def test_mistral_v0_3_is_refused_for_moving_its_system_message(base_tok):
    special = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
               "[/TOOL_RESULTS]", "<s>", "</s>"]
    tok = family(base_tok, "mistral_v0_3", special, bos="<s>", eos="</s>")
    with pytest.raises(TemplateError, match="not a clean suffix.*renders differently once the turn follows it.*system "
                                            "message"):
        ToolCallsProtocol(tok, ProtocolSpec("tool_calls", tool_parser="auto", tools=TOOLS))
    # the format itself is read (a template that keeps its history in place would run with it)
    content, calls = get_parser("mistral").parse('[TOOL_CALLS] [{"name": "route", "arguments": {"city": "Oslo", '
                                                 '"mode": "walk"}, "id": "a1b2c3d4e"}]')
    assert (content, calls[0].name, calls[0].arguments) == ("", "route", {"city": "Oslo", "mode": "walk"})


def test_auto_refuses_a_template_whose_call_format_it_does_not_know(base_tok):
    tok = family(base_tok, "qwen2_5")
    tok.chat_template = tok.chat_template.replace("<tool_call>", "<call>").replace("</tool_call>", "</call>")
    with pytest.raises(TemplateError, match="tool_parser=auto: the chat template writes tool calls in none"):
        ToolCallsProtocol(tok, ProtocolSpec("tool_calls", tool_parser="auto", tools=TOOLS))


def test_qwen3_with_thinking_off_keeps_generation_ids_turn_by_turn(base_tok):
    """Qwen3's own template with rollout.chat_template_kwargs={enable_thinking: false}: the prompt and every delta end
    with the empty think block the template writes then, and the trained ids are generation's plus the deltas."""
    tok = family(base_tok, "qwen3")
    spec = ProtocolSpec("tool_calls", tools=TOOLS, chat_template_kwargs=(("enable_thinking", False),))
    hermes = get_parser("hermes")
    turns = [hermes.render_call("search", {"query": "who founded acme?"}),
             hermes.render_call("open", {"doc_id": "7"}), "<answer> Bo Lund </answer><|im_end|>"]
    t, engine = rollout(tok, turns, spec, tok.convert_tokens_to_ids("<|im_end|>"))
    assert (t.finish_reason, t.answer, t.n_tool_calls) == ("answer", "Bo Lund", 2)
    assert tok.decode(t.prompt_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert deltas(tok, engine) == [
        f"<|im_end|>\n<|im_start|>user\n<tool_response>\n{r}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        "<think>\n\n</think>\n\n" for r in (DOCS["who founded acme?"].strip(), PAGES["7"])]


@pytest.mark.parametrize("fmt, text, error", [
    ("qwen3_coder", "<tool_call>\n<parameter=q>\nx\n</parameter>\n</tool_call>",
     "the call must be <tool_call>\n<function"),
    ("qwen3_coder", "<tool_call>\n<function=search>\n<parameter=query>\nx", "the call is not closed with </tool_call>"),
    ("glm45", "<tool_call>search\n<arg_key>query</arg_key>x</tool_call>", "the call must be <tool_call>NAME"),
    ("llama3_json", '{"name": "search", "parameters": {"query": ', "the call is not JSON"),
    ("llama3_json", '<|python_tag|>search.call(query="x")', 'the call must be a JSON object {"name"'),
    ("mistral", '[TOOL_CALLS] [{"name": "search", "arguments": {"query": "x"}', "the call is not JSON"),
])
def test_every_format_reports_a_call_it_cannot_read_instead_of_dropping_it(fmt, text, error):
    content, calls = get_parser(fmt, [t.schema() for t in TOOLS]).parse(text)
    assert len(calls) == 1 and calls[0].arguments is None and calls[0].error.startswith(error), calls


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder", "glm45", "llama3_json", "mistral"])
def test_every_format_reads_back_the_calls_it_writes_typed_by_the_schema(fmt):
    p = get_parser(fmt, [t.schema() for t in TOOLS])
    args = {"city": "Oslo", "mode": "walk", "where": {"near": "the harbour", "radius_km": 2}}
    content, calls = p.parse("Planning.\n" + p.render_call("route", args) if fmt != "llama3_json"
                             else p.render_call("route", args))
    assert [(c.name, c.arguments, c.error) for c in calls] == [("route", args, None)]
    assert content == ("" if fmt == "llama3_json" else "Planning.")
