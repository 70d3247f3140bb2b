"""RL prompts: Search-R1 parquet rows -> tokenized prompts, batches sharded over DP ranks, a resumable cursor.

    data = load_prompts(["data/synthetic/train.parquet"], tokenizer, max_prompt_length=512)
    sampler = PromptSampler(len(data), batch_size=8, seed=1)
    for step in ...: rows = [data[i] for i in sampler.next_batch()]     # the same global batch on every rank
    mine = dp_shard(rows, dp_rank, dp_size)                              # whole prompts: GRPO groups stay on one rank

A row keeps what the reward and the logs need: `data_source`, `ground_truth` (`{"target": [...]}`), `uid`
(`extra_info.uid`, unique per prompt across merged datasets: the GRPO group id) and the question. Prompts are
rendered with `data.prompts.render_prompt` (the same call the SFT data makes) and tokenized once here; a prompt
longer than `max_prompt_length` is dropped and counted, never cut (Search-R1 keeps only the rightmost tokens,
which can drop the question).

The `prompt` column holds a list of chat messages (`[{"role": "user", "content": ...}]`, what the data tools write)
or a plain string, which is read as one user message: `prompt_messages` turns either into messages, and
`check_schema` refuses any other shape, so the check and the loader agree on what a row may hold.

`check_schema` reads the parquet footers and two columns (no torch), so a run can refuse a missing, unreadable,
empty or schema-less file in a second, before any model is built; `load_prompts(..., reports=[])` says per file
how many rows it read, how many it dropped and why.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from megatron_searchr1.data.prompts import render_prompt
from megatron_searchr1.data.qa import plain


class DataError(ValueError):
    """A data file that cannot feed a run (missing, not a parquet, wrong schema, no usable row); the message names
    the file and what to change."""


REQUIRED_COLUMNS = ("prompt", "data_source", "reward_model")
PROMPT_SHAPE = ('a list of chat messages [{"role": "user", "content": "..."}] (tools/prepare_qa_data.py writes '
                'them) or a plain string (one user message)')


def prompt_messages(prompt) -> list[dict]:
    """The chat messages of one row's `prompt` value: a plain string is one user message; a list of
    {"role", "content"} dicts is kept. Any other shape raises DataError (without the file name: the caller adds it).

    >>> prompt_messages("Question: who wrote Dune?")
    [{'role': 'user', 'content': 'Question: who wrote Dune?'}]
    >>> prompt_messages([{"role": "user", "content": "q"}])
    [{'role': 'user', 'content': 'q'}]
    """
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError("an empty prompt")
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, (list, tuple)) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt):
        return [dict(m) for m in prompt]
    shown = repr(prompt)
    raise DataError(f"a prompt that is {shown[:80] + '...' if len(shown) > 80 else shown}")


def _check_prompts(path: str, what: str, hint: str) -> None:
    """Read the `prompt` column and refuse the first row whose value `prompt_messages` cannot read."""
    import pyarrow.parquet as pq

    for i, value in enumerate(pq.read_table(path, columns=["prompt"]).column(0).to_pylist()):
        try:
            prompt_messages(value)
        except DataError as e:
            raise DataError(f"{what}: {path}: row {i} has {e}; the prompt column must hold {PROMPT_SHAPE}: "
                            f"{hint}") from None


def unscored_sources(sources) -> list:
    """The values of `sources` that the reward registry (megatron_searchr1/reward) has no scorer for, sorted."""
    from megatron_searchr1.reward import get_reward_fn

    unknown = []
    for source in sources:
        try:
            get_reward_fn(source if isinstance(source, str) else "")
        except ValueError:
            unknown.append(source)
    return sorted(unknown, key=str)


def known_sources() -> str:
    """The data_source names with a reward, as the reward registry lists them."""
    from megatron_searchr1.reward import QA_SOURCES

    return ", ".join(QA_SOURCES) + ", synthetic, synthetic_<h>hop"


def check_schema(paths: list[str], what: str = "data file") -> dict[str, int]:
    """{path: number of rows} of Search-R1-style parquet files, from their footers and two columns; a DataError names
    the first file that is missing, unreadable, lacks a required column (or `reward_model.ground_truth`), has no row,
    has a prompt `prompt_messages` cannot read (the `prompt` column is read) or has a data_source the reward registry
    cannot score (that column is read too).
    `what` names the config field in the message (e.g. "data.train_files")."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    hint = "tools/prepare_qa_data.py or tools/make_synthetic_world.py write Search-R1's parquet schema"
    counts = {}
    for path in paths:
        try:
            meta = pq.ParquetFile(path)
        except FileNotFoundError:
            raise DataError(f"{what}: {path} does not exist") from None
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"{what}: {path} is not a readable parquet file ({e}): {hint}") from None
        schema = meta.schema_arrow
        missing = [c for c in REQUIRED_COLUMNS if c not in schema.names]
        if missing:
            raise DataError(f"{what}: {path} lacks column(s) {missing}: {hint}")
        reward = schema.field("reward_model").type
        if not pa.types.is_struct(reward) or reward.get_field_index("ground_truth") < 0:
            raise DataError(f"{what}: {path}: column reward_model must be a struct with a ground_truth field "
                            f"({{'ground_truth': {{'target': [answers]}}}}), got {reward}: {hint}")
        if meta.metadata.num_rows == 0:
            raise DataError(f"{what}: {path} has no rows")
        _check_prompts(path, what, hint)
        unknown = unscored_sources(pq.read_table(path, columns=["data_source"]).column(0).unique().to_pylist())
        if unknown:  # else every rank fails in its first reward, after the models and the engine are built
            raise DataError(f"{what}: {path}: no reward for data_source {', '.join(map(repr, unknown))}; "
                            f"known: {known_sources()}: name each input after a known source in "
                            f"tools/prepare_qa_data.py (--train nq=PATH), or add a scorer in megatron_searchr1/reward")
        counts[path] = meta.metadata.num_rows
    return counts


@dataclass
class FileReport:
    """What `load_prompts` made of one file: rows read, dropped for length (and the longest prompt), used."""

    path: str
    rows: int
    dropped: int
    longest: int
    max_prompt_length: int

    @property
    def used(self) -> int:
        return self.rows - self.dropped

    def line(self) -> str:
        why = (f" ({self.dropped} longer than data.max_prompt_length={self.max_prompt_length}; longest "
               f"{self.longest} tokens)" if self.dropped else "")
        return f"data: {self.path}: {self.rows} rows, {self.dropped} dropped{why}, {self.used} used"


@dataclass
class PromptRow:
    """One prompt, ready for the rollout."""

    prompt_ids: list[int]
    uid: str
    data_source: str
    ground_truth: dict
    """Search-R1's `reward_model.ground_truth`: {"target": [answers...]}."""
    question: str = ""
    extra: dict = field(default_factory=dict)
    """`extra_info` minus what is above (hops, chain for the synthetic world)."""


def read_rows(paths: list[str]) -> list[dict]:
    """All rows of the parquet files, in order, as plain python (lists, dicts); `prompt` as chat messages."""
    import pyarrow.parquet as pq

    rows = []
    for path in paths:
        check_schema([path])
        for r in pq.read_table(path).to_pylist():
            r = plain(r)
            r["prompt"] = prompt_messages(r["prompt"])  # a plain string becomes one user message
            rows.append(r)
    return rows


def load_prompts(paths: list[str], tokenizer, max_prompt_length: int, chat_template: str = "auto",
                 limit: int | None = None, reports: list | None = None, render=None) -> tuple[list[PromptRow], int]:
    """(prompt rows, number dropped for being longer than max_prompt_length); `limit`: the first N rows of EACH file
    (validation on a sample of every split); `reports`: a list that receives one FileReport per file; `render`:
    messages -> prompt text instead of render_prompt (the tool_calls protocol renders the tools' schemas too)."""
    out, dropped = [], 0
    seen: set[str] = set()
    i = 0
    for path in paths:
        rows = read_rows([path])[:limit] if limit is not None else read_rows([path])
        report = FileReport(path, rows=len(rows), dropped=0, longest=0, max_prompt_length=max_prompt_length)
        for row in rows:
            extra = dict(row.get("extra_info") or {})
            uid = str(extra.pop("uid", "") or f"{row['data_source']}-{extra.get('split', '')}-{extra.get('index', i)}")
            if uid in seen:  # merged datasets with restarting indexes (Search-R1's bug): make the group id unique
                uid = f"{uid}#{i}"
            seen.add(uid)
            i += 1
            text = render(row["prompt"]) if render is not None else render_prompt(row["prompt"], tokenizer, chat_template)
            ids = tokenizer.encode(text, add_special_tokens=False)
            report.longest = max(report.longest, len(ids))
            if len(ids) > max_prompt_length:
                report.dropped += 1
                continue
            out.append(PromptRow(prompt_ids=ids, uid=uid, data_source=row["data_source"],
                                 ground_truth=row["reward_model"]["ground_truth"], question=extra.pop("question", ""),
                                 extra=extra))
        dropped += report.dropped
        if reports is not None:
            reports.append(report)
    return out, dropped


class PromptSampler:
    """Epochs of seeded shuffles over `n` prompts, `batch_size` at a time; `state_dict()` is the data cursor.

    A batch never wraps into the next epoch (the tail that does not fill a batch is skipped, as drop_last does),
    so every step sees `batch_size` distinct prompts and resuming from a cursor replays exactly the same order.
    """

    def __init__(self, n: int, batch_size: int, seed: int, shuffle: bool = True):
        if n < batch_size:
            raise ValueError(f"{n} prompts cannot fill one batch of data.train_batch_size={batch_size}: lower it")
        self.n, self.batch_size, self.seed, self.shuffle = n, batch_size, seed, shuffle
        self.epoch, self.pos = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(self.n))
        if self.shuffle:
            random.Random(self.seed * 100003 + self.epoch).shuffle(order)
        return order

    def next_batch(self) -> list[int]:
        if self.pos + self.batch_size > self.n:
            self.epoch, self.pos = self.epoch + 1, 0
            self._order = self._make_order()
        batch = self._order[self.pos: self.pos + self.batch_size]
        self.pos += self.batch_size
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "n": self.n, "batch_size": self.batch_size, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if (state["n"], state["batch_size"]) != (self.n, self.batch_size):
            raise ValueError(f"the checkpoint's data cursor is for {state['n']} prompts in batches of "
                             f"{state['batch_size']}, this run has {self.n} / {self.batch_size}: resume with the same "
                             "data.train_files and data.train_batch_size")
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._order = self._make_order()


def dp_shard(items: list, dp_rank: int, dp_size: int) -> list:
    """This DP rank's contiguous slice (whole prompts, so a GRPO group never spans ranks).

    >>> dp_shard(list(range(8)), 1, 4)
    [2, 3]
    """
    if len(items) % dp_size:
        raise ValueError(f"{len(items)} items do not split evenly over {dp_size} DP ranks")
    k = len(items) // dp_size
    return items[dp_rank * k: (dp_rank + 1) * k]
