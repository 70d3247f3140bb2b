"""Tests for megatron_searchr1/models/tiny.py: the tokenizer, chat template and random model it writes."""
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_searchr1.models.tiny import SEARCH_R1_TAGS, TinyModelConfig, make_tiny_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("text") / "corpus.txt"
    corpus.write_text("The quick brown fox jumps over the lazy dog.\n" * 50 + "Paris is the capital of France.\n" * 50)
    out = str(tmp_path_factory.mktemp("tiny") / "qwen2")
    make_tiny_model(TinyModelConfig(output_dir=out, arch="qwen2", text_files=[str(corpus)], vocab_size=400))
    return out


def test_tokenizer_round_trip_and_tags(qwen_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen_dir)
    for text in ["The quick brown fox.", "Ünïcödé 日本語 and emoji 🙂", "  two  spaces\nnewline\t tab"]:
        assert tok.decode(tok.encode(text)) == text
    # trained on the file: a frequent word is one or two tokens, not bytes
    assert len(tok.encode("quick")) <= 2
    for tag in SEARCH_R1_TAGS:  # one normal token each, kept by skip_special_tokens
        ids = tok.encode(tag)
        assert len(ids) == 1, tag
    text = "<search> capital </search><|im_end|>"
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == "<search> capital </search>"
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    assert tok.convert_tokens_to_ids("<|im_start|>") != tok.unk_token_id


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_transformers_tokenizes_with_the_split_the_bpe_was_trained_with(arch, tmp_path):
    """`transformers` 5 loads a qwen2 tokenizer as Qwen2Tokenizer with Qwen2's own pre-tokenizer: merges learnt
    under any other split would silently never apply (" 1949" came out as a lone space and four digits)."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Ada was born in 1949. Bo was born in 1951.\n" * 200)
    out = str(tmp_path / arch)
    make_tiny_model(TinyModelConfig(output_dir=out, arch=arch, text_files=[str(corpus)], vocab_size=300,
                                    hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2, num_kv_heads=1))
    tok, raw = AutoTokenizer.from_pretrained(out), Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    text = "In which year was Ada born? <think> born in 1949. </think>\n<answer> 1949 </answer>  x"
    assert tok(text, add_special_tokens=False)["input_ids"] == raw.encode(text, add_special_tokens=False).ids
    assert len(tok.encode(" born", add_special_tokens=False)) == 1  # the trained merges are the ones applied


def test_chat_template_renders(qwen_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen_dir)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCapital of France?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_model_loads_and_generates(qwen_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(qwen_dir)
    model = AutoModelForCausalLM.from_pretrained(qwen_dir)
    cfg = json.load(open(os.path.join(qwen_dir, "config.json")))
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["vocab_size"] == len(tok)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    gen = GenerationConfig.from_pretrained(qwen_dir)
    assert tok.convert_tokens_to_ids("<|im_end|>") in gen.eos_token_id
    ids = torch.tensor([tok.encode("Paris is")])
    out = model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert out.shape == (1, ids.shape[1] + 4)


def test_cli_llama_tied_is_deterministic(tmp_path):
    args = ["--arch", "llama", "--tie-embeddings", "--hidden-size", "32", "--num-heads", "4", "--num-kv-heads", "1",
            "--num-layers", "1", "--seed", "3", "--vocab-size", "300"]
    for name in ("a", "b"):
        subprocess.run([sys.executable, os.path.join(REPO, "tools", "make_tiny_model.py"),
                        "--output-dir", str(tmp_path / name), *args], check=True, cwd=REPO, capture_output=True)
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert "lm_head.weight" not in a and set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "a"))
    assert model.config.tie_word_embeddings and model.config.num_key_value_heads == 1
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_bad_config_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        TinyModelConfig(output_dir=str(tmp_path), num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="not supported"):
        TinyModelConfig(output_dir=str(tmp_path), arch="gpt2")
    with pytest.raises(FileNotFoundError):
        TinyModelConfig(output_dir=str(tmp_path), text_files=[str(tmp_path / "missing.txt")])


def test_cli_refuses_a_non_empty_output_dir_without_overwrite(tmp_path):
    from megatron_searchr1.cli import UsageError
    from megatron_searchr1.models.tiny_cli import parse_args

    (tmp_path / "old.txt").write_text("an earlier model")
    with pytest.raises(UsageError, match="is not empty: pass --overwrite"):
        parse_args(["--output-dir", str(tmp_path)])
    assert parse_args(["--output-dir", str(tmp_path), "--overwrite"]).output_dir == str(tmp_path)
    assert parse_args(["--output-dir", str(tmp_path / "new")]).output_dir == str(tmp_path / "new")
    with pytest.raises(UsageError, match=r"hidden_size=30 must be a multiple of num_heads=4 \(--hidden-size"):
        parse_args(["--output-dir", str(tmp_path / "new"), "--hidden-size", "30"])
