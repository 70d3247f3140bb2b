"""RL prompt loading: render + tokenize once, drop (never cut) long prompts, unique group ids, resumable order."""
import re

import pytest

from megatron_searchr1.data import rl_data
from megatron_searchr1.data.prompts import render_prompt
from megatron_searchr1.data.qa import make_row, write_rows
from megatron_searchr1.data.rl_data import PromptSampler, dp_shard, load_prompts


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from megatron_searchr1.models.tiny import TinyModelConfig, train_tokenizer

    return train_tokenizer(TinyModelConfig(output_dir=str(tmp_path_factory.mktemp("tok")), vocab_size=400))


def test_load_prompts_renders_like_sft_and_drops_long_ones(tmp_path, tok):
    rows = [make_row("who founded acme", ["Bo"], "nq", "train", 0, uid="nq-train-0"),
            make_row("what is " + "very " * 400 + "long", ["x"], "nq", "train", 1, uid="nq-train-1"),
            make_row("when was bo born", ["1901"], "hotpotqa", "train", 0, uid="nq-train-0")]  # a colliding uid
    path = tmp_path / "train.parquet"
    write_rows(rows[:2], str(path))
    path2 = tmp_path / "train2.parquet"
    write_rows(rows[2:], str(path2))
    every, _ = load_prompts([str(path), str(path2)], tok, max_prompt_length=100_000)
    short, long = len(every[0].prompt_ids), len(every[1].prompt_ids)
    assert long > short + 300
    data, dropped = load_prompts([str(path), str(path2)], tok, max_prompt_length=short + 20)
    assert dropped == 1 and len(data) == 2
    assert data[0].prompt_ids == tok.encode(render_prompt(rows[0]["prompt"], tok), add_special_tokens=False)
    assert data[0].ground_truth == {"target": ["Bo"]} and data[0].question == "who founded acme?"
    assert len({d.uid for d in data}) == 2  # group ids stay unique across merged files
    raw, _ = load_prompts([str(path)], tok, max_prompt_length=10_000, chat_template="never")
    assert tok.decode(raw[0].prompt_ids).startswith("Answer the given question.")


def test_missing_columns_are_named(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["q"]}), str(tmp_path / "bad.parquet"))
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['prompt', 'data_source', 'reward_model'\]"):
        load_prompts([str(tmp_path / "bad.parquet")], tok, 100)


def test_sampler_epochs_and_cursor_replay():
    s = PromptSampler(10, 4, seed=3)
    seen = [s.next_batch() for _ in range(2)]
    assert len(set(seen[0] + seen[1])) == 8  # distinct within an epoch
    state = s.state_dict()
    after = [s.next_batch() for _ in range(3)]  # epochs 1 and 2 (each skips the tail of 2)
    assert s.epoch == 2
    t = PromptSampler(10, 4, seed=3)
    t.load_state_dict(state)
    assert [t.next_batch() for _ in range(3)] == after
    with pytest.raises(ValueError, match="same data.train_files"):
        PromptSampler(12, 4, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="lower it"):
        PromptSampler(3, 4, seed=0)


def test_dp_shard():
    assert dp_shard(list(range(6)), 0, 2) == [0, 1, 2]
    with pytest.raises(ValueError):
        dp_shard(list(range(5)), 0, 2)
    import doctest

    assert doctest.testmod(rl_data).failed == 0


def test_reports_count_rows_drops_and_the_longest_prompt_per_file(tmp_path, tok):
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    write_rows([make_row("who founded acme", ["Bo"], "nq", "train", i, uid=f"a-{i}") for i in range(3)]
               + [make_row("what is " + "very " * 200 + "long", ["x"], "nq", "train", 3, uid="a-3")], str(a))
    write_rows([make_row("when was bo born", ["1901"], "nq", "train", 0, uid="b-0")], str(b))
    lengths = {r.uid: len(r.prompt_ids) for r in load_prompts([str(a), str(b)], tok, 100_000)[0]}
    budget = lengths["a-0"] + 5
    reports = []
    data, dropped = load_prompts([str(a), str(b)], tok, budget, reports=reports)
    assert dropped == 1 and [r.uid for r in data] == ["a-0", "a-1", "a-2", "b-0"]
    ra, rb = reports
    assert (ra.path, ra.rows, ra.dropped, ra.used, ra.longest) == (str(a), 4, 1, 3, lengths["a-3"])
    assert (rb.rows, rb.dropped, rb.longest) == (1, 0, lengths["b-0"])
    assert ra.line() == (f"data: {a}: 4 rows, 1 dropped (1 longer than data.max_prompt_length={budget}; longest "
                         f"{lengths['a-3']} tokens), 3 used")
    assert rb.line() == f"data: {b}: 1 rows, 0 dropped, 1 used"
    limited = []
    load_prompts([str(a), str(b)], tok, budget, limit=2, reports=limited)
    assert [r.rows for r in limited] == [2, 1]  # validation samples: the first N rows of each file


def test_check_schema_reads_footers_and_names_the_field(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = tmp_path / "good.parquet"
    write_rows([make_row("q", ["a"], "nq", "train", i, uid=f"u{i}") for i in range(5)], str(good))
    assert rl_data.check_schema([str(good)]) == {str(good): 5}
    with pytest.raises(rl_data.DataError, match=r"data.val_files: .*/nope.parquet does not exist"):
        rl_data.check_schema([str(tmp_path / "nope.parquet")], "data.val_files")
    text = tmp_path / "text.parquet"
    text.write_text("not parquet")
    with pytest.raises(rl_data.DataError, match="is not a readable parquet file"):
        rl_data.check_schema([str(good), str(text)])
    no_gt = tmp_path / "no_gt.parquet"
    pq.write_table(pa.table({"prompt": ["p"], "data_source": ["nq"], "reward_model": [{"style": "rule"}]}), str(no_gt))
    with pytest.raises(rl_data.DataError, match="must be a struct with a ground_truth field"):
        rl_data.check_schema([str(no_gt)])


def test_plain_string_prompts_are_one_user_message_in_the_check_and_the_loader(tmp_path, tok):
    """A parquet whose `prompt` column holds plain strings passed the footer check and then failed in render_prompt
    (a ValueError 9 s into the run): the check reads the rows and the loader reads a string as one user message."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    chat = make_row("who founded acme", ["Bo"], "nq", "train", 0, uid="nq-train-0")
    text = chat["prompt"][0]["content"]
    path = tmp_path / "strings.parquet"
    pq.write_table(pa.table({"prompt": [text, "Question: when was bo born?\n"], "data_source": ["nq", "nq"],
                             "reward_model": [chat["reward_model"]] * 2}), str(path))
    assert rl_data.check_schema([str(path)], "data.train_files") == {str(path): 2}
    for mode in ("auto", "never"):
        data, dropped = load_prompts([str(path)], tok, max_prompt_length=10_000, chat_template=mode)
        assert dropped == 0 and len(data) == 2
        # exactly what the same text as a one-message chat list renders to (data/prompts.py's render_prompt)
        assert data[0].prompt_ids == tok.encode(render_prompt(chat["prompt"], tok, mode), add_special_tokens=False)
        assert data[1].prompt_ids == tok.encode(render_prompt([{"role": "user", "content": "Question: when was bo "
                                                                "born?\n"}], tok, mode), add_special_tokens=False)
    assert rl_data.read_rows([str(path)])[1]["prompt"] == [{"role": "user", "content": "Question: when was bo born?\n"}]


@pytest.mark.parametrize("prompts, shown", [
    ([[1, 2]], "a prompt that is [1, 2]"),
    ([7], "a prompt that is 7"),
    (["   "], "an empty prompt"),
    ([[]], "a prompt that is []"),
    ([None], "a prompt that is None"),
    ([[{"role": "user"}]], "a prompt that is [{'role': 'user'}]"),
])
def test_prompts_of_another_shape_are_refused_by_the_check_naming_the_row(tmp_path, tok, prompts, shown):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = make_row("q", ["a"], "nq", "train", 0, uid="u0")
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": prompts, "data_source": ["nq"], "reward_model": [good["reward_model"]]}),
                   str(path))
    with pytest.raises(rl_data.DataError, match=rf"data.train_files: {path}: row 0 has {re.escape(shown)}; "
                                                r"the prompt column must hold a list of chat messages"):
        rl_data.check_schema([str(path)], "data.train_files")
    with pytest.raises(rl_data.DataError, match="row 0 has"):
        load_prompts([str(path)], tok, 100)
