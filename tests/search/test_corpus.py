"""Corpus reading: both row formats, Search-R1's title/text split, errors with line numbers, the lazy reader."""
import json

import pytest

from megatron_searchr1.search.corpus import (JsonlCorpus, load_corpus, make_contents, open_corpus, split_contents,
                                             write_corpus)


def _write(path, lines):
    path.write_bytes("".join(lines).encode("utf-8"))
    return path


def test_both_formats_give_id_title_text_contents(tmp_path):
    p = _write(tmp_path / "c.jsonl", [
        json.dumps({"id": "0", "contents": '"Paris"\nParis is the capital.\nIt is on the Seine.'}) + "\n",
        json.dumps({"id": 7, "title": "Oslo", "text": "Capital of Norway."}) + "\n",
        json.dumps({"contents": "No quotes title\nbody"}) + "\n",
    ])
    docs = load_corpus(p)
    assert docs[0] == {"id": "0", "title": "Paris", "text": "Paris is the capital.\nIt is on the Seine.",
                       "contents": '"Paris"\nParis is the capital.\nIt is on the Seine.'}
    assert docs[1] == {"id": "7", "title": "Oslo", "text": "Capital of Norway.",
                       "contents": '"Oslo"\nCapital of Norway.'}
    assert docs[2]["id"] == "2" and docs[2]["title"] == "No quotes title" and docs[2]["text"] == "body"


def test_split_and_make_contents_are_inverse():
    for title, text in [("A", "b"), ('Say "hi"', "x\ny"), ("", "only text"), ("T", "")]:
        assert split_contents(make_contents(title, text)) == (title, text)


@pytest.mark.parametrize("line, fragment", [
    ('{"id": "1", "contents": "\\"T\\"\\nok"', "malformed JSON"),
    ('["not", "an", "object"]', "expected a JSON object"),
    ('{"id": "1", "body": "x"}', "neither 'contents' nor 'text'"),
    ('{"id": "1", "contents": 5}', "'contents' must be a string"),
])
def test_malformed_line_reports_path_and_line_number(tmp_path, line, fragment):
    p = _write(tmp_path / "bad.jsonl", ['{"id": "0", "contents": "\\"T\\"\\nfine"}\n', "\n", line + "\n"])
    with pytest.raises(ValueError) as e:
        load_corpus(p)
    assert f"bad.jsonl:3:" in str(e.value) and fragment in str(e.value)
    lazy = JsonlCorpus(p)  # the lazy reader reports the same line when the row is read
    assert lazy[0]["text"] == "fine"
    with pytest.raises(ValueError, match=r"bad\.jsonl:3:"):
        lazy[1]


def test_lazy_corpus_matches_eager_with_blank_lines_crlf_unicode_and_no_final_newline(tmp_path):
    rows = [{"id": str(i), "contents": f'"Title {i} é漢"\ntext {i}\nmore'} for i in range(50)]
    lines = []
    for i, r in enumerate(rows):
        lines.append(json.dumps(r, ensure_ascii=False) + ("\r\n" if i % 3 == 0 else "\n"))
        if i % 7 == 0:
            lines.append("\n" if i % 2 else "   \n")
    lines[-1] = lines[-1].rstrip("\n")
    p = _write(tmp_path / "c.jsonl", lines)
    eager = load_corpus(p)
    cache = tmp_path / "offsets.npz"
    lazy = JsonlCorpus(p, offsets_cache=cache)
    assert len(eager) == len(lazy) == 50
    assert list(lazy) == eager and lazy[-1] == eager[-1] and lazy[10:13] == eager[10:13]
    assert cache.exists()
    assert list(JsonlCorpus(p, offsets_cache=cache)) == eager  # reloaded from the cache
    with pytest.raises(IndexError):
        lazy[50]
    assert isinstance(open_corpus(p, lazy=True), JsonlCorpus) and isinstance(open_corpus(p), list)


def test_write_corpus_round_trip_in_flashrag_format(tmp_path):
    docs = [{"id": "a", "title": "T1", "text": "x"}, {"id": "b", "contents": '"T2"\ny\nz'}]
    p = tmp_path / "out.jsonl"
    assert write_corpus(docs, p) == 2
    assert [json.loads(line) for line in p.read_text().splitlines()] == [
        {"id": "a", "contents": '"T1"\nx'}, {"id": "b", "contents": '"T2"\ny\nz'}]
    assert [d["title"] for d in load_corpus(p)] == ["T1", "T2"]


def test_missing_corpus_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="corpus file not found"):
        open_corpus(tmp_path / "nope.jsonl")
