"""search/protocol.py: Search-R1's /retrieve request and response as pure functions (no server)."""
import doctest
import json

import numpy as np
import pytest

from megatron_searchr1.search import protocol
from megatron_searchr1.search.protocol import RequestError, ServerConfig, parse_request, render_result


def test_doctests():
    result = doctest.testmod(protocol)
    assert result.failed == 0 and result.attempted >= 8


def test_limits_come_from_the_settings():
    config = ServerConfig(max_queries=2, max_query_chars=5, max_topk=4, default_topk=2)
    assert parse_request(json.dumps({"queries": ["a", "b"]}).encode(), config) == (["a", "b"], 2, False)
    for body, status, words in (({"queries": ["a", "b", "c"]}, 413, "the limit is 2"),
                                ({"queries": ["abcdef"]}, 413, "the limit is 5"),
                                ({"queries": ["a"], "topk": 5}, 422, "the limit is 4"),
                                ({"queries": ["a"], "topk": 2.5}, 422, "'topk' must be an integer"),
                                ({"queries": ["a"], "return_scores": "maybe"}, 422, "true or false")):
        with pytest.raises(RequestError, match=words) as e:
            parse_request(json.dumps(body).encode(), config)
        assert e.value.status == status


def test_pending_limit_defaults_to_fit_a_full_request():
    assert ServerConfig().max_pending_queries == protocol.DEFAULT_MAX_PENDING_QUERIES == 16384
    assert ServerConfig(max_queries=20000).max_pending_queries == 20000  # what --max-queries 20000 always gave
    with pytest.raises(ValueError, match="max_pending_queries"):
        ServerConfig(max_queries=8, max_pending_queries=4)


def test_render_is_what_fastapi_would_send():
    corpus = [{"id": str(i), "contents": f"passage é{i}"} for i in range(3)]
    body = render_result(corpus, np.array([[2, 0], [1, -1]]), np.array([[0.5, 0.25], [1.0, 0.0]]), True)
    assert json.loads(body) == {"result": [
        [{"document": {"id": "2", "contents": "passage é2"}, "score": 0.5},
         {"document": {"id": "0", "contents": "passage é0"}, "score": 0.25}],
        [{"document": {"id": "1", "contents": "passage é1"}, "score": 1.0}]]}
    assert "é".encode() in body  # UTF-8, not \u escapes (FastAPI's JSONResponse)
