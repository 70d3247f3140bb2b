"""Prompt templates: Search-R1's base prompt byte for byte, the chat variant through a real chat template."""
import pytest

from megatron_searchr1.data import prompts

# Search-R1 scripts/data_process/nq_search.py, make_prefix(template_type='base'), as its checkpoints saw it.
SEARCH_R1_BASE = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get "
    "new information. After reasoning, if you find you lack some knowledge, you can call a search engine by "
    "<search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as your want. If you find no further external knowledge needed, "
    "you can directly provide the answer inside <answer> and </answer>, without detailed illustrations. For "
    "example, <answer> Beijing </answer>. Question: {question}\n"
)


def test_base_prompt_is_search_r1_verbatim():
    assert prompts.make_prefix("Who wrote Dune?") == SEARCH_R1_BASE.format(question="Who wrote Dune?")
    msgs = prompts.make_prompt(prompts.normalize_question("  who wrote dune "), "base")
    assert msgs == [{"role": "user", "content": SEARCH_R1_BASE.format(question="who wrote dune?")}]
    assert prompts.render_prompt(msgs) == msgs[0]["content"]  # base prompts are used raw, no chat template


def test_normalize_question_rejects_empty():
    with pytest.raises(ValueError):
        prompts.normalize_question("   ")


def _tokenizer(chat_template):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    hf.chat_template = chat_template
    return hf


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NO_SYSTEM = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
             "{% endif %}<turn>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
             "{% if add_generation_prompt %}<turn>model: {% endif %}")


def test_chat_prompt_renders_through_the_tokenizer_template():
    msgs = prompts.make_prompt("Who wrote Dune?", "chat")
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert msgs[0]["content"] == prompts.INSTRUCTION
    assert prompts.make_prefix("Q?").startswith(prompts.INSTRUCTION)
    text = prompts.render_prompt(msgs, _tokenizer(CHATML))
    assert text == (f"<|im_start|>system\n{prompts.INSTRUCTION}<|im_end|>\n"
                    "<|im_start|>user\nQuestion: Who wrote Dune?<|im_end|>\n<|im_start|>assistant\n")
    # a template without a system role gets the instruction folded into the user turn
    text = prompts.render_prompt(msgs, _tokenizer(NO_SYSTEM))
    assert text == f"<turn>user: {prompts.INSTRUCTION}\n\nQuestion: Who wrote Dune?\n<turn>model: "
    with pytest.raises(ValueError, match="chat_template"):
        prompts.render_prompt(msgs, None)
    with pytest.raises(ValueError, match="unknown prompt template"):
        prompts.make_prompt("Q?", "llama")


def test_turn_helpers_and_observation_use_the_tags():
    assert prompts.search_turn("t", "q") == "<think> t </think>\n<search> q </search>"
    assert prompts.answer_turn("t", "a") == "<think> t </think>\n<answer> a </answer>"
    # Search-R1 strips the formatted docs before wrapping them
    assert prompts.format_observation("Doc 1(Title: x) y\n") == "\n\n<information>Doc 1(Title: x) y</information>\n\n"
    assert prompts.STOP_STRINGS == ("</search>", "</answer>")


def test_doctests():
    import doctest

    assert doctest.testmod(prompts).failed == 0


def test_base_prompt_follows_search_r1s_chat_template_rule():
    msgs = prompts.make_prompt("Who wrote Dune?", "base")
    tok = _tokenizer(CHATML)
    # auto: a tokenizer with a chat template wraps the whole prefix in it, as Search-R1 does for instruct models
    assert prompts.render_prompt(msgs, tok) == f"<|im_start|>user\n{msgs[0]['content']}<|im_end|>\n<|im_start|>assistant\n"
    assert prompts.render_prompt(msgs, tok, chat_template="never") == msgs[0]["content"]
    assert prompts.render_prompt(msgs, None, chat_template="auto") == msgs[0]["content"]
    with pytest.raises(ValueError, match="has no chat_template"):
        prompts.render_prompt(msgs, None, chat_template="always")
    with pytest.raises(ValueError, match="must be one of"):
        prompts.render_prompt(msgs, tok, chat_template="sometimes")


def test_short_template_keeps_the_protocol_tags():
    (msg,) = prompts.make_prompt("Who wrote Dune?", "short")
    for tag in ("<think>", "<search>", "</search>", "<information>", "<answer>", "</answer>"):
        assert tag in msg["content"]
    assert msg["content"].endswith("Question: Who wrote Dune?\n")
    assert len(msg["content"].split()) < len(prompts.INSTRUCTION.split()) / 2
