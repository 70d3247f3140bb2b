"""POST /open on a real server over loopback: a document (a window of it) by the id a search result carried, the
open tool reaching it through the tool box, bad calls answered as observations, bad requests as 400s."""
import httpx
import numpy as np
import pytest

from megatron_searchr1.rollout.protocols.parsers import ToolCall
from megatron_searchr1.rollout.protocols.tools import ToolBox, tool_specs
from megatron_searchr1.search.base import Retriever
from megatron_searchr1.search.client import RetrievalClient
from megatron_searchr1.search.server import BackgroundServer, ServerConfig


@pytest.fixture(scope="module")
def server(bm25_index):
    with BackgroundServer(bm25_index[1], ServerConfig(port=0, max_queries=8)) as srv:
        yield srv


def test_search_results_carry_ids_and_open_reads_the_document_by_id(world, server):
    q = world["queries"][3]  # topic row 3: "why the sea level changes with the moon"
    plain = RetrievalClient(server.url, topk=2).search([q])[0]
    with_ids = RetrievalClient(server.url, topk=2, doc_ids=True).search([q])[0]
    assert plain.startswith('Doc 1(Title: "Tides")')  # Search-R1's shape unchanged by default
    assert with_ids.startswith('Doc 1(id: topic3, Title: "Tides")')
    box = ToolBox(tool_specs([{"name": "open", "options": {"max_chars": 30}}]), base_url=server.url + "/retrieve")
    calls = [ToolCall("open", {"doc_id": "topic3"}), ToolCall("open", {"doc_id": "topic3", "offset": 30}),
             ToolCall("open", {"doc_id": "nope"}), ToolCall("open", {"doc_id": "topic3", "offset": 10_000})]
    out = box.run(calls, search=None)
    text = world["docs"][3]["text"]
    assert [o.status for o in out] == ["ok"] * 4  # the server answered every call; two of them with their reason
    assert out[0].text == (f"Document topic3 (Title: Tides), characters 0-30 of {len(text)}:\n{text[:30]}\n"
                           "(continues: open it with offset 30)")
    assert out[1].text.startswith(f"Document topic3 (Title: Tides), characters 30-60 of {len(text)}:\n{text[30:60]}")
    assert out[2].text == 'Error: no document with id "nope"; open an id a search result carried'
    assert out[3].text.startswith("Error: offset 10000 is past the end of document topic3")


@pytest.mark.parametrize("body, why", [
    ({"doc_id": "1"}, "expected {\"arguments\""), ({"arguments": "1"}, "expected"),
    ({"arguments": [{"doc_id": "1"}], "max_chars": 0}, "N >= 1"),
    ({"arguments": [{"doc_id": "1"}] * 9}, "the limit is 8"),
])
def test_bad_open_requests_get_a_400_that_says_why(server, body, why):
    r = httpx.post(server.url + "/open", json=body)
    assert r.status_code == 400 and why in r.json()["detail"]
    assert httpx.get(server.url + "/health").status_code == 200


class RowIds(Retriever):
    """A corpus whose ids are row numbers (wiki-18's): looked up without a map."""

    def __init__(self, n):
        self.corpus = [{"id": str(i), "title": f"T{i}", "text": f"text {i}", "contents": f'"T{i}"\ntext {i}'}
                       for i in range(n)]

    def search_ids(self, queries, topk):
        return np.zeros((len(queries), topk), np.int64), np.zeros((len(queries), topk), np.float32)


def test_row_number_ids_and_a_window_capped_by_the_budget():
    with BackgroundServer(RowIds(5), ServerConfig(port=0)) as srv:
        r = httpx.post(srv.url + "/open", json={"arguments": [{"doc_id": "4"}, {"doc_id": 2, "offset": 2}],
                                                "max_chars": 3})
        assert r.json() == {"results": ["Document 4 (Title: T4), characters 0-3 of 6:\ntex\n(continues: open it with "
                                        "offset 3)", "Document 2 (Title: T2), characters 2-5 of 6:\nxt \n(continues: "
                                        "open it with offset 5)"]}
