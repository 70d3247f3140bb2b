"""Prompt templates and the tag vocabulary of the search loop.

Two templates:
- ``base``: Search-R1's ``make_prefix(template_type='base')`` word for word. Checkpoints trained by Search-R1 saw
  exactly this text as the raw prompt (no chat template), so keep it byte-identical, typo ("your want") included.
- ``chat``: the same instruction as a system message and ``Question: ...`` as the user message; the rollout renders
  it with the tokenizer's chat template (``render_prompt``).

The tags and the observation wrapper live here so that the rollout, the reward and the data generators agree on
one spelling.
"""
from __future__ import annotations

THINK_START, THINK_END = "<think>", "</think>"
SEARCH_START, SEARCH_END = "<search>", "</search>"
INFO_START, INFO_END = "<information>", "</information>"
ANSWER_START, ANSWER_END = "<answer>", "</answer>"

# Generation stops at these: a turn ends either with a query to run or with the final answer.
STOP_STRINGS = (SEARCH_END, ANSWER_END)

TEMPLATES = ("base", "chat", "short")

# Search-R1's instruction; `base` appends " Question: {question}\n" to it (see make_prefix).
INSTRUCTION = (
    "Answer the given question. "
    "You must conduct reasoning inside <think> and </think> first every time you get new information. "
    "After reasoning, if you find you lack some knowledge, you can call a search engine by <search> query </search> "
    "and it will return the top searched results between <information> and </information>. "
    "You can search as many times as your want. "
    "If you find no further external knowledge needed, you can directly provide the answer inside <answer> and "
    "</answer>, without detailed illustrations. For example, <answer> Beijing </answer>."
)

# A ~30-token version of the same protocol for tiny models trained from scratch (the CPU demo): the long instruction
# is a third of every SFT example's tokens, and a model that has never seen English gains nothing from it.
SHORT_INSTRUCTION = (
    "Answer the question. Think in <think> </think>, search with <search> query </search>, read results in "
    "<information> </information>, answer in <answer> </answer>."
)

# Search-R1 tells the model this when a turn has neither a query nor an answer.
INVALID_ACTION_FEEDBACK = (
    "\nMy previous action is invalid. "
    "If I want to search, I should put the query between <search> and </search>. "
    "If I want to give the final answer, I should put the answer between <answer> and </answer>. Let me try again.\n"
)


def normalize_question(question: str) -> str:
    """Strip and end with '?', as Search-R1's data scripts do.

    >>> normalize_question("  who wrote dune ")
    'who wrote dune?'
    >>> normalize_question("Who wrote Dune?")
    'Who wrote Dune?'
    """
    q = question.strip()
    if not q:
        raise ValueError("empty question")
    return q if q.endswith("?") else q + "?"


def make_prefix(question: str) -> str:
    """Search-R1's base prompt for a (normalised) question.

    >>> make_prefix("Who wrote Dune?").endswith("<answer> Beijing </answer>. Question: Who wrote Dune?\\n")
    True
    """
    return f"{INSTRUCTION} Question: {question}\n"


def make_prompt(question: str, template: str = "base") -> list[dict]:
    """The `prompt` column of one parquet row: a list of chat messages.

    base: one user message holding the whole Search-R1 prefix (render it raw, without a chat template).
    chat: a system message with the instruction and a user message with the question.
    short: one user message with SHORT_INSTRUCTION (tiny models trained from scratch, the CPU demo).
    """
    if template == "base":
        return [{"role": "user", "content": make_prefix(question)}]
    if template == "chat":
        return [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": f"Question: {question}"}]
    if template == "short":
        return [{"role": "user", "content": f"{SHORT_INSTRUCTION} Question: {question}\n"}]
    raise ValueError(f"unknown prompt template {template!r}; choose one of {TEMPLATES}")


CHAT_TEMPLATE_MODES = ("auto", "always", "never")


def render_prompt(messages: list[dict], tokenizer=None, chat_template: str = "auto") -> str:
    """Text the policy sees first; the rollout and the SFT data both call this, so they agree byte for byte.

    chat_template:
    - ``auto`` (Search-R1's rule): the tokenizer's chat template, with a generation prompt, when it has one
      (instruct models see their own turn markers around the whole Search-R1 prefix); the raw text of a single
      user message otherwise (base models, or no tokenizer given);
    - ``always``: the chat template, an error when the tokenizer has none;
    - ``never``: the raw text of a single user message (the `base` template, Search-R1 with a base model).
    Templates that reject a system role (Gemma-style) get the system text folded into the first user message.
    """
    if chat_template not in CHAT_TEMPLATE_MODES:
        raise ValueError(f"chat_template must be one of {CHAT_TEMPLATE_MODES}, got {chat_template!r}")
    messages = [dict(m) for m in messages]
    has_template = tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
    single_user = len(messages) == 1 and messages[0]["role"] == "user"
    if chat_template == "never" or (chat_template == "auto" and not has_template):
        if single_user:
            return messages[0]["content"]
        raise ValueError(
            "chat-template prompts (system + user messages) need a tokenizer with a chat_template; prepare the data "
            "with --template base for base models"
        )
    if not has_template:
        raise ValueError("chat_template='always' but the tokenizer has no chat_template: use 'auto' or 'never'")
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as err:  # jinja raises a TemplateError subclass for "System role not supported"
        if messages[0]["role"] != "system" or "system" not in str(err).lower():
            raise
        folded = [{"role": "user", "content": messages[0]["content"] + "\n\n" + messages[1]["content"]}] + messages[2:]
        return tokenizer.apply_chat_template(folded, add_generation_prompt=True, tokenize=False)


def format_observation(docs_text: str) -> str:
    """Wrap retrieved text the way Search-R1 appends it after a `</search>` turn.

    >>> format_observation("Doc 1(Title: A) a\\n")
    '\\n\\n<information>Doc 1(Title: A) a</information>\\n\\n'
    """
    return f"\n\n{INFO_START}{docs_text.strip()}{INFO_END}\n\n"


def search_turn(thought: str, query: str) -> str:
    """An assistant turn that reasons and then searches (what the oracle writes and the policy should learn)."""
    return f"{THINK_START} {thought} {THINK_END}\n{SEARCH_START} {query} {SEARCH_END}"


def answer_turn(thought: str, answer: str) -> str:
    """An assistant turn that reasons and then answers."""
    return f"{THINK_START} {thought} {THINK_END}\n{ANSWER_START} {answer} {ANSWER_END}"
