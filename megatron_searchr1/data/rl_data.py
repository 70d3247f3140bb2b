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
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from megatron_searchr1.data.prompts import render_prompt
from megatron_searchr1.data.qa import plain


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
    """All rows of the parquet files, in order, as plain python (lists, dicts)."""
    import pyarrow.parquet as pq

    rows = []
    for path in paths:
        table = pq.read_table(path)
        missing = [c for c in ("prompt", "data_source", "reward_model") if c not in table.column_names]
        if missing:
            raise ValueError(f"{path} lacks column(s) {missing}: expected Search-R1's parquet schema "
                             "(tools/prepare_qa_data.py or tools/make_synthetic_world.py write it)")
        rows += [plain(r) for r in table.to_pylist()]
    return rows


def load_prompts(paths: list[str], tokenizer, max_prompt_length: int, chat_template: str = "auto",
                 limit: int | None = None) -> tuple[list[PromptRow], int]:
    """(prompt rows, number dropped for being longer than max_prompt_length); `limit`: the first N rows of EACH file
    (validation on a sample of every split)."""
    out, dropped = [], 0
    seen: set[str] = set()
    rows = [r for path in paths for r in read_rows([path])[:limit]] if limit is not None else read_rows(paths)
    for i, row in enumerate(rows):
        extra = dict(row.get("extra_info") or {})
        uid = str(extra.pop("uid", "") or f"{row['data_source']}-{extra.get('split', '')}-{extra.get('index', i)}")
        if uid in seen:  # merged datasets with restarting indexes (Search-R1's bug): make the group id unique
            uid = f"{uid}#{i}"
        seen.add(uid)
        ids = tokenizer.encode(render_prompt(row["prompt"], tokenizer, chat_template), add_special_tokens=False)
        if len(ids) > max_prompt_length:
            dropped += 1
            continue
        out.append(PromptRow(prompt_ids=ids, uid=uid, data_source=row["data_source"],
                             ground_truth=row["reward_model"]["ground_truth"], question=extra.pop("question", ""),
                             extra=extra))
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
