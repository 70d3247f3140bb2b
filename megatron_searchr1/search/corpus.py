"""The passage corpus: JSONL in the FlashRAG / Search-R1 format, read eagerly or lazily.

Two row formats are accepted, one JSON object per line:
  {"id": "0", "contents": "\"Title\"\ntext ..."}      (FlashRAG / Search-R1 wiki-18)
  {"id": "0", "title": "Title", "text": "text ..."}    (plain)
Every doc handed out has `id, title, text, contents`. The title/text split follows Search-R1: the first line
of `contents` is the title (we strip its surrounding quotes), the rest is the text. Search-R1's observation
formatting (client.format_docs) works from `contents`, so it is kept verbatim.

Row i of the file (blank lines skipped) is doc index i: the faiss/BM25 indexes store these row numbers, which is
how an existing Search-R1 `e5_Flat.index` lines up with `wiki-18.jsonl`. wiki-18 is ~21M rows / 14 GB, far too
big for a list of Python dicts, so `JsonlCorpus` keeps only the byte offset of each row (8 bytes/row) and parses
a row when it is asked for.
"""
from __future__ import annotations

import json
import mmap
import os
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

# Corpora above this size are opened lazily by `open_corpus` unless told otherwise.
LAZY_THRESHOLD_BYTES = 512 * 1024 * 1024


def split_contents(contents: str) -> tuple[str, str]:
    """Search-R1's split: first line is the title (surrounding quotes stripped), the rest is the text.

    >>> split_contents('"Paris"\\nParis is the capital of France.')
    ('Paris', 'Paris is the capital of France.')
    """
    first, _, rest = contents.partition("\n")
    title = first.strip()
    if len(title) >= 2 and title[0] == '"' and title[-1] == '"':
        title = title[1:-1]
    return title, rest


def make_contents(title: str, text: str) -> str:
    """The FlashRAG `contents` string for a title and a text.

    >>> make_contents("Paris", "Capital of France.")
    '"Paris"\\nCapital of France.'
    """
    return f'"{title}"\n{text}'


def parse_doc(obj: object, row: int, where: str = "") -> dict:
    """Normalise one parsed JSONL row into `{id, title, text, contents}`; `where` prefixes error messages."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}expected a JSON object per line, got {type(obj).__name__}")
    doc_id = obj.get("id", str(row))  # a missing id falls back to the row number, as a string like wiki-18's
    if "contents" in obj:
        contents = obj["contents"]
        if not isinstance(contents, str):
            raise ValueError(f"{where}'contents' must be a string, got {type(contents).__name__}")
        title, text = split_contents(contents)
    elif "text" in obj:
        title, text = obj.get("title", ""), obj["text"]
        if not isinstance(title, str) or not isinstance(text, str):
            raise ValueError(f"{where}'title' and 'text' must be strings")
        contents = make_contents(title, text)
    else:
        raise ValueError(
            f"{where}row has neither 'contents' nor 'text' (keys: {sorted(obj)}); expected "
            '{"id", "contents": "\\"Title\\"\\ntext"} or {"id", "title", "text"}'
        )
    return {"id": str(doc_id) if not isinstance(doc_id, str) else doc_id, "title": title, "text": text,
            "contents": contents}


def _parse_line(line: str | bytes, row: int, path: str, line_no: int) -> dict:
    where = f"{path}:{line_no}: "
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}malformed JSON ({e.msg} at column {e.colno})") from None
    return parse_doc(obj, row, where)


def load_corpus(path: str | os.PathLike) -> list[dict]:
    """Read a whole corpus JSONL into memory. Blank lines are skipped; bad rows raise with their line number."""
    path = os.fspath(path)
    docs: list[dict] = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            docs.append(_parse_line(line, len(docs), path, line_no))
    return docs


def _last_line(path: str, block: int = 1 << 16) -> bytes:
    """The last non-empty line of a file (stripped), read from its tail only."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        end, tail = size, b""
        while end > 0:  # step back until the tail holds a whole non-empty line
            start = max(0, end - block)
            f.seek(start)
            tail = f.read(end - start) + tail
            end = start
            body = tail.rstrip(b" \t\r\n")
            if body and (b"\n" in body or start == 0):
                break
    return tail.rstrip(b" \t\r\n").rsplit(b"\n", 1)[-1].strip()


def _first_line(path: str) -> bytes:
    """The first non-empty line of a file (stripped)."""
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                return line.strip()
    return b""


def last_row_problem(path: str | os.PathLike) -> str | None:
    """What is wrong with the corpus's last non-empty line, or None. A corpus cut short mid-write ends in half a
    row; reading only the tail finds that in milliseconds even for wiki-18, before any index or model loads."""
    line = _last_line(os.fspath(path))
    if not line:
        return None
    try:
        parse_doc(json.loads(line), 0, "")
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        return f"its last line is not a complete row ({e})"
    return None


def corpus_fingerprint(path: str | os.PathLike) -> dict:
    """{"first": ..., "last": ...}: a hash of the first and the last passage's `contents` (16 hex digits each).

    With the passage count (index_meta.json's num_docs) this tells one corpus from another of the same size in
    milliseconds, from the file's two ends: an index records it when it is built and checks it before it serves a
    corpus, so a moved or swapped corpus is refused instead of served with the wrong passages. The parsed contents
    are hashed, not the bytes, so the same passages written in the other row format (or JSON escaping) still match.
    The file's last line must be a complete row (`last_row_problem` says when it is not)."""
    import hashlib

    path = os.fspath(path)

    def digest(line: bytes) -> str:
        if not line:
            raise ValueError(f"{path} has no passages")
        doc = _parse_line(line, 0, path, 0)
        return hashlib.sha256(doc["contents"].encode("utf-8")).hexdigest()[:16]

    return {"first": digest(_first_line(path)), "last": digest(_last_line(path))}


def write_corpus(docs: Iterable[dict], path: str | os.PathLike) -> int:
    """Write docs (any accepted format) as FlashRAG JSONL `{"id", "contents"}`; returns the number of rows."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            doc = parse_doc(d, i, f"doc {i}: ")
            f.write(json.dumps({"id": doc["id"], "contents": doc["contents"]}, ensure_ascii=False) + "\n")
            n += 1
    return n


def scan_line_offsets(path: str | os.PathLike,
                      chunk_bytes: int = 64 * 1024 * 1024) -> tuple[np.ndarray, np.ndarray]:
    """Byte offsets of the non-empty lines, (N+1,) with the file end appended, and their 0-based line numbers (N,).

    Vectorised over 64 MB chunks, so a 14 GB corpus is scanned in about a minute.
    """
    starts: list[np.ndarray] = []
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        base = 0
        while True:
            buf = f.read(chunk_bytes)
            if not buf:
                break
            nl = np.flatnonzero(np.frombuffer(buf, dtype=np.uint8) == 10).astype(np.int64) + base
            starts.append(nl + 1)  # a line starts right after each newline
            base += len(buf)
    line_starts = np.concatenate([np.zeros(1, np.int64), *starts]) if starts else np.zeros(1, np.int64)
    line_starts = line_starts[line_starts < size]
    ends = np.append(line_starts[1:], size)
    # Blank lines are skipped, as load_corpus does. Rows start with "{", so only lines that start with whitespace
    # can be blank: read just those (rare) instead of every line.
    nonempty = np.ones(len(line_starts), dtype=bool)
    if size:
        first_bytes = np.memmap(path, dtype=np.uint8, mode="r")[line_starts]
        suspects = np.flatnonzero(np.isin(first_bytes, np.frombuffer(b" \t\r\n", np.uint8)))
        with open(path, "rb") as f:
            for i in suspects:
                f.seek(line_starts[i])
                nonempty[i] = bool(f.read(int(ends[i] - line_starts[i])).strip())
    keep = np.flatnonzero(nonempty)
    return np.append(line_starts[keep], size).astype(np.int64), keep.astype(np.int64)


class JsonlCorpus(Sequence):
    """A read-only, memory-light view of a corpus JSONL: `corpus[i]` parses row i on demand (thread-safe).

    `offsets_cache`: optional .npz path to save/load the offset table so a 14 GB corpus is scanned once.
    """

    def __init__(self, path: str | os.PathLike, offsets_cache: str | os.PathLike | None = None):
        self.path = os.path.abspath(os.fspath(path))
        stat = os.stat(self.path)
        signature = np.array([stat.st_size, int(stat.st_mtime)], dtype=np.int64)
        loaded = False
        if offsets_cache is not None and os.path.exists(offsets_cache):
            cached = np.load(offsets_cache)
            if np.array_equal(cached["signature"], signature):
                self._offsets, self._line_idx = cached["offsets"], cached["line_idx"]
                loaded = True
        if not loaded:
            self._offsets, self._line_idx = scan_line_offsets(self.path)
            if offsets_cache is not None:
                np.savez(offsets_cache, offsets=self._offsets, line_idx=self._line_idx, signature=signature)
        self._file = open(self.path, "rb")
        self._mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if stat.st_size else b""

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = int(i)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"doc index {i} out of range for a corpus of {len(self)} docs")
        raw = self._mm[self._offsets[i]:self._offsets[i + 1]]
        return _parse_line(raw, i, self.path, int(self._line_idx[i]) + 1)

    def __iter__(self) -> Iterator[dict]:
        for i in range(len(self)):
            yield self[i]

    def close(self) -> None:
        if isinstance(self._mm, mmap.mmap):
            self._mm.close()
        self._file.close()


def open_corpus(path: str | os.PathLike, lazy: bool | None = None,
                offsets_cache: str | os.PathLike | None = None) -> Sequence[dict]:
    """A corpus as a sequence of docs: a list in memory, or a `JsonlCorpus` (lazy=None: lazy above 512 MB)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"corpus file not found: {path}")
    if lazy is None:
        lazy = os.path.getsize(path) > LAZY_THRESHOLD_BYTES
    return JsonlCorpus(path, offsets_cache) if lazy else load_corpus(path)
