"""LLaMA-Factory's chat templates by name: how an SFT conversation is rendered to text when `data.template` is set.

    render = template_renderer("qwen", tokenizer)
    render([{"role": "user", "content": "hi"}], True)
    # '<|im_start|>system\\nYou are Qwen, ...<|im_end|>\\n<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n'

`render(messages, add_generation_prompt)` is what data/sft_data.py's chat layout needs: the prompt before assistant
turn k is `render(messages[:k], True)`, the turn itself is what `render(messages[:k+1], False)` adds to it (the loss
covers that added text: the content and the template's end of turn, so the model learns to stop).

The four templates the study guide names (the strings are LLaMA-Factory's `register_template` formats):

    qwen3_nothink   the tokenizer's own chat template with enable_thinking=False (Qwen3-Instruct-2507's template
                    has no thinking block at all; a hybrid Qwen3 tokenizer gets its empty <think></think>)
    qwen            ChatML, default system "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    default         "Human: {user}<eos>\\nAssistant:" / "{assistant}<eos>\\n" / "System: {system}<eos>\\n"
    alpaca          "### Instruction:\\n{user}\\n\\n### Response:\\n" / "{assistant}<eos>\\n\\n", Alpaca's system line

Observation (tool) turns are refused by the caller: RL never sees a chat template's tool turn.
"""
from __future__ import annotations

from typing import Callable

TEMPLATES = ("qwen3_nothink", "qwen", "default", "alpaca")

# name -> (user format, assistant format, system format, default system); {eos} is the tokenizer's eos token
_FORMATS = {
    "qwen": ("<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n", "{content}<|im_end|>\n",
             "<|im_start|>system\n{content}<|im_end|>\n",
             "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
    "default": ("Human: {content}{eos}\nAssistant:", "{content}{eos}\n", "System: {content}{eos}\n", ""),
    "alpaca": ("### Instruction:\n{content}\n\n### Response:\n", "{content}{eos}\n\n", "{content}",
               "Below is an instruction that describes a task. Write a response that appropriately completes the "
               "request.\n\n"),
}

Render = Callable[[list, bool], str]


def template_renderer(name: str, tokenizer) -> Render:
    """`render(messages, add_generation_prompt) -> str` for a template name (ValueError naming the known ones)."""
    if name not in TEMPLATES:
        raise ValueError(f"template {name!r} is not known here: choose one of {', '.join(TEMPLATES)}")
    if name == "qwen3_nothink":
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("template qwen3_nothink renders with the tokenizer's chat template, and this tokenizer "
                             "has none: choose template qwen")

        def render_own(messages: list, add_generation_prompt: bool) -> str:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 tokenize=False, enable_thinking=False)
        return render_own
    user, assistant, system, default_system = _FORMATS[name]
    eos = tokenizer.eos_token or ""

    def render(messages: list, add_generation_prompt: bool) -> str:
        has_system = bool(messages) and messages[0]["role"] == "system"
        sys_text = messages[0]["content"] if has_system else default_system
        out = [system.format(content=sys_text, eos=eos)] if sys_text else []
        for m in messages[1:] if has_system else messages:
            fmt = user if m["role"] == "user" else assistant if m["role"] == "assistant" else None
            if fmt is None:
                raise ValueError(f"template {name}: a {m['role']} message has no format here")
            out.append(fmt.format(content=m["content"], eos=eos))
        return "".join(out)  # the user format ends with the assistant header: the generation prompt is built in
    return render
