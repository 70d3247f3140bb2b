"""SFT in the tool-calling format: LLaMA-Factory sharegpt records with `tools` and function_call / observation turns
tokenize to exactly the ids and mask the tool_calls rollout produces for the same trajectory."""
import json

import pytest

from megatron_searchr1.data.sft_data import SFTDataError, load_sft_dataset
from megatron_searchr1.rollout.loop import LoopSettings, Trajectory, run_rollout
from megatron_searchr1.rollout.protocols import ProtocolSpec, build_protocol
from megatron_searchr1.rollout.protocols.tool_calls import TOOL_INSTRUCTION
from megatron_searchr1.rollout.protocols.tools import BUILTIN, tool_specs
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
