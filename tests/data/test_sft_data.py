"""SFT data loading: the loss mask covers exactly the assistant's own text (prompt and <information> blocks masked)
for alpaca and sharegpt data, and the token ids are what the rollout produces for the same trajectory."""
import json
import os
import subprocess
import sys

import pytest

from megatron_searchr1.data import oracle
from megatron_searchr1.data.prompts import (
    INFO_END, INFO_START, answer_turn, format_observation, make_prompt, render_prompt, search_turn,
)
from megatron_searchr1.data.sft_data import (
    SFTDataError, load_sft_dataset, tokenize_messages,
)
from megatron_searchr1.models.tiny import TinyModelConfig, train_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_tokenizer(TinyModelConfig(output_dir=str(tmp_path_factory.mktemp("tok"))))


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _runs(ids, mask, tok):
    """(masked texts, unmasked texts): the decoded maximal runs of equal mask."""
    runs = {0: [], 1: []}
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            runs[mask[start]].append(tok.decode(ids[start:i]))
            start = i
    return runs[1], runs[0]


def _search_trajectory(question="Where was Ada Quill born?", template="base"):
    prompt = make_prompt(question, template)
    turns = [
        {"role": "assistant", "content": search_turn("I need to find the birthplace of Ada Quill.", "Ada Quill born")},
        {"role": "observation", "content": format_observation('Doc 1(Title: "Ada Quill") Ada Quill was born in Lyon.')},
        {"role": "assistant", "content": search_turn("Ada Quill was born in Lyon. Next the country.", "Lyon country")},
        {"role": "observation", "content": format_observation('Doc 1(Title: "Lyon") Lyon is a city in France.')},
        {"role": "assistant", "content": answer_turn("Lyon is in France.", "France")},
    ]
    return prompt, turns


def _rollout_stream(tok, prompt, turns):
    """What rollout/loop.py builds: prompt ids, then per turn the engine's ids for the assistant text (stopping at
    </search> or </answer>) and the tokenised observation appended after a search."""
    ids = list(_ids(tok, render_prompt(prompt, tok)))
    response, mask = [], []
    for m in turns:
        seg = _ids(tok, m["content"])
        response += seg
        mask += [1 if m["role"] == "assistant" else 0] * len(seg)
    return ids, response, mask


def _write_info(d, entries, files):
    for name, records in files.items():
        path = os.path.join(d, name)
        with open(path, "w") as f:
            if name.endswith(".jsonl"):
                f.writelines(json.dumps(r) + "\n" for r in records)
            else:
                json.dump(records, f)
    with open(os.path.join(d, "dataset_info.json"), "w") as f:
        json.dump(entries, f)
    return str(d)


# ----------------------------------------------------------------------------------------------------------------
# sharegpt in the rollout layout (what the synthetic world writes)
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("template", ["base", "chat"])
def test_sharegpt_search_trajectory_masks_exactly_the_assistant_text(tok, tmp_path, template):
    prompt, turns = _search_trajectory(template=template)
    d = _write_info(tmp_path, {"traj": {"file_name": "t.jsonl", "formatting": "sharegpt",
                                        "columns": {"messages": "messages"}, "tags": dict(oracle.DATASET_TAGS)}},
                    {"t.jsonl": [{"messages": prompt + turns}]})
    (ex,) = load_sft_dataset(d, ["traj"], tok, max_length=4096)
    assert len(ex.input_ids) == len(ex.loss_mask) and ex.source == "traj:0"
    masked, unmasked = _runs(ex.input_ids, ex.loss_mask, tok)
    assert masked == [m["content"] for m in turns if m["role"] == "assistant"]
    assert unmasked == [render_prompt(prompt, tok)] + [m["content"] for m in turns if m["role"] == "observation"]
    # no <information> block and none of the question is trained on
    info_ids = {tok.convert_tokens_to_ids(INFO_START), tok.convert_tokens_to_ids(INFO_END)}
    assert info_ids <= set(ex.input_ids)
    assert all(m == 0 for i, m in zip(ex.input_ids, ex.loss_mask) if i in info_ids)
    # ... and the ids are what the rollout produces: prompt ids, then the response stream with its mask
    prompt_ids, response, mask = _rollout_stream(tok, prompt, turns)
    assert ex.input_ids == prompt_ids + response
    assert ex.loss_mask == [0] * len(prompt_ids) + mask
    if template == "chat":  # a system message: the prompt went through the chat template with a generation prompt
        assert tok.decode(prompt_ids).endswith("<|im_start|>assistant\n")


def test_segments_are_tokenised_on_their_own_not_joined(tok):
    """BPE must not merge across a turn boundary: the rollout never sees a merged token."""
    messages = [{"role": "user", "content": "Question: what is water?\n"},
                {"role": "assistant", "content": "<search> wat"},
                {"role": "observation", "content": "er is wet"},
                {"role": "assistant", "content": "<answer> wet </answer>"}]
    ids, mask = tokenize_messages(messages, tok)
    prompt = render_prompt(messages[:1], tok)  # the tokenizer has a chat template: Search-R1's rule applies it
    segs = [_ids(tok, prompt)] + [_ids(tok, m["content"]) for m in messages[1:]]
    assert ids == [i for s in segs for i in s]
    joined = _ids(tok, "".join(m["content"] for m in messages))
    assert joined != ids  # the joined text tokenises differently ("wat"+"er" merge), so the check above has teeth
    assert mask == [0] * len(segs[0]) + [1] * len(segs[1]) + [0] * len(segs[2]) + [1] * len(segs[3])


def test_sharegpt_defaults_and_function_call_role(tok, tmp_path):
    """LLaMA-Factory's defaults: column `conversations`, tags from/value, human/gpt/observation/function_call/system."""
    conv = [{"from": "system", "value": "You answer with search."},
            {"from": "human", "value": "Question: who?"},
            {"from": "function_call", "value": "<search> who </search>"},
            {"from": "observation", "value": format_observation("Doc 1 nobody")},
            {"from": "gpt", "value": "<answer> nobody </answer>"}]
    d = _write_info(tmp_path, {"c": {"file_name": "c.json", "formatting": "sharegpt"}}, {"c.json": [{"conversations": conv}]})
    (ex,) = load_sft_dataset(d, ["c"], tok, max_length=4096)
    masked, unmasked = _runs(ex.input_ids, ex.loss_mask, tok)
    assert masked == ["<search> who </search>", "<answer> nobody </answer>"]
    sys_user = [{"role": "system", "content": conv[0]["value"]}, {"role": "user", "content": conv[1]["value"]}]
    assert unmasked == [tok.apply_chat_template(sys_user, add_generation_prompt=True, tokenize=False), conv[3]["value"]]


# ----------------------------------------------------------------------------------------------------------------
# alpaca
# ----------------------------------------------------------------------------------------------------------------
def test_alpaca_instruction_input_output(tok, tmp_path):
    records = [{"instruction": "Name the capital.", "input": "France", "output": "<answer> paris </answer>"},
               {"instruction": "Say hi.", "input": "", "output": "hi", "sys": "Be brief."}]
    d = _write_info(tmp_path, {"a": {"file_name": "a.json", "columns": {"system": "sys"}}}, {"a.json": records})
    ex0, ex1 = load_sft_dataset(d, ["a"], tok, max_length=4096)
    # one user message, rendered as the rollout renders it (render_prompt: this tokenizer's chat template)
    user = render_prompt([{"role": "user", "content": "Name the capital.\nFrance"}], tok)
    assert user == "<|im_start|>user\nName the capital.\nFrance<|im_end|>\n<|im_start|>assistant\n"
    assert _runs(ex0.input_ids, ex0.loss_mask, tok) == (["<answer> paris </answer>"], [user])
    assert ex0.input_ids == _ids(tok, user) + _ids(tok, "<answer> paris </answer>")
    # the system column makes it a chat-template prompt
    prompt = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}],
                                     add_generation_prompt=True, tokenize=False)
    assert _runs(ex1.input_ids, ex1.loss_mask, tok) == (["hi"], [prompt])


def test_alpaca_history_is_a_chat_conversation(tok, tmp_path):
    rec = {"instruction": "And 3+3?", "output": "6", "history": [["What is 1+1?", "2"], ["And 2+2?", "4"]]}
    d = _write_info(tmp_path, {"a": {"file_name": "a.jsonl", "columns": {"history": "history"}}}, {"a.jsonl": [rec]})
    (ex,) = load_sft_dataset(d, ["a"], tok, max_length=4096)
    masked, unmasked = _runs(ex.input_ids, ex.loss_mask, tok)
    assert masked == ["2<|im_end|>\n", "4<|im_end|>\n", "6<|im_end|>\n"]
    assert unmasked[0] == "<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n"
    assert unmasked[1] == "<|im_start|>user\nAnd 2+2?<|im_end|>\n<|im_start|>assistant\n"
    msgs = [{"role": "user", "content": "What is 1+1?"}, {"role": "assistant", "content": "2"},
            {"role": "user", "content": "And 2+2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6"}]
    assert tok.decode(ex.input_ids) == tok.apply_chat_template(msgs, tokenize=False)


def test_chat_layout_prompt_prefix_tokenises_as_when_prompted(tok):
    """Each assistant turn k starts right after tok(the chat prompt of messages[:k]) pieces: the model is trained on
    the ids it is given when prompted with that prefix."""
    msgs = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "how are you"}, {"role": "assistant", "content": "fine"}]
    ids, mask = tokenize_messages(msgs, tok)
    first = _ids(tok, tok.apply_chat_template(msgs[:1], add_generation_prompt=True, tokenize=False))
    assert ids[: len(first)] == first and set(mask[: len(first)]) == {0} and mask[len(first)] == 1


# ----------------------------------------------------------------------------------------------------------------
# length limit and errors
# ----------------------------------------------------------------------------------------------------------------
def test_too_long_examples_are_dropped_and_counted_never_truncated(tok, tmp_path):
    records = [{"instruction": "short", "output": "ok"}, {"instruction": "long " * 200, "output": "ok"}]
    d = _write_info(tmp_path, {"a": {"file_name": "a.json"}}, {"a.json": records})
    full = load_sft_dataset(d, ["a"], tok, max_length=10_000)
    limit = len(full[0].input_ids)
    out = load_sft_dataset(d, ["a"], tok, max_length=limit)
    assert [e.input_ids for e in out] == [full[0].input_ids] and out[0].source == "a:0"
    assert out.dropped_too_long == {"a": 1}
    assert load_sft_dataset(d, ["a"], tok, max_length=limit - 1).dropped_too_long == {"a": 2}


@pytest.mark.parametrize("entries,files,names,match", [
    ({"a": {"file_name": "a.json"}}, {"a.json": []}, ["b"], r"unknown SFT dataset\(s\) 'b'; .*defines 'a': use one of those names"),
    ({"a": {"file_name": "missing.json"}}, {}, ["a"], r"missing.json does not exist"),
    ({"a": {"hf_hub_url": "x/y"}}, {}, ["a"], r"no file_name \(it names hf_hub_url"),
    ({"a": {"file_name": "a.json"}}, {"a.json": [{"instruction": "q"}]}, ["a"], r"column 'output' is missing"),
    ({"a": {"file_name": "a.json", "formatting": "sharegpt"}}, {"a.json": [{"messages": []}]}, ["a"],
     r"column 'conversations' is missing"),
    ({"a": {"file_name": "a.json", "formatting": "sharegpt"}},
     {"a.json": [{"conversations": [{"from": "human", "value": "q"}, {"from": "bot", "value": "a"}]}]}, ["a"],
     r"unknown role 'bot'"),
    ({"a": {"file_name": "a.json", "formatting": "sharegpt"}},
     {"a.json": [{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"},
                                    {"from": "human", "value": "q2"}, {"from": "observation", "value": "o"},
                                    {"from": "gpt", "value": "a2"}]}]}, ["a"], r"a user message cannot be followed by a observation"),
    ({"a": {"file_name": "a.json", "formatting": "sharegpt"}},
     {"a.json": [{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"},
                                    {"from": "observation", "value": "o"}, {"from": "gpt", "value": "a2"},
                                    {"from": "human", "value": "q2"}, {"from": "gpt", "value": "a3"}]}]}, ["a"],
     r"observations are supported only in single-question"),
    ({"a": {"file_name": "a.json", "formatting": "sharegpt"}},
     {"a.json": [{"conversations": [{"from": "human", "value": "q"}]}]}, ["a"], r"must end with an assistant"),
    ({"a": {"file_name": "a.json", "formatting": "xml"}}, {"a.json": []}, ["a"], r"formatting 'xml'"),
    ({"a": {"file_name": "a.json", "columns": {"messages": "m"}}}, {"a.json": []}, ["a"],
     r"columns \['messages'\] do not apply to alpaca"),
])
def test_clear_errors(tok, tmp_path, entries, files, names, match):
    d = _write_info(tmp_path, entries, files)
    with pytest.raises(SFTDataError, match=match):
        load_sft_dataset(d, names, tok, max_length=4096)


def test_missing_dataset_info(tok, tmp_path):
    with pytest.raises(SFTDataError, match="dataset_info.json does not exist"):
        load_sft_dataset(str(tmp_path), ["a"], tok, max_length=10)


# ----------------------------------------------------------------------------------------------------------------
# the synthetic world's gold trajectories, end to end
# ----------------------------------------------------------------------------------------------------------------
def test_synthetic_world_gold_trajectories_load(tok, tmp_path):
    out = tmp_path / "world"
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "make_synthetic_world.py"), "--out-dir", str(out),
                    "--seed", "1", "--n-train", "60", "--n-validation", "10", "--n-test", "10", "--oracle", "bm25"],
                   check=True, capture_output=True, env={**os.environ, "PYTHONPATH": REPO})
    sft_dir = str(out / "sft")
    with open(os.path.join(sft_dir, "train.jsonl")) as f:
        trajs = [json.loads(line) for line in f]
    examples = load_sft_dataset(sft_dir, ["synthetic_sft_train"], tok, max_length=100_000)
    assert len(examples) == len(trajs) > 0 and examples.dropped_too_long == {"synthetic_sft_train": 0}
    for ex, traj in zip(examples, trajs):
        msgs = traj["messages"]
        n_prompt = 2 if msgs[0]["role"] == "system" else 1
        prompt_ids, response, mask = _rollout_stream(tok, msgs[:n_prompt], msgs[n_prompt:])
        assert ex.input_ids == prompt_ids + response and ex.loss_mask == [0] * len(prompt_ids) + mask
        masked, _ = _runs(ex.input_ids, ex.loss_mask, tok)
        assert masked == [m["content"] for m in msgs if m["role"] == "assistant"]
        assert masked[-1].endswith(f"<answer> {traj['answer']} </answer>")
        assert sum("<search>" in t for t in masked) == traj["hops"]
