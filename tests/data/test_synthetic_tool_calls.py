"""The synthetic world's demonstrator in the tool_calls protocol: prompts in the protocol's messages, gold trajectories
as LLaMA-Factory tool data (function_call turns led by Search-R1's thought in a think block, observations, the search
tool's schema, results with document ids) that the SFT loader tokenizes to the rollout's layout."""
import json
import os
import re

import pandas as pd

from megatron_searchr1.data import make_world
from megatron_searchr1.data.sft_data import load_sft_dataset
from megatron_searchr1.rollout.protocols.tool_calls import TOOL_INSTRUCTION
from tests.data.test_oracle import SMALL
from tests.rollout.protocols.test_tool_calls import base_tok, with_template  # noqa: F401  (fixture)


def test_make_world_writes_tool_calls_prompts_and_trajectories(tmp_path, base_tok):  # noqa: F811
    out = str(tmp_path / "w")
    args = ["--out-dir", out, "--oracle", "bm25", "--protocol", "tool_calls"]
    for k, v in SMALL.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    assert make_world.main(args) == 0
    row = pd.read_parquet(os.path.join(out, "train.parquet")).iloc[0]
    prompt = [dict(m) for m in row["prompt"]]
    assert prompt == [{"role": "system", "content": TOOL_INSTRUCTION},
                      {"role": "user", "content": f"Question: {row['extra_info']['question']}"}]
    info = json.load(open(os.path.join(out, "sft", "dataset_info.json")))["synthetic_sft_train"]
    assert info["columns"]["tools"] == "tools" and info["tags"]["function_tag"] == "function_call"
    records = [json.loads(line) for line in open(os.path.join(out, "sft", "train.jsonl"))]
    rec = records[0]
    turns = rec["messages"][2:]
    assert [m["role"] for m in turns] == ["function_call", "observation"] * rec["searches"] + ["assistant"]
    # each call turn carries the Search-R1 demonstration's thought as a think block, then the JSON call
    thought, sep, call = turns[0]["content"].partition(" </think>\n")
    assert thought.startswith("<think> I need to find ") and sep
    call = json.loads(call)
    assert call["name"] == "search" and set(call["arguments"]) == {"query"}
    # a second call's thought states what the first search found and announces the next search
    multi = next(r for r in records if r["searches"] >= 2)["messages"][2:]
    found = re.match(r"<think> .+ is (.+?)\. Next I need to find .+\. </think>\n\{", multi[2]["content"])
    assert found and found.group(1) in multi[1]["content"]
    assert turns[1]["content"].startswith("Doc 1(id: ")  # the open tool takes the ids the search results carry
    assert turns[-1]["content"].endswith(f"<answer> {rec['answer']} </answer>")
    assert [t["name"] for t in json.loads(rec["tools"])] == ["search"]
    tok = with_template(base_tok, "qwen2_5")
    examples = load_sft_dataset(os.path.join(out, "sft"), ["synthetic_sft_train"], tok, max_length=100_000)
    assert len(examples) == len(records)
    text = tok.decode(examples[0].input_ids)
    assert text.count('<tool_call>\n{"name": "search", "arguments": {"query": ') == rec["searches"]
    masked = tok.decode([i for i, m in zip(examples[0].input_ids, examples[0].loss_mask) if m])
    assert "<tool_response>" not in masked and masked.endswith("</answer><|im_end|>")
    assert masked.startswith("<think> I need to find ") and masked.count(" </think>\n<tool_call>\n") == rec["searches"]
