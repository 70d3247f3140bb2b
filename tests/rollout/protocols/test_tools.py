"""The tool box: declarations from the config, argument checks, where calls go (search, HTTP, Python), failures."""
import doctest

import pytest

from megatron_searchr1.config import tools as config_tools
from megatron_searchr1.rollout.protocols import parsers, search_r1, tool_calls, tools
from megatron_searchr1.rollout.protocols.parsers import ToolCall, get_parser
from megatron_searchr1.rollout.protocols.tools import BUILTIN, ToolBox, is_tool_failure, tool_specs
from megatron_searchr1.search.client import SearchFailure


@pytest.mark.parametrize("module", [parsers, tools, search_r1, tool_calls, config_tools])
def test_doctests(module):
    assert doctest.testmod(module).failed == 0


def shout(text):
    return text.upper()


def boom(**_):
    raise OSError("disk gone")


def test_declared_tools_and_builtins():
    specs = tool_specs(["search", {"name": "open", "options": {"max_chars": 50}},
                        {"name": "shout", "description": "Shout.", "endpoint": f"python:{__name__}:shout",
                         "parameters": {"type": "object", "properties": {"text": {"type": "string"}},
                                        "required": ["text"], "additionalProperties": False}}])
    assert [s.name for s in specs] == ["search", "open", "shout"]
    assert specs[1].options == {"max_chars": 50} and specs[1].endpoint == "/open"
    assert specs[2].schema()["function"]["parameters"]["required"] == ["text"]
    for bad, why in [(["browse"], "unknown built-in tool 'browse'"), ([{"name": "x"}], "say where its calls go"),
                     ([{"name": "x", "endpoint": "ftp://x"}], "is none of"), (["search", "search"], "appears twice"),
                     ([{"name": "x", "endpoint": "search", "colour": 1}], "unknown keys")]:
        with pytest.raises(ValueError, match=why):
            tool_specs(bad)


def test_calls_go_where_their_tool_says_and_invalid_ones_go_nowhere():
    box = ToolBox(tool_specs(["search", {"name": "shout", "endpoint": f"python:{__name__}:shout",
                                         "parameters": {"type": "object", "properties": {"text": {"type": "string"}},
                                                        "required": ["text"], "additionalProperties": False}},
                              {"name": "boom", "endpoint": f"python:{__name__}:boom"}]))
    searched = []

    def search(queries):
        searched.append(queries)
        return [SearchFailure("HTTP 503") if q == "down" else f"docs for {q}" for q in queries]

    calls = [ToolCall("search", {"query": " a "}), ToolCall("shout", {"text": "hi"}), ToolCall("nope", {}),
             ToolCall("shout", {"text": "x", "loud": True}), ToolCall("search", {"query": "down"}),
             ToolCall(error="the call is not JSON"), ToolCall("boom", {})]
    out = box.run(calls, search)
    assert searched == [["a", "down"]]  # every search of the turn in one call of the searcher
    assert [o.status for o in out] == ["ok", "ok", "invalid", "invalid", "failed", "invalid", "failed"]
    assert out[0].text == "docs for a" and out[1].text == "HI"
    assert out[2].text == "Error: unknown tool 'nope'; the tools are search, shout, boom"
    assert out[3].text == "Error: unknown argument 'loud' (arguments: text)"
    assert is_tool_failure(out[4].text) and out[6].text == "Tool failed: boom: OSError: disk gone"


def test_a_path_endpoint_needs_the_retrieval_server():
    box = ToolBox([BUILTIN["open"]])
    (o,) = box.run([ToolCall("open", {"doc_id": "1"})], lambda q: [])
    assert o.status == "failed" and "no server URL is known" in o.text


def test_hermes_parser_reads_every_call_and_reports_unreadable_ones():
    p = get_parser("hermes")
    content, calls = p.parse('<think>x</think>\n<tool_call>\n{"name": "search", "arguments": "{\\"query\\": \\"q\\"}"}'
                             '\n</tool_call>\n<tool_call>{"name": "open", "arguments": [1]}</tool_call>'
                             '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "open"')
    assert content == "<think>x</think>"
    assert (calls[0].name, calls[0].arguments, calls[0].error) == ("search", {"query": "q"}, None)
    assert calls[1].error == "the arguments must be a JSON object"
    assert calls[2].error.startswith("the call must be a JSON object")
    assert calls[3].error == "the call is not closed with </tool_call>"
    with pytest.raises(ValueError, match="unknown tool-call parser 'qwen9'; choose one of hermes"):
        get_parser("qwen9")
    assert set(parsers.PARSERS) | {"auto"} == set(config_tools.TOOL_PARSERS)  # the config's list is the parsers'


@pytest.mark.slow
def test_an_engines_ranks_call_a_tool_once_and_share_its_results_under_torchrun(tmp_path):
    """rollout.engine_tp=2: both ranks of the engine run the same tool rounds (as the loop does on each); the Python
    tool runs on the engine's first rank only, once per call, and both ranks get its results, as searches are."""
    from tests.dist_utils import REPO, rank_results, run_torchrun

    out = run_torchrun(REPO / "tests/rollout/protocols/tool_once_script.py", 2, str(tmp_path), timeout=600)
    res = {r["rank"]: r for r in rank_results(out)}
    assert sorted(res) == [0, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0"]  # rank 1 never called it
    assert (tmp_path / "rank0").read_text().split() == ["Oslo", "Rome", "Pisa"]  # once per call
    assert res[0]["texts"] == res[1]["texts"] == [
        ["Oslo by walk, planned on rank 0", 'Doc 1(id: 1, Title: "X") acme (searched on rank 0)\n',
         "Rome by train, planned on rank 0"], ["Pisa by walk, planned on rank 0"]]
    assert (res[0]["searched"], res[1]["searched"]) == (["acme"], [])
