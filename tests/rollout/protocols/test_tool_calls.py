"""The tool_calls protocol on real chat templates (Qwen2.5's and Qwen3's, from their tokenizer_config.json, in
templates/): the ids trained on are the ids generated plus the template's tool-message deltas, turn by turn, with
thinking, and a template that cannot carry the protocol is refused."""
import copy
import json
import pathlib

import pytest

from megatron_searchr1.rollout import loop
from megatron_searchr1.rollout.loop import LoopSettings, Trajectory, run_rollout
from megatron_searchr1.rollout.protocols import ProtocolSpec, build_protocol
from megatron_searchr1.rollout.protocols.tool_calls import TemplateError, ToolCallsProtocol, tool_calls_messages
from megatron_searchr1.rollout.protocols.tools import tool_specs
from tests.rollout.scripted import ScriptedEngine

TEMPLATES = pathlib.Path(__file__).parent / "templates"
DOCS = {"who founded acme?": 'Doc 1(id: 7, Title: "Acme") Acme was founded by Bo Lund.\n'}
PAGES = {"7": 'Document 7 (Title: "Acme"): Acme was founded by Bo Lund in 1901 in Oslo.'}


def fake_open(doc_id, offset=0):
    """The `open` tool of these tests (a python: endpoint)."""
    return PAGES.get(doc_id, f"no document {doc_id}")[offset:]


TOOLS = tool_specs(["search", {"name": "open", "endpoint": f"python:{__name__}:fake_open"}])


@pytest.fixture(scope="module")
def base_tok(tmp_path_factory):
    from megatron_searchr1.models.tiny import TinyModelConfig, train_tokenizer

    return train_tokenizer(TinyModelConfig(output_dir=str(tmp_path_factory.mktemp("tok")), vocab_size=400))


def with_template(tok, name):
    tok = copy.deepcopy(tok)
    tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return tok


class Recorder(ScriptedEngine):
    """A ScriptedEngine that keeps every request's prompt ids and its generation."""

    def __init__(self, tokenizer, scripts):
        super().__init__(tokenizer, scripts)
        self.requests = []

    def generate(self, prompts, params):
        outs = super().generate(prompts, params)
        self.requests += [(list(p), list(g.token_ids)) for p, g in zip(prompts, outs)]
        return outs


class Searcher:
    def __init__(self):
        self.calls = []

    def __call__(self, queries):
        self.calls.append(list(queries))
        return [DOCS.get(q, "Doc 1(id: 0, Title: \"X\") nothing\n") for q in queries]


def call(name, **arguments):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def _rollout(tok, turns, spec=None, **settings):
    spec = spec or ProtocolSpec("tool_calls", tools=TOOLS)
    proto = build_protocol(spec, tok)
    prompt = proto.prompt_ids(tool_calls_messages("Who founded Acme?"))
    engine = Recorder(tok, {tuple(prompt): turns})
    t = Trajectory(prompt_ids=prompt, uid="q")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    s = LoopSettings(**{"max_turns": 4, "max_tokens_per_turn": 200, "max_response_length": 2000,
                        "stop_token_ids": (im_end,), "protocol_spec": spec, **settings})
    searcher = Searcher()
    stats = run_rollout(engine, tok, searcher, [t], s)
    assert len(t.response_ids) == len(t.loss_mask) == len(t.logprobs)
    return t, engine, searcher, stats


# Turns as a Qwen model writes them: thinking (in the layout each template renders, and in another), a call closed by
# </tool_call> (generation stops there), the answer closed by the eos.
TURNS = [
    "<think>\nI need the founder.\n</think>\n\n" + call("search", query="who founded acme?"),
    "<think>I should read doc 7.</think>\n" + call("open", doc_id="7"),
    "<think>\nBo Lund.\n</think>\n\n<answer> Bo Lund </answer><|im_end|>",
]
# What the template adds after a call that stopped at </tool_call>: the end of the assistant turn, the tool message,
# the next assistant header (Qwen2.5's and Qwen3's tool message, read off their templates).
DELTA = "<|im_end|>\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("template", ["qwen2_5", "qwen3"])
def test_trained_ids_are_generated_ids_plus_tool_deltas_turn_by_turn(base_tok, template):
    tok = with_template(base_tok, template)
    t, engine, searcher, _ = _rollout(tok, TURNS)
    assert (t.finish_reason, t.answer, t.n_searches, t.n_tool_calls, t.queries) == (
        "answer", "Bo Lund", 1, 2, ["who founded acme?"])
    assert searcher.calls == [["who founded acme?"]]
    (p1, g1), (p2, g2), (p3, g3) = engine.requests
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    # every turn's request is the previous request + what was generated + the delta: nothing before it changes
    d1, d2 = p2[len(p1) + len(g1):], p3[len(p2) + len(g2):]
    assert p2[:len(p1) + len(g1)] == p1 + g1 and p3[:len(p2) + len(g2)] == p2 + g2
    assert t.prompt_ids + t.response_ids == p3 + g3 and t.prompt_ids == p1
    assert g1 == enc(TURNS[0]) and g2 == enc(TURNS[1]) and g3 == enc(TURNS[2])  # the engine's ids, as generated
    # the deltas are the template's tool message around each result, the results tokenized on their own
    assert tok.decode(d1) == DELTA.format(DOCS["who founded acme?"].strip())
    assert tok.decode(d2) == DELTA.format(PAGES["7"])
    res = enc(DOCS["who founded acme?"].strip())
    assert any(d1[i:i + len(res)] == res for i in range(len(d1)))
    # loss mask: 1 on exactly the generated ids
    assert t.loss_mask == [1] * len(g1) + [0] * len(d1) + [1] * len(g2) + [0] * len(d2) + [1] * len(g3)


def test_qwen3_re_render_would_rewrite_history_and_ours_does_not(base_tok):
    """Qwen3's template renders an assistant turn's thinking in its own layout (and adds an empty think block to the
    last turn): re-rendering the conversation gives other tokens than the policy generated. Our ids are generated +
    deltas; the re-render's are not."""
    tok = with_template(base_tok, "qwen3")
    turns = [call("search", query="who founded acme?"), "<answer> Bo Lund </answer><|im_end|>"]  # no thinking
    t, engine, _, _ = _rollout(tok, turns)
    msgs = tool_calls_messages("Who founded Acme?") + [
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "search", "arguments": {"query": "who founded acme?"}}}]},
        {"role": "tool", "content": DOCS["who founded acme?"].strip()},
        {"role": "assistant", "content": "<answer> Bo Lund </answer>"}]
    rerendered = tok.apply_chat_template(msgs, tools=[s.schema() for s in TOOLS], tokenize=False)
    ours = tok.decode(t.prompt_ids + t.response_ids)
    assert "<think>\n\n</think>\n\n<answer> Bo Lund </answer>" in rerendered  # an empty think block never generated
    assert ours + "\n" != rerendered
    assert ours.endswith("<|im_start|>assistant\n<answer> Bo Lund </answer><|im_end|>")
    assert t.response_ids[-len(engine.requests[-1][1]):] == engine.requests[-1][1]


def test_qwen2_5_conversation_equals_the_template_rendering_of_the_same_messages(base_tok):
    """Qwen2.5's template does not rewrite history: a whole rollout, re-rendered as messages, gives the same text (the
    deltas are exactly the template's; written in the template's own layout the turns round-trip)."""
    tok = with_template(base_tok, "qwen2_5")
    turns = ["I search.\n" + call("search", query="who founded acme?"), "<answer> Bo Lund </answer><|im_end|>"]
    t, _, _, _ = _rollout(tok, turns)
    msgs = tool_calls_messages("Who founded Acme?") + [
        {"role": "assistant", "content": "I search.", "tool_calls": [{"type": "function", "function": {
            "name": "search", "arguments": {"query": "who founded acme?"}}}]},
        {"role": "tool", "content": DOCS["who founded acme?"].strip()},
        {"role": "assistant", "content": "<answer> Bo Lund </answer>"}]
    rendered = tok.apply_chat_template(msgs, tools=[s.schema() for s in TOOLS], tokenize=False)
    assert tok.decode(t.prompt_ids + t.response_ids) + "\n" == rendered


@pytest.mark.parametrize("template", ["qwen2_5", "qwen3"])
def test_several_calls_in_one_turn_come_back_in_one_delta(base_tok, template):
    """With stop_at_call_end=false a turn ends at the eos and may hold several calls; their results are the
    template's consecutive tool messages (one user block for Qwen)."""
    tok = with_template(base_tok, template)
    spec = ProtocolSpec("tool_calls", tools=TOOLS, stop_at_call_end=False)
    turn = call("search", query="who founded acme?") + "\n" + call("open", doc_id="7") + "<|im_end|>"
    t, engine, searcher, _ = _rollout(tok, [turn, "<answer> Bo Lund </answer><|im_end|>"], spec=spec)
    (p1, g1), (p2, _) = engine.requests
    delta = tok.decode(p2[len(p1) + len(g1):])
    assert delta == ("\n<|im_start|>user\n<tool_response>\n" + DOCS["who founded acme?"].strip()
                     + "\n</tool_response>\n<tool_response>\n" + PAGES["7"] + "\n</tool_response><|im_end|>\n"
                     "<|im_start|>assistant\n")
    assert t.finish_reason == "answer" and t.n_tool_calls == 2 and searcher.calls == [["who founded acme?"]]


def test_invalid_calls_get_error_observations_and_end_the_trajectory_after_max_invalid_calls(base_tok):
    tok = with_template(base_tok, "qwen2_5")
    turns = ['<tool_call>\n{"name": "search", "arguments": {"query": </tool_call>',  # not JSON
             call("browse", url="x"),                                               # unknown tool
             call("search", query="who founded acme?"),                             # valid: the streak restarts
             call("open"),                                                          # missing doc_id
             call("open", doc_id=7),                                                # doc_id not a string
             call("search", q="x")]                                                 # missing query
    spec = ProtocolSpec("tool_calls", tools=TOOLS, max_invalid_calls=3)
    t, engine, searcher, stats = _rollout(tok, turns, spec=spec, max_turns=10)
    text = tok.decode(t.response_ids)
    assert "Error: the call is not JSON" in text and "Error: unknown tool 'browse'; the tools are search, open" in text
    assert "Error: missing required argument 'doc_id'" in text and "argument 'doc_id' must be a string, got 7" in text
    assert (t.finish_reason, t.n_invalid_calls, t.n_tool_calls, t.n_searches) == ("invalid_calls", 5, 6, 1)
    assert searcher.calls == [["who founded acme?"]]  # invalid calls never reach a tool
    m = stats.as_metrics([t])
    assert m["rollout/finish_invalid_calls"] == 1.0 and m["rollout/invalid_calls_mean"] == 5.0
    gen = [i for i, m in zip(t.response_ids, t.loss_mask) if m]
    assert gen == sum((g for _, g in engine.requests), [])  # error observations are masked, like every tool result


def test_a_turn_cut_at_the_length_limit_ends_invalid(base_tok):
    tok = with_template(base_tok, "qwen3")
    t, _, _, _ = _rollout(tok, ["<think> " + "la " * 200], max_tokens_per_turn=20)
    assert t.finish_reason == "invalid" and t.n_invalid == 1


def test_results_are_cut_to_max_obs_length_and_a_delta_that_does_not_fit_ends_length(base_tok):
    tok = with_template(base_tok, "qwen2_5")
    t, engine, _, _ = _rollout(tok, TURNS, max_obs_length=20)
    (p1, g1), (p2, _), _ = engine.requests
    delta = p2[len(p1) + len(g1):]
    glue = tok.encode(DELTA.format(""), add_special_tokens=False)
    assert len(delta) <= 20 + len(glue) + 2
    # no room for the delta: the trajectory ends `length` without a partial tool message
    n = len(tok.encode(TURNS[0], add_special_tokens=False)) + 5
    t, _, _, _ = _rollout(tok, TURNS, max_response_length=n, max_tokens_per_turn=n)
    assert t.finish_reason == "length" and t.loss_mask == [1] * len(t.response_ids) and t.n_tool_calls == 1


def test_a_tokenizer_without_a_tool_calling_template_is_refused(base_tok):
    spec = ProtocolSpec("tool_calls", tools=TOOLS)
    with pytest.raises(TemplateError, match="does not render tools"):
        ToolCallsProtocol(base_tok, spec)  # the tiny model's plain chat template
    bare = copy.deepcopy(base_tok)
    bare.chat_template = None
    with pytest.raises(TemplateError, match="has none"):
        ToolCallsProtocol(bare, spec)


def test_a_template_whose_tool_message_rewrites_what_came_before_is_refused(base_tok):
    tok = with_template(base_tok, "qwen2_5")
    # a (made-up) template that counts the messages in its system block: every tool message changes the text before
    tok.chat_template = "{{- 'turns: ' + (messages|length|string) + '\n' }}" + tok.chat_template
    with pytest.raises(TemplateError, match="not a clean suffix.*renders differently once the turn follows it"):
        ToolCallsProtocol(tok, ProtocolSpec("tool_calls", tools=TOOLS))


def test_a_template_that_json_encodes_tool_results_gets_them_json_encoded(base_tok):
    """A template outside the Qwen family (tool results written with `tojson`, its own turn markers): the protocol
    derives its delta the same way, and the result's quotes and newlines come out escaped as the template does."""
    tok = copy.deepcopy(base_tok)
    tok.chat_template = (
        "{%- if tools %}{{- '<|im_start|>tools\n' + (tools|tojson) + '<|im_end|>\n' }}{%- endif %}"
        "{%- for m in messages %}"
        "{%- if m.role == 'tool' %}{{- '<|im_start|>tool\n{\"result\": ' + (m.content|tojson) + '}<|im_end|>\n' }}"
        "{%- elif m.role == 'assistant' and m.tool_calls %}{{- '<|im_start|>assistant\n' + m.content }}"
        "{%- for c in m.tool_calls %}{{- '<tool_call>' + ({'name': c.function.name, 'arguments': c.function.arguments}"
        "|tojson) + '</tool_call>' }}{%- endfor %}{{- '<|im_end|>\n' }}"
        "{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
    PAGES["q"] = 'say "hi"\nthen go'
    t, engine, _, _ = _rollout(tok, [call("open", doc_id="q"), "<answer> x </answer><|im_end|>"])
    (p1, g1), (p2, _) = engine.requests
    assert tok.decode(p2[len(p1) + len(g1):]) == ('<|im_end|>\n<|im_start|>tool\n{"result": "say \\"hi\\"\\nthen go"}'
                                                  '<|im_end|>\n<|im_start|>assistant\n')
    assert t.finish_reason == "answer"


def test_search_r1_stays_the_default(base_tok):
    assert LoopSettings().protocol_spec.name == "search_r1"
    assert loop.parse_action("<search> q </search>") == ("search", "q")


def test_the_trainer_renders_tool_calls_prompts_with_the_tools_and_refuses_a_template_without_them(base_tok, tmp_path):
    import pandas as pd

    from megatron_searchr1.cli import UsageError
    from megatron_searchr1.config import load_config
    from megatron_searchr1.data.rl_data import load_prompts
    from megatron_searchr1.trainer.build import prompt_renderer

    cfg = load_config(None, ["rollout.protocol=tool_calls", "model.path=M"])
    with pytest.raises(UsageError, match="model.path=M: the tokenizer's chat template does not render tools"):
        prompt_renderer(cfg, base_tok)
    assert prompt_renderer(load_config(None, []), base_tok) is None  # search_r1: render_prompt as before
    tok = with_template(base_tok, "qwen3")
    path = tmp_path / "train.parquet"
    pd.DataFrame([{"prompt": tool_calls_messages("Who founded Acme?"), "data_source": "nq",
                   "reward_model": {"ground_truth": {"target": ["Bo Lund"]}}, "extra_info": {"uid": "a"}}]).to_parquet(path)
    (row,), _ = load_prompts([str(path)], tok, 4096, render=prompt_renderer(cfg, tok))
    text = tok.decode(row.prompt_ids)
    assert '"name": "open"' in text and '"name": "search"' in text and text.endswith("<|im_start|>assistant\n")


def test_a_call_closed_by_a_token_the_template_never_ends_a_turn_with_is_invalid(base_tok):
    """A base model's <|endoftext|> after a call (an eos of its generation config, not the template's end of turn):
    no delta can follow it, so the turn is invalid rather than a crash in the middle of a run."""
    tok = with_template(base_tok, "qwen2_5")
    spec = ProtocolSpec("tool_calls", tools=TOOLS, stop_at_call_end=False)
    endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
    t, _, _, _ = _rollout(tok, [call("search", query="who founded acme?") + "<|endoftext|>"], spec=spec,
                          stop_token_ids=(tok.convert_tokens_to_ids("<|im_end|>"), endoftext))
    assert t.finish_reason == "invalid" and t.n_tool_calls == 0 and t.response_ids[-1] == endoftext
