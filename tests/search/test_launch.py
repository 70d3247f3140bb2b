"""ServerProcess: the retrieval server as a child process, as the CPU demo runs it."""
import httpx
import pytest

from megatron_searchr1.search.launch import ServerProcess


def test_a_chatty_server_keeps_serving_past_a_pipe_full_of_output(bm25_index, world):
    """Access logs write ~100 bytes a request: well past the 64 KB an unread pipe holds before the child blocks."""
    with ServerProcess(["--index-dir", bm25_index[0], "--access-log", "--log-level", "info"]) as server:
        body = {"queries": [world["queries"][3]], "topk": 1, "return_scores": False}
        with httpx.Client(timeout=10) as http:
            for _ in range(1200):
                r = http.post(f"{server.url}/retrieve", json=body)
                assert r.status_code == 200
        assert r.json()["result"][0][0]["id"] == world["docs"][3]["id"]
    assert server.proc.returncode == 0
    assert sum("POST /retrieve" in line for line in server.output) >= 1000  # the output was read, not dropped


def test_a_server_that_cannot_start_says_why(tmp_path):
    with pytest.raises(RuntimeError, match="did not start") as err:
        ServerProcess(["--index-dir", str(tmp_path / "missing")], start_timeout=60).start()
    assert "missing" in str(err.value)  # the child's own error message is in ours


def test_start_timeout_is_enforced(bm25_index):
    with pytest.raises(RuntimeError, match="still loading after 0.01s"):
        ServerProcess(["--index-dir", bm25_index[0]], start_timeout=0.01).start()
