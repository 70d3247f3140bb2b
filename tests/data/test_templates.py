"""LLaMA-Factory templates (data/templates.py) through the SFT loader: the text each template renders, and the loss
mask on exactly the assistant's content plus the template's end of turn (so the model learns to stop)."""
import json

import pytest

from megatron_searchr1.data.sft_data import SFTDataError, load_sft_dataset
from megatron_searchr1.data.templates import template_renderer
from megatron_searchr1.models.tiny import TinyModelConfig, train_tokenizer
from tests.data.test_sft_data import _runs

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who are you?"},
        {"role": "assistant", "content": "I am tiny."}, {"role": "user", "content": "And?"},
        {"role": "assistant", "content": "That is all."}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_tokenizer(TinyModelConfig(output_dir=str(tmp_path_factory.mktemp("tok"))))


def test_string_templates_render_llama_factory_formats(tok):
    eos = tok.eos_token
    qwen = template_renderer("qwen", tok)
    assert qwen(CHAT[1:2], True) == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                                     "assistant.<|im_end|>\n<|im_start|>user\nWho are you?<|im_end|>\n"
                                     "<|im_start|>assistant\n")
    assert qwen(CHAT[:3], False).endswith("<|im_start|>assistant\nI am tiny.<|im_end|>\n")
    assert qwen(CHAT[:3], False).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    default = template_renderer("default", tok)(CHAT[1:3], False)
    assert default == f"Human: Who are you?{eos}\nAssistant:I am tiny.{eos}\n"
    alpaca = template_renderer("alpaca", tok)(CHAT[1:3], False)
    assert alpaca.startswith("Below is an instruction that describes a task.")
    assert alpaca.endswith(f"### Instruction:\nWho are you?\n\n### Response:\nI am tiny.{eos}\n\n")
    # qwen3_nothink is the tokenizer's own template (this one has no thinking block)
    assert template_renderer("qwen3_nothink", tok)(CHAT, False) == tok.apply_chat_template(CHAT, tokenize=False)


def test_unknown_template_is_refused_with_the_list(tok):
    with pytest.raises(ValueError, match="qwen3_nothink, qwen, default, alpaca"):
        template_renderer("llama3", tok)


@pytest.mark.parametrize("template,end", [("qwen", "<|im_end|>\n"), ("alpaca", "EOS\n\n"), ("default", "EOS\n"),
                                          ("qwen3_nothink", "<|im_end|>\n")])
def test_loss_mask_covers_each_answer_and_its_end_of_turn(tok, tmp_path, template, end):
    end = end.replace("EOS", tok.eos_token)
    (tmp_path / "a.json").write_text(json.dumps([{"instruction": "Say hi.", "input": "", "output": "hi there"}]))
    (tmp_path / "c.json").write_text(json.dumps([{"conversations": [
        {"from": "human", "value": m["content"]} if m["role"] == "user" else {"from": "gpt", "value": m["content"]}
        for m in CHAT[1:]], "system": "Be brief."}]))
    (tmp_path / "dataset_info.json").write_text(json.dumps({
        "a": {"file_name": "a.json"},
        "c": {"file_name": "c.json", "formatting": "sharegpt", "columns": {"messages": "conversations",
                                                                          "system": "system"}}}))
    data = load_sft_dataset(str(tmp_path), ["a", "c"], tok, 1024, template=template)
    masked, _ = _runs(data[0].input_ids, data[0].loss_mask, tok)
    assert "".join(masked).replace(" ", "") == ("hi there" + end).replace(" ", "")
    masked, unmasked = _runs(data[1].input_ids, data[1].loss_mask, tok)
    assert [m.replace(" ", "") for m in masked] == [(t + end).replace(" ", "") for t in ("I am tiny.", "That is all.")]
    assert "Be brief." in "".join(unmasked) and "And?" in "".join(unmasked)


def test_max_samples_reads_the_first_records_and_templates_refuse_observations(tok, tmp_path):
    rows = [{"instruction": f"q{i}", "input": "", "output": f"a{i}"} for i in range(5)]
    (tmp_path / "a.json").write_text(json.dumps(rows))
    (tmp_path / "o.json").write_text(json.dumps([{"conversations": [
        {"from": "human", "value": "q"}, {"from": "gpt", "value": "<search>x</search>"},
        {"from": "observation", "value": "info"}, {"from": "gpt", "value": "a"}]}]))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"a": {"file_name": "a.json"},
                                                            "o": {"file_name": "o.json", "formatting": "sharegpt"}}))
    data = load_sft_dataset(str(tmp_path), ["a"], tok, 1024, template="qwen", max_samples=2)
    assert [ex.source for ex in data] == ["a:0", "a:1"]
    with pytest.raises(SFTDataError, match="observation"):
        load_sft_dataset(str(tmp_path), ["o"], tok, 1024, template="qwen")
