"""Tiny random chat models with a locally trained tokenizer: how every test and demo gets a real model with no hub.

`make_tiny_model(TinyModelConfig(...))` writes a Hugging Face checkpoint directory:
  tokenizer.json + tokenizer_config.json (+ chat template)   a byte-level BPE `transformers` fast tokenizer
  config.json + generation_config.json + model.safetensors   a randomly initialised Qwen2, Qwen3, Llama or Mistral
                                                             model, or a Qwen3-MoE / Qwen2-MoE mixture of experts

The tokenizer is trained on the given text files (or a small built-in English text) with the special tokens a chat
model needs: `<|endoftext|>` (pad, and bos for configs that want one), `<|im_start|>` / `<|im_end|>` (eos of a chat
turn, Qwen2 style). The Search-R1 tags (`<search>`, `</search>`, `<answer>`, ...) are added as single NORMAL tokens:
the policy must generate them and `decode(skip_special_tokens=True)` must keep them, but a single id per tag makes
stop conditions and a tiny model's job easier.

The command line is models/tiny_cli.py (`searchr1-make-tiny-model`, `tools/make_tiny_model.py`).
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from typing import Iterator, Sequence

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]
SEARCH_R1_TAGS = [
    "<think>", "</think>", "<search>", "</search>", "<information>", "</information>", "<answer>", "</answer>",
]

# Qwen2-style chat template: `<|im_start|>role\ncontent<|im_end|>\n` per message, then the assistant header.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM"}


@dataclass
class TinyModelConfig:
    """What `make_tiny_model` writes."""

    output_dir: str
    """Directory to create (tokenizer, config, generation config and safetensors weights)."""
    arch: str = "qwen2"
    """Model family: 'qwen2' (qkv bias), 'llama' (no bias), 'qwen3' (q/k norms, no bias) or 'mistral' (Llama layout,
    no sliding window)."""
    text_files: Sequence[str] = field(default_factory=list)
    """Plain-text files to train the BPE tokenizer on; empty = a small built-in English text."""
    vocab_size: int = 1000
    """Target BPE vocabulary size (the result can be smaller when the text is small)."""
    hidden_size: int = 128
    """Model width (with 4 heads: head_dim 32, the smallest vLLM's CPU attention accepts; 16 is rejected)."""
    intermediate_size: int = 256
    """MLP width (SwiGLU)."""
    num_layers: int = 2
    """Number of transformer layers."""
    num_heads: int = 4
    """Number of query heads."""
    num_kv_heads: int = 2
    """Number of key/value heads (GQA when smaller than num_heads)."""
    max_position_embeddings: int = 2048
    """Longest sequence the RoPE config claims to support."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the input embedding and the output layer (lm_head)."""
    init_std: float = 0.02
    """Std of the random weights (tests use a larger one so that a wrong weight mapping visibly moves the logits)."""
    seed: int = 0
    """Seed for the weights (the tokenizer training is deterministic)."""
    search_tags_as_tokens: bool = True
    """Add the Search-R1 tags as single (normal, non-special) tokens."""
    num_experts: int = 8
    """MoE archs (qwen3_moe, qwen2_moe): routed experts per layer."""
    experts_per_token: int = 2
    """MoE archs: experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 64
    """MoE archs: one routed expert's MLP width (qwen2_moe's shared expert is intermediate_size wide)."""

    def __post_init__(self):
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"arch={self.arch!r} is not supported; use one of {sorted(ARCHITECTURES)}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.hidden_size % self.num_heads != 0:
            raise ValueError(f"hidden_size={self.hidden_size} must be a multiple of num_heads={self.num_heads}")
        if (self.hidden_size // self.num_heads) % 2 != 0:
            raise ValueError("head_dim (hidden_size / num_heads) must be even for RoPE")
        if self.arch.endswith("_moe") and not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token={self.experts_per_token} must be between 1 and "
                             f"num_experts={self.num_experts}")
        for path in self.text_files:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"tokenizer text file {path!r} does not exist")


def builtin_corpus(n_sentences: int = 3000, seed: int = 0) -> list[str]:
    """A small deterministic English text: Search-R1 style turns and simple fact sentences.

    >>> builtin_corpus(2, seed=0) == builtin_corpus(2, seed=0)
    True
    """
    rng = random.Random(seed)
    subjects = ["the capital of france", "the author of hamlet", "the tallest mountain", "the largest ocean",
                "the first president", "the speed of light", "the river nile", "the city of tokyo",
                "the inventor of the telephone", "the moon", "water", "the country of japan", "a small cat"]
    verbs = ["is", "was", "has", "became", "remains", "was called", "is known as", "lies near"]
    objects = ["paris", "william shakespeare", "mount everest", "the pacific ocean", "george washington",
               "very fast", "in africa", "in asia", "alexander graham bell", "bright at night", "wet",
               "an island nation", "asleep on the sofa", "1879", "42", "the year 1066"]
    questions = ["who", "what", "where", "when", "which", "how many"]
    lines = []
    for _ in range(n_sentences):
        s, v, o = rng.choice(subjects), rng.choice(verbs), rng.choice(objects)
        kind = rng.random()
        if kind < 0.5:
            lines.append(f"{s.capitalize()} {v} {o}.")
        elif kind < 0.8:
            q = rng.choice(questions)
            lines.append(f"<think> I need to find {q} {s} {v}. </think> <search> {s} </search>")
        else:
            lines.append(f"<information> Doc 1 (Title: \"{s}\") {s} {v} {o}. </information> "
                         f"<answer> {o} </answer>")
    return lines


# Qwen2's pre-tokenization pattern (its tokenizer.json and `transformers`' Qwen2Tokenizer use this same regex).
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
               r"""\s+(?!\S)|\s+""")


def _iter_text(files: Sequence[str]) -> Iterator[str]:
    for path in files:
        with open(path, encoding="utf-8") as f:
            for line in f:
                yield line


def train_tokenizer(cfg: TinyModelConfig):
    """Train a byte-level BPE on the text; returns a `transformers` fast tokenizer with a chat template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Qwen2's own split (each digit alone, words with their leading space, ...) then byte-level, as Qwen2 models
    # ship. It must be the split the tokenizer is USED with: `transformers` 5 loads a qwen2 model's tokenizer as
    # Qwen2Tokenizer, which replaces tokenizer.json's pre-tokenizer by this one, so merges learnt under GPT-2's split
    # (" 2011" as one piece) never applied at run time and numbers came out as a lone space plus digits.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # The initial alphabet holds all 256 bytes, so any text (any language, any byte) is encodable.
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = list(_iter_text(cfg.text_files)) if cfg.text_files else builtin_corpus()
    tok.train_from_iterator(text, trainer=trainer)
    if cfg.search_tags_as_tokens:
        # normalized=False: match the raw text; special=False: kept by decode(skip_special_tokens=True).
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in SEARCH_R1_TAGS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=PAD_TOKEN, eos_token=IM_END, pad_token=PAD_TOKEN, unk_token=None,
        additional_special_tokens=[IM_START, IM_END], chat_template=CHAT_TEMPLATE, model_max_length=cfg.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )


def build_hf_config(cfg: TinyModelConfig, vocab_size: int, pad_id: int, eos_id: int):
    """The `transformers` config for the tiny model."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_std,
        hidden_act="silu", pad_token_id=pad_id, bos_token_id=pad_id, eos_token_id=eos_id, dtype="float32",
        architectures=[ARCHITECTURES[cfg.arch]],
    )
    if cfg.arch == "qwen2":
        return Qwen2Config(**common)
    moe = dict(num_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
               moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=True, router_aux_loss_coef=0.001)
    if cfg.arch == "qwen3_moe":
        return Qwen3MoeConfig(attention_bias=False, head_dim=cfg.hidden_size // cfg.num_heads, **moe, **common)
    if cfg.arch == "qwen2_moe":
        moe["norm_topk_prob"] = False  # Qwen1.5-MoE / Qwen2-57B-A14B keep the softmax over all experts
        return Qwen2MoeConfig(shared_expert_intermediate_size=cfg.intermediate_size, **moe, **common)
    if cfg.arch == "qwen3":
        return Qwen3Config(attention_bias=False, head_dim=cfg.hidden_size // cfg.num_heads, **common)
    if cfg.arch == "mistral":
        return MistralConfig(sliding_window=None, head_dim=cfg.hidden_size // cfg.num_heads, **common)
    return LlamaConfig(attention_bias=False, mlp_bias=False, head_dim=cfg.hidden_size // cfg.num_heads, **common)


def make_tiny_model(cfg: TinyModelConfig) -> str:
    """Write tokenizer + random model to `cfg.output_dir`; returns the directory."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    os.makedirs(cfg.output_dir, exist_ok=True)
    tokenizer = train_tokenizer(cfg)
    tokenizer.save_pretrained(cfg.output_dir)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    hf_config = build_hf_config(cfg, len(tokenizer), pad_id, eos_id)

    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    # transformers' own init uses initializer_range for linears/embeddings and ones for norms; we also randomise
    # the norm weights and biases (mildly) so that a mapping that mixes up two norms or drops a bias is visible.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.normal_(0.0, cfg.init_std)
    model.save_pretrained(cfg.output_dir)
    # Chat models stop at the end of a turn or at end-of-text.
    gen = GenerationConfig(bos_token_id=pad_id, eos_token_id=[eos_id, pad_id], pad_token_id=pad_id,
                           do_sample=True, temperature=1.0, top_p=1.0)
    gen.save_pretrained(cfg.output_dir)
    with open(os.path.join(cfg.output_dir, "tiny_model_args.json"), "w") as f:
        json.dump({k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in vars(cfg).items()}, f, indent=2)
    return cfg.output_dir
