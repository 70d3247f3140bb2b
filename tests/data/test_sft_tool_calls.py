"""SFT in the tool-calling format: LLaMA-Factory sharegpt records with `tools` and function_call / observation turns
tokenize to exactly the ids and mask the tool_calls rollout produces for the same trajectory: Qwen2.5's and Qwen3's
templates (hermes), Qwen3's with enable_thinking false, Llama 3.1's (JSON calls ended by <|eom_id|>); the SFT
config's tool_parser / chat_template_kwargs and LLaMA-Factory's tool_format / enable_thinking."""
import json
import re

import pytest
import yaml

from megatron_searchr1.config import ConfigError, SFTConfig, load_config
from megatron_searchr1.config.llamafactory import translate
from megatron_searchr1.data.sft_data import SFTDataError, load_sft_dataset
from megatron_searchr1.rollout.loop import LoopSettings, Trajectory, run_rollout
from megatron_searchr1.rollout.protocols import ProtocolSpec, build_protocol
from megatron_searchr1.rollout.protocols.tool_calls import TOOL_INSTRUCTION
from megatron_searchr1.rollout.protocols.tools import BUILTIN, tool_specs
from tests.rollout.protocols.test_formats import LLAMA_SPECIAL, family
from tests.rollout.protocols.test_tool_calls import base_tok, with_template  # noqa: F401  (fixture)
from tests.rollout.scripted import ScriptedEngine

DOCS = 'Doc 1(id: 7, Title: "Acme") Acme was founded by Bo Lund.'
PAGE = 'Document 7 (Title: Acme), characters 0-40 of 40:\nAcme was founded by Bo Lund in 1901.'
TOOLS = [{"name": s.name, "description": s.description, "parameters": s.parameters} for s in (BUILTIN["search"],
                                                                                               BUILTIN["open"])]
RECORD = {"conversations": [
    {"from": "human", "value": "Question: Who founded Acme?"},
    {"from": "function_call", "value": json.dumps({"name": "search", "arguments": {"query": "who founded acme"}})},
    {"from": "observation", "value": DOCS},
    {"from": "function_call", "value": json.dumps({"name": "open", "arguments": {"doc_id": "7"}})},
    {"from": "observation", "value": PAGE},
    {"from": "gpt", "value": "<answer> Bo Lund </answer>"}],
    "system": TOOL_INSTRUCTION, "tools": json.dumps(TOOLS)}


def page(doc_id, offset=0):
    """The open tool of this test (a python: endpoint)."""
    return PAGE


def _write(tmp_path, records):
    (tmp_path / "tools.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"t": {
        "file_name": "tools.jsonl", "formatting": "sharegpt", "columns": {"messages": "conversations",
                                                                         "system": "system", "tools": "tools"}}}))
    return str(tmp_path)


@pytest.mark.parametrize("template", ["qwen2_5", "qwen3"])
def test_sft_ids_and_mask_are_the_rollouts(base_tok, tmp_path, template):  # noqa: F811
    tok = with_template(base_tok, template)
    (ex,) = load_sft_dataset(_write(tmp_path, [RECORD]), ["t"], tok, max_length=4096)
    # the same trajectory through the rollout: the engine writes the calls and the answer, the tools answer
    spec = ProtocolSpec("tool_calls", tools=tool_specs(["search", {"name": "open", "endpoint": f"python:{__name__}:page"}]))
    proto = build_protocol(spec, tok)
    prompt = proto.prompt_ids([{"role": "system", "content": TOOL_INSTRUCTION},
                               {"role": "user", "content": "Question: Who founded Acme?"}])
    turns = ['<tool_call>\n{"name": "search", "arguments": {"query": "who founded acme"}}\n</tool_call>',
             '<tool_call>\n{"name": "open", "arguments": {"doc_id": "7"}}\n</tool_call>',
             "<answer> Bo Lund </answer><|im_end|>"]
    engine = ScriptedEngine(tok, {tuple(prompt): turns})
    t = Trajectory(prompt_ids=prompt)
    run_rollout(engine, tok, lambda queries: [DOCS for _ in queries], [t], LoopSettings(
        max_tokens_per_turn=200, stop_token_ids=(tok.eos_token_id,), protocol_spec=spec))
    assert t.finish_reason == "answer" and t.n_tool_calls == 2
    assert ex.input_ids == t.prompt_ids + t.response_ids
    assert ex.loss_mask == [0] * len(t.prompt_ids) + t.loss_mask


def test_tool_records_that_the_rollout_could_not_produce_are_refused(base_tok, tmp_path):  # noqa: F811
    tok = with_template(base_tok, "qwen2_5")
    two = json.dumps([{"name": "search", "arguments": {"query": "a"}}, {"name": "search", "arguments": {"query": "b"}}])
    bad = dict(RECORD, conversations=RECORD["conversations"][:1] + [{"from": "function_call", "value": two},
                                                                    {"from": "observation", "value": "[\"x\", \"y\"]"},
                                                                    {"from": "gpt", "value": "a"}])
    with pytest.raises(SFTDataError, match="2 calls in one turn"):
        load_sft_dataset(_write(tmp_path, [bad]), ["t"], tok, max_length=4096)
    with pytest.raises(SFTDataError, match="does not render tools"):
        load_sft_dataset(_write(tmp_path, [RECORD]), ["t"], base_tok, max_length=4096)
    # a LLaMA-Factory YAML's `template: qwen` leaves tool records as the rollout renders them
    (plain,) = load_sft_dataset(_write(tmp_path, [RECORD]), ["t"], tok, max_length=4096)
    (named,) = load_sft_dataset(_write(tmp_path, [RECORD]), ["t"], tok, max_length=4096, template="qwen")
    assert named.input_ids == plain.input_ids and named.loss_mask == plain.loss_mask


THOUGHTS = ("<think> I need to find who founded Acme. </think>",
            "<think> Doc 7 is Acme. Next I need to open it. </think>", "<think> Acme was founded by Bo Lund. </think>")


def _with_thoughts(record):
    """RECORD with a thought leading each function_call (LLaMA-Factory's <think> block before the JSON) and the
    answer."""
    conv = [dict(m) for m in record["conversations"]]
    for m, thought in zip([m for m in conv if m["from"] in ("function_call", "gpt")], THOUGHTS):
        m["value"] = f"{thought}\n{m['value']}"
    return dict(record, conversations=conv)


@pytest.mark.parametrize("template", ["qwen2_5", "qwen3"])
def test_thought_before_a_call_is_model_text_read_as_the_turns_content(base_tok, tmp_path, template):  # noqa: F811
    tok = with_template(base_tok, template)
    (ex,) = load_sft_dataset(_write(tmp_path, [_with_thoughts(RECORD)]), ["t"], tok, max_length=4096)
    spec = ProtocolSpec("tool_calls", tools=tool_specs(["search", _open_tool()]))
    turns = [f'{THOUGHTS[0]}\n<tool_call>\n{{"name": "search", "arguments": {{"query": "who founded acme"}}}}\n'
             '</tool_call>',
             f'{THOUGHTS[1]}\n<tool_call>\n{{"name": "open", "arguments": {{"doc_id": "7"}}}}\n</tool_call>',
             f"{THOUGHTS[2]}\n<answer> Bo Lund </answer><|im_end|>"]
    t = _rollout(tok, spec, turns, tok.eos_token_id)
    assert ex.input_ids == t.prompt_ids + t.response_ids
    assert ex.loss_mask == [0] * len(t.prompt_ids) + t.loss_mask
    # every thought is in the loss, right before its call (or answer), and the reader keeps it as the turn's content
    masked = tok.decode([i for i, m in zip(ex.input_ids, ex.loss_mask) if m])
    for thought in THOUGHTS:
        assert f"{thought}\n<" in masked
    proto = build_protocol(spec, tok)
    for thought, turn in zip(THOUGHTS[:2], turns):
        content, calls = proto.parser.parse(turn)
        assert content == thought and len(calls) == 1 and calls[0].error is None
    # LLaMA-Factory's JSON without the thought still tokenizes to the bare call
    (bare,) = load_sft_dataset(_write(tmp_path, [RECORD]), ["t"], tok, max_length=4096)
    assert "<think>" not in tok.decode(bare.input_ids[len(t.prompt_ids):])


def test_function_call_text_that_is_neither_a_thought_nor_the_call_is_refused(base_tok, tmp_path):  # noqa: F811
    tok = with_template(base_tok, "qwen2_5")
    call = RECORD["conversations"][1]["value"]
    for value, match in ((f"Let me search.\n{call}", "optionally after one <think>...</think> thought; it has other "
                                                      "text: 'Let me search."),
                         (f"<think> unclosed\n{call}", "never closes with </think>"),
                         (f"<think> a </think> and more {call}", "it has other text: 'and more")):
        conv = [dict(m) for m in RECORD["conversations"]]
        conv[1]["value"] = value
        with pytest.raises(SFTDataError, match=re.escape(match)):
            load_sft_dataset(_write(tmp_path, [dict(RECORD, conversations=conv)]), ["t"], tok, max_length=4096)


def _rollout(tok, spec, turns, stop):
    """The trajectory of RECORD through the real rollout loop (the scripted engine writes `turns`, the tools answer)."""
    proto = build_protocol(spec, tok)
    prompt = proto.prompt_ids([{"role": "system", "content": TOOL_INSTRUCTION},
                               {"role": "user", "content": "Question: Who founded Acme?"}])
    t = Trajectory(prompt_ids=prompt)
    run_rollout(ScriptedEngine(tok, {tuple(prompt): turns}), tok, lambda queries: [DOCS for _ in queries], [t],
                LoopSettings(max_tokens_per_turn=200, stop_token_ids=(stop,), protocol_spec=spec))
    assert t.finish_reason == "answer" and t.answer == "Bo Lund" and t.n_tool_calls == 2 and t.n_invalid_calls == 0
    return t


def _open_tool():
    return {"name": "open", "endpoint": f"python:{__name__}:page"}


def test_llama3_1_sft_ids_are_the_rollouts_calls_ended_by_eom(base_tok, tmp_path):  # noqa: F811
    """Llama 3.1's own template, JSON calls (llama3_json, no closing string): each call turn ends with <|eom_id|>, the
    token the engine stops at, and its tool message is the delta the template writes after <|eot_id|>."""
    tok = family(base_tok, "llama3_1", LLAMA_SPECIAL, bos="<|begin_of_text|>", eos="<|eot_id|>")
    (ex,) = load_sft_dataset(_write(tmp_path, [RECORD]), ["t"], tok, max_length=4096, tool_parser="llama3_json")
    turns = ['{"name": "search", "parameters": {"query": "who founded acme"}}<|eom_id|>',
             '{"name": "open", "parameters": {"doc_id": "7"}}<|eom_id|>', "<answer> Bo Lund </answer><|eot_id|>"]
    spec = ProtocolSpec("tool_calls", tool_parser="auto", tools=tool_specs(["search", _open_tool()]))
    t = _rollout(tok, spec, turns, tok.eos_token_id)
    assert ex.input_ids == t.prompt_ids + t.response_ids
    assert ex.loss_mask == [0] * len(t.prompt_ids) + t.loss_mask
    # the loss is on the model's tokens only: its two calls with their <|eom_id|> and the answer with the eos
    learned = [i for i, m in zip(ex.input_ids, ex.loss_mask) if m]
    assert tok.decode(learned, skip_special_tokens=False) == "".join(turns)
    assert learned.count(tok.convert_tokens_to_ids("<|eom_id|>")) == 2
    assert "<|start_header_id|>ipython<|end_header_id|>" in tok.decode(ex.input_ids, skip_special_tokens=False)


def test_qwen3_sft_ids_are_the_rollouts_with_thinking_off(base_tok, tmp_path):  # noqa: F811
    """Qwen3's own template with chat_template_kwargs {enable_thinking: false}: the prompt and every delta end with
    the empty think block the template writes then, in the SFT ids as in the rollout's."""
    tok = with_template(base_tok, "qwen3")
    kwargs = {"enable_thinking": False}
    (ex,) = load_sft_dataset(_write(tmp_path, [RECORD]), ["t"], tok, max_length=4096, chat_template_kwargs=kwargs)
    turns = ['<tool_call>\n{"name": "search", "arguments": {"query": "who founded acme"}}\n</tool_call>',
             '<tool_call>\n{"name": "open", "arguments": {"doc_id": "7"}}\n</tool_call>',
             "<answer> Bo Lund </answer><|im_end|>"]
    spec = ProtocolSpec("tool_calls", tools=tool_specs(["search", _open_tool()]),
                        chat_template_kwargs=tuple(kwargs.items()))
    t = _rollout(tok, spec, turns, tok.eos_token_id)
    assert ex.input_ids == t.prompt_ids + t.response_ids
    assert ex.loss_mask == [0] * len(t.prompt_ids) + t.loss_mask
    learned = [i for i, m in zip(ex.input_ids, ex.loss_mask) if m]
    assert tok.decode(learned, skip_special_tokens=False) == "".join(turns)
    opener = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # the prompt's and the two deltas'
    assert tok.decode(ex.input_ids, skip_special_tokens=False).count(opener) == 3
    (thinking,) = load_sft_dataset(_write(tmp_path, [RECORD]), ["t"], tok, max_length=4096)  # the kwargs matter
    assert thinking.input_ids != ex.input_ids


def test_llama3_records_the_rollout_would_not_follow_are_refused(base_tok, tmp_path):  # noqa: F811
    tok = family(base_tok, "llama3_1", LLAMA_SPECIAL, bos="<|begin_of_text|>", eos="<|eot_id|>")
    two = json.dumps([{"name": "search", "arguments": {"query": "a"}}, {"name": "search", "arguments": {"query": "b"}}])
    conv = RECORD["conversations"]
    two_calls = dict(RECORD, conversations=conv[:1] + [{"from": "function_call", "value": two},
                                                       {"from": "observation", "value": '["x", "y"]'}] + conv[-1:])
    with pytest.raises(SFTDataError, match="cannot follow this function_call written in the llama3_json format"):
        load_sft_dataset(_write(tmp_path, [two_calls]), ["t"], tok, max_length=4096, tool_parser="llama3_json")
    json_answer = dict(RECORD, conversations=conv[:-1] + [{"from": "gpt", "value": '{"name": "x"}'}])
    with pytest.raises(SFTDataError, match="reads the final message as calls"):
        load_sft_dataset(_write(tmp_path, [json_answer]), ["t"], tok, max_length=4096, tool_parser="llama3_json")
    with pytest.raises(SFTDataError, match="not a clean suffix"):  # hermes calls where Llama's template has none
        load_sft_dataset(_write(tmp_path, [RECORD]), ["t"], tok, max_length=4096)


def test_the_sft_config_names_the_parser_and_kwargs_as_llamafactory_does(tmp_path):
    def cfg(raw, overrides=()):
        path = tmp_path / "sft.yaml"
        path.write_text(yaml.safe_dump(raw))
        return load_config(str(path), list(overrides), cls=SFTConfig, translate=lambda r: translate(r, 1, lambda s: 0))

    d = cfg({"dataset": "t", "tool_format": "llama3", "enable_thinking": False}).data
    assert (d.tool_parser, d.chat_template_kwargs, d.stop_at_call_end) == ("llama3_json", {"enable_thinking": False},
                                                                           True)
    d = cfg({"dataset": "t", "tool_format": "qwen"}, ["data.chat_template_kwargs={enable_thinking: true}"]).data
    assert (d.tool_parser, d.chat_template_kwargs) == ("hermes", {"enable_thinking": True})  # our dotted keys win
    with pytest.raises(ConfigError, match="tool_format: 'glm4' has no parser here"):
        cfg({"dataset": "t", "tool_format": "glm4"})
    with pytest.raises(ConfigError, match="data.tool_parser must be one of hermes"):
        cfg({"data": {"tool_parser": "llama"}})
    with pytest.raises(ConfigError, match="data.chat_template_kwargs must map names to scalars"):
        cfg({"data": {"chat_template_kwargs": {"x": [1]}}})
